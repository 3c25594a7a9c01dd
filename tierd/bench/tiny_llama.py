"""A small, seeded random Llama for real `vllm serve` (no model hub here): Hugging Face
``LlamaForCausalLM`` saved as safetensors, and a word-level tokenizer whose words are ``w0``,
``w1``, ... (one token each, so a prompt of N words is N tokens). Built once per parameter set
under a cache directory and reused.

    python -m tierd.bench.tiny_llama DIR [--seed S]      # build (or reuse) and print the path

Needs torch, transformers and tokenizers (vLLM's venv has them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

VOCAB = 2048
SPECIAL = ["<unk>", "<s>", "</s>"]


def config(seed: int) -> dict[str, object]:
    """The checkpoint's config: every seed the same shape (only the weights differ)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
            "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def build(root: str, name: str, seed: int) -> str:
    """``root/name``: the model of ``seed`` (built now if missing; atomic against a second
    builder)."""
    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    # transformers' own annotations disagree with its documented use: handle it untyped.
    hf: Any = transformers

    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=f".{name}-")
    torch.manual_seed(seed)
    cfg = config(seed)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(**{k: v for k, v in cfg.items()
                                                  if k not in ("architectures", "torch_dtype")}))
    with torch.no_grad():  # larger weights than the default init: outputs depend on context
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    words = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = hf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                      eos_token="</s>")
    fast.save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        saved = json.load(f)
    saved["torch_dtype"] = "bfloat16"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    try:
        os.rename(tmp, path)
    except OSError:  # another builder won
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def prompt(n: int, seed: int) -> str:
    """``n`` words (tokens) drawn from ``seed``."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(VOCAB - len(SPECIAL))}" for _ in range(n))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--name", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.root, args.name, args.seed))
