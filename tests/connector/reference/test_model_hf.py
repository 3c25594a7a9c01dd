"""Independent check that the reference ``model`` is a real Llama: logits equal Hugging
Face's."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from tierd.connector.reference.model import (
    DecoderLayer,
    DenseCausalAttention,
    LlamaModel,
    ModelConfig,
)

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed (it is the `hf` extra: pip install -e '.[hf]')",
)


def _hf_twin(ours: LlamaModel) -> Any:
    """Build ``LlamaForCausalLM`` from a tiny config (no download) with our weights copied in."""
    cfg = ours.cfg
    kwargs: dict[str, object] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
    )
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        kwargs["rope_theta"] = cfg.rope_theta
    hf_cfg = transformers.LlamaConfig(**kwargs)
    hf_cfg._attn_implementation = "eager"
    hf: Any = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.embed_tokens.weight)
        for mine, theirs in zip(_layers(ours), hf.model.layers, strict=True):
            wq, wk, wv = torch.split(mine.qkv_proj.weight, [q, kv, kv])
            theirs.self_attn.q_proj.weight.copy_(wq)
            theirs.self_attn.k_proj.weight.copy_(wk)
            theirs.self_attn.v_proj.weight.copy_(wv)
            theirs.self_attn.o_proj.weight.copy_(mine.o_proj.weight)
            gate, up = mine.gate_up_proj.weight.chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(mine.down_proj.weight)
            theirs.input_layernorm.weight.copy_(mine.input_norm.weight)
            theirs.post_attention_layernorm.weight.copy_(mine.post_attention_norm.weight)
        hf.model.norm.weight.copy_(ours.norm.weight)
        if not cfg.tie_word_embeddings:
            hf.lm_head.weight.copy_(ours.lm_head.weight)
    return hf


def _layers(model: LlamaModel) -> list[DecoderLayer]:
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    assert len(layers) == model.cfg.num_layers, "every layer is a DecoderLayer"
    return layers


def _ours(cfg: ModelConfig) -> LlamaModel:
    """Our model with random (not unit) norm weights, so a missed norm scale shows."""
    model = LlamaModel(cfg)
    gen = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=gen))
    return model


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=32, max_position=4096),
        ModelConfig(vocab_size=384, hidden_size=96, intermediate_size=160, num_layers=2,
                    num_heads=4, num_kv_heads=1, head_dim=32, max_position=4096,
                    tie_word_embeddings=True, rope_theta=10000.0, seed=3),
    ],
    ids=["gqa2-untied", "mqa-tied-headdim-neq-hidden"],
)
def test_logits_match_hf_llama(cfg: ModelConfig) -> None:
    """Same weights, sequences at positions 0.. and 3000..: logits equal HF's to 1e-4."""
    ours = _ours(cfg)
    hf = _hf_twin(ours)
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (37, 21)]
    starts = [0, 3000]
    with torch.inference_mode():
        tokens = torch.cat(seqs)
        positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, seqs)])
        hidden = ours(tokens, positions, DenseCausalAttention([len(t) for t in seqs]))
        mine = torch.split(ours.compute_logits(hidden), [len(t) for t in seqs])
        for seq, start, got in zip(seqs, starts, mine, strict=True):
            pos = torch.arange(start, start + len(seq))[None]
            want = hf(input_ids=seq[None], position_ids=pos).logits[0].float()
            assert got.shape == want.shape == (len(seq), cfg.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert got.abs().max() > 1.0, "logits are too small for the check to mean anything"
