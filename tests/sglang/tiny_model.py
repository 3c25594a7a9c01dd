"""A tiny checkpoint folder (``config.json`` and one safetensors file of seeded weights): what
tierd's model identity fingerprints. The HiCache tests never run the model."""

from __future__ import annotations

import json
import os

import torch


def model_dir_in(root: str, name: str, seed: int) -> str:
    """Write ``root/name`` with weights drawn from ``seed`` (every seed: the same config and
    shapes); return its path."""
    from safetensors.torch import save_file

    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    save_file({f"model.layers.{i}.self_attn.k_proj.weight":
               torch.randn(64, 64, generator=gen).to(torch.float16) for i in range(3)},
              os.path.join(path, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "torch_dtype": "float16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path
