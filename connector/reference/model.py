"""A small Llama-shaped decoder in Torch, with seeded random weights, for the reference engine.

The architecture is Llama's (checked against Hugging Face ``LlamaForCausalLM`` in
``tests/connector/reference/test_model_hf.py``): token embedding, ``num_layers`` pre-norm blocks of
RMSNorm -> GQA self-attention with rotary position embedding (non-interleaved "rotate half",
Llama-3 base ``rope_theta``, no scaling) -> residual, RMSNorm -> SwiGLU MLP -> residual, a final
RMSNorm and an LM head (tied to the embedding or not).

The model never owns a KV cache. ``forward`` takes a flattened batch of tokens from any number of
sequences (varlen: ``[num_tokens]`` token ids and their absolute positions) and an
``AttentionBackend``; each layer hands the backend its rotated q, k and v and gets the attention
output back. The engine's backend writes k/v into the paged pool and attends over it; the dense
backend here (``DenseCausalAttention``) is the no-paging reference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tierd.model_identity import ModelIdentity, identity_from_parts

ModelDType = Literal["float32", "bfloat16", "float16"]

_TORCH_DTYPES: dict[ModelDType, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. The default (~31M parameters: 8 layers of hidden 512, 8 query and
    2 KV heads of dim 64, SwiGLU 1,408, vocabulary 8,192, fp32) is small enough to prefill
    2,048 tokens on a CPU in a test (``python -m tierd.connector.reference.engine`` times it). fp32
    because CPUs without half-precision matrix units run it faster, and it matches Hugging Face
    to 1e-4. A 16-token KV block is 8 x 2 x 2 x 64 x 16 x 4 B = 64 KiB."""

    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 8192
    tie_word_embeddings: bool = False
    dtype: ModelDType = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (GQA); pick num_kv_heads dividing num_heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embedding")
        if self.dtype not in _TORCH_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {sorted(_TORCH_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]


class AttentionBackend(Protocol):
    """What a layer calls to attend. The backend knows the batch layout (which tokens belong to
    which sequence, their cached context) from the step it was built for."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend for ``layer``.

        ``q`` is ``[num_tokens, num_heads, head_dim]``, ``k``/``v`` are
        ``[num_tokens, num_kv_heads, head_dim]``, all rotated, in the batch's token order.
        Returns ``[num_tokens, num_heads, head_dim]`` in the model's dtype. A paged backend also
        stores ``k``/``v`` in its cache before attending (that is its side effect)."""
        ...


class DenseCausalAttention:
    """No-paging reference: causal attention within each sequence of a varlen batch, over the
    batch's own tokens only (every sequence starts at position 0 of its tokens here)."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        outs = []
        lens = self.seq_lens
        for qs, ks, vs in zip(
            torch.split(q, lens), torch.split(k, lens), torch.split(v, lens), strict=True
        ):
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                is_causal=True, enable_gqa=True,
            )
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (HF's order of operations)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(head_dim: int, theta: float, max_position: int) -> tuple[Tensor, Tensor]:
    """Cos/sin tables ``[max_position, head_dim]`` (fp32) for non-interleaved rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-token ``cos``/``sin`` ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DecoderLayer(nn.Module):
    """One pre-norm block; q/k/v and gate/up projections are fused for fewer matmuls."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        cfg = self.cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.qkv_proj(self.input_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin).to(x.dtype)
        k = apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin).to(x.dtype)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        o = attention(self.layer, q, k, v)
        x = x + self.o_proj(o.reshape(-1, q_size))
        gate, up = self.gate_up_proj(self.post_attention_norm(x)).chunk(2, dim=-1)
        out: Tensor = x + self.down_proj(F.silu(gate) * up)
        return out


class LlamaModel(nn.Module):
    """The decoder with seeded random weights (deterministic for a given ``cfg.seed``).

    Weights: embeddings ~ N(0, 1), linear layers ~ U(+-1/sqrt(fan_in)) (torch's default), norm
    weights 1. Unit-scale activations make attention and the next token depend on the context,
    so a wrong KV block changes the greedy output (the engine's tests rely on that)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        torch.random.set_rng_state(generator_state)
        self.requires_grad_(False)
        self.to(cfg.torch_dtype)
        cos, sin = rope_cos_sin(cfg.head_dim, cfg.rope_theta, cfg.max_position)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, token_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        """Hidden states ``[num_tokens, hidden]`` (after the final norm) for a flattened batch.

        ``token_ids`` and ``positions`` are int64 ``[num_tokens]``; positions are absolute (a
        chunk continuing a cached prefix starts at the prefix length)."""
        if token_ids.shape != positions.shape or token_ids.dim() != 1 or not len(token_ids):
            raise ValueError("token_ids and positions must be non-empty 1-D tensors of one length")
        if int(positions.max()) >= self.cfg.max_position:
            raise ValueError(f"position >= max_position={self.cfg.max_position}; raise it")
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed_tokens(token_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        hidden: Tensor = self.norm(x)
        return hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[n, vocab]`` in fp32 for selected hidden rows (only the rows you sample)."""
        logits: Tensor = self.lm_head(hidden).float()
        return logits


_SAMPLE_BYTES = 4096


def model_identity(model: LlamaModel) -> ModelIdentity:
    """The model id of ``model`` (``tierd.model_identity``): its config and, like a checkpoint's,
    each weight's name, dtype, shape and its first, middle and last 4 KiB. Costs one small copy
    per tensor."""
    parts: list[bytes] = []
    for name, tensor in sorted(model.state_dict().items()):
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        n, size = min(_SAMPLE_BYTES, raw.numel()), raw.numel()
        middle = (size - n) // 2
        parts.append(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        for start in (0, middle, size - n):
            parts.append(raw[start:start + n].cpu().numpy().tobytes())
    return identity_from_parts("reference-llama", parts, asdict(model.cfg))
