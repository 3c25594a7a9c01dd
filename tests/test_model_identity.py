"""Model ids from checkpoints: content, not names or paths, decides; settings count; bad ids are
refused with the fix."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from tierd.model_identity import (
    MAX_MODEL_ID_LEN,
    checkpoint_defaults,
    identity_from_checkpoint,
    identity_of_argument,
    kv_settings,
    label_of,
    validate_model_id,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
SETTINGS = kv_settings("bfloat16", None)


def write_safetensors(path: Path, tensors: dict[str, bytes], metadata: dict[str, str] | None = None
                      ) -> None:
    """A safetensors file of uint8 tensors (the format: u64 header length, JSON header, data)."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset,
                                                                               offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


def checkpoint(root: Path, name: str, seed: int, *, size: int = 50_000) -> Path:
    """A model folder: ``CONFIG`` and two shards of seeded bytes (same shapes for every seed)."""
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    for shard in range(2):
        data = {f"layers.{shard}.{w}": bytes((seed * 131 + shard * 7 + i * (w + 3)) % 251
                                             for i in range(size)) for w in range(3)}
        write_safetensors(folder / f"model-0000{shard}.safetensors", data)
    return folder


def model_id(folder: Path, settings: dict[str, object] = SETTINGS) -> str:
    return identity_from_checkpoint(folder, settings).model_id


def test_same_shape_other_weights_differ_copies_agree(tmp_path: Path) -> None:
    """Identical config.json and headers, other tensor bytes: other ids. A copy elsewhere under
    another name: the same digest (content decides), its own label."""
    base, tuned = checkpoint(tmp_path, "base", 1), checkpoint(tmp_path, "tuned", 2)
    assert model_id(base).split("@")[1] != model_id(tuned).split("@")[1]
    copy = tmp_path / "copy-of-base"
    shutil.copytree(base, copy)
    assert model_id(copy).split("@")[1] == model_id(base).split("@")[1]
    assert model_id(base).startswith("base@") and model_id(copy).startswith("copy-of-base@")


def test_rewrite_in_place_changes_the_id(tmp_path: Path) -> None:
    """New weights written over the old files (same names, sizes, headers): a new id. One byte
    changed in the middle of one tensor: a new id too (it is a sampled piece)."""
    folder = checkpoint(tmp_path, "m", 1)
    before = model_id(folder)
    shutil.rmtree(folder)
    checkpoint(tmp_path, "m", 3)
    after = model_id(folder)
    assert after != before
    shard = folder / "model-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    begin, end = header["layers.0.1"]["data_offsets"]
    raw[8 + length + (begin + end) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert model_id(folder) != after


def test_config_and_settings_count_formatting_does_not(tmp_path: Path) -> None:
    """A RoPE change in config.json, another compute dtype, a quantization or overrides: other
    ids. The same config rewritten with other whitespace: the same id."""
    folder = checkpoint(tmp_path, "m", 1)
    first = model_id(folder)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    assert model_id(folder) == first
    assert model_id(folder, kv_settings("float16", None)) != first
    assert model_id(folder, kv_settings("bfloat16", "fp8")) != first
    assert model_id(folder, kv_settings("bfloat16", None, {"rope_scaling": {"factor": 2}})) != first
    (folder / "config.json").write_text(json.dumps({**CONFIG, "rope_theta": 1e6}))
    assert model_id(folder) != first


def test_other_formats_and_single_files(tmp_path: Path) -> None:
    """A .bin checkpoint is sampled across the file; a lone .gguf file is its own checkpoint; a
    file that only claims to be safetensors is sampled like any other."""
    folder = tmp_path / "bin"
    folder.mkdir()
    weights = folder / "pytorch_model.bin"
    weights.write_bytes(bytes(range(256)) * 1000)
    first = model_id(folder)
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 1
    weights.write_bytes(bytes(raw))
    assert model_id(folder) != first
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(5000))
    assert identity_from_checkpoint(gguf, SETTINGS).model_id.startswith("tiny.gguf@")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(b"\xff" * 64)
    assert model_id(fake).startswith("fake@")


def test_no_weights_names_the_override(tmp_path: Path) -> None:
    """A folder with only config.json cannot be told from another of its shape: ValueError
    naming model_id."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match="set model_id"):
        identity_from_checkpoint(tmp_path, SETTINGS)


def test_model_id_spelling_and_labels() -> None:
    """Ids are 1..128 of [A-Za-z0-9._:@+/-]; labels keep the last path component, readable."""
    assert validate_model_id("meta-llama/Llama-3-8B@rev:abc+1") == "meta-llama/Llama-3-8B@rev:abc+1"
    for bad in ("", "a b", "x|y", "é", "a" * (MAX_MODEL_ID_LEN + 1), None, 3):
        with pytest.raises(ValueError, match="model_id"):
            validate_model_id(bad)
    assert label_of("/models/Llama 3 (8B)/") == "Llama-3-8B"
    assert label_of("meta-llama/Llama-3.1-8B") == "Llama-3.1-8B"
    assert label_of("///") == "model"


def test_command_line_argument(tmp_path: Path) -> None:
    """``--model`` takes a folder (with its config's dtype and quantization) or an id."""
    folder = checkpoint(tmp_path, "m", 1)
    assert checkpoint_defaults(folder) == SETTINGS
    assert identity_of_argument(str(folder)).model_id == model_id(folder)
    assert identity_of_argument("m@0123").model_id == "m@0123"
    with pytest.raises(ValueError, match="model_id"):
        identity_of_argument(os.path.join(str(tmp_path), "missing dir"))
    (folder / "config.json").write_text(json.dumps({"quantization_config":
                                                    {"quant_method": "awq"},
                                                    "dtype": "float16"}))
    assert checkpoint_defaults(folder) == kv_settings("float16", "awq")
