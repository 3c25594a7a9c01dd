"""Model identity: which weights computed a block, as a short string in every namespace.

Hash chains say nothing about the model (a base model and its fine-tune hash a prompt alike),
so every namespace (``tierd.wire.layout.Layout.model_id``) carries a *model id*, built only
here, by every front end: ``"<label>@<digest>"``, e.g. ``"Llama-3-8B-Instruct@3f2a9c1b7d6e5f40"``.

- ``label``: readable (the served model name or the checkpoint folder), for ``tierd stats``.
- ``digest``: 16 hex digits of sha256 over ``config.json`` (canonical JSON), the engine settings
  that change K and V for given weights (compute dtype, quantization, config overrides), and
  every top-level weight file's name, size, safetensors header and 4 KiB from the start, middle
  and end of every tensor (other formats: 65 evenly spaced 4 KiB pieces).

So copies of one checkpoint served under one name share blocks; other weights, or files rewritten
in place, get another id; an edit that leaves every sampled piece as it was is not seen (set
``model_id`` by hand then). ``model_id`` given outright shares one cache between checkpoints; a
wrong value serves one model's KV to another (``validate_model_id`` checks only its spelling).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

MAX_MODEL_ID_LEN = 128
_MODEL_ID = re.compile(r"[A-Za-z0-9._:@+/-]+")
_LABEL_BAD = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_LABEL_LEN = 64
_VERSION = b"tierd-model-v1"
_SAMPLE = 4096
_SPREAD = 64
"""Pieces taken across a weight file tierd cannot parse (plus its last piece)."""
_MAX_HEADER = 100 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """A model id and how it was obtained."""

    model_id: str
    """``label@digest`` (or the operator's override): what namespaces carry."""
    source: str
    """One line for the logs: what was fingerprinted, or "model_id override"."""
    seconds: float = 0.0
    """Wall time spent deriving it (reading the samples)."""


def validate_model_id(text: object) -> str:
    """``text`` if it is a usable model id, else ``ValueError`` naming the fix."""
    if not isinstance(text, str) or not text:
        raise ValueError("model_id must be a non-empty string (tierd derives one from the "
                         "weights; an engine that sends none predates model identity: "
                         "upgrade its tierd connector)")
    if len(text) > MAX_MODEL_ID_LEN or not _MODEL_ID.fullmatch(text):
        raise ValueError(f"model_id must be at most {MAX_MODEL_ID_LEN} characters of letters, "
                         f"digits and . _ : @ + / -, got {text[:MAX_MODEL_ID_LEN]!r}")
    return text


def label_of(name: str) -> str:
    """A readable label from a model name or path: its last component, other characters
    replaced by '-', clipped (e.g. ``/models/Llama 3`` -> ``Llama-3``)."""
    tail = name.rstrip("/").rsplit("/", 1)[-1]
    label = _LABEL_BAD.sub("-", tail).strip("-.")[:_MAX_LABEL_LEN]
    return label or "model"


def identity_from_parts(label: str, parts: Iterable[bytes],
                        settings: Mapping[str, object]) -> ModelIdentity:
    """The model id of a model described by ``parts`` (byte strings that determine its weights,
    in a fixed order) run with ``settings`` (JSON-able engine settings that change KV)."""
    start = time.perf_counter()
    digest = hashlib.sha256(_VERSION)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    digest.update(_canonical(settings))
    return ModelIdentity(f"{label_of(label)}@{digest.hexdigest()[:16]}", "weights",
                         time.perf_counter() - start)


def identity_from_checkpoint(path: str | os.PathLike[str], settings: Mapping[str, object], *,
                             label: str | None = None) -> ModelIdentity:
    """The model id of the checkpoint at ``path`` (a folder, or one weight file such as a
    ``.gguf``) with ``settings``. ``ValueError`` naming the fix if it holds no weight files."""
    start = time.perf_counter()
    root = Path(path)
    files = _weight_files(root)
    if not files:
        raise ValueError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {str(root)!r}, so "
                         "tierd cannot tell these weights from others of the same shape: set "
                         "model_id explicitly (kv_connector_extra_config)")
    stats = _Read()
    parts = config_parts(root)
    for file in files:
        parts.append(file.name.encode())
        parts.extend(_file_parts(file, stats))
    found = identity_from_parts(label or root.name, parts, settings)
    source = (f"weights of {root} ({len(files)} files, {stats.tensors} tensors, "
              f"{stats.bytes_read / 2**20:.1f} MiB sampled)")
    return ModelIdentity(found.model_id, source, time.perf_counter() - start)


def config_parts(path: str | os.PathLike[str]) -> list[bytes]:
    """The digest's part for the ``config.json`` of the checkpoint at ``path`` (canonical JSON;
    none if it has no config)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return []
    return [b"config.json" + _canonical(json.loads(config.read_text()))]


def kv_settings(dtype: str, quantization: str | None,
                overrides: Mapping[str, object] | None = None) -> dict[str, object]:
    """The engine settings that change K and V for given weights, as every front end names
    them: the compute ``dtype`` ("bfloat16"), the ``quantization`` method (None: none) and
    config ``overrides`` (vLLM's ``--hf-overrides``: RoPE scaling and the like; empty: none)."""
    settings: dict[str, object] = {"dtype": dtype, "quantization": quantization}
    if overrides:
        settings["overrides"] = dict(overrides)
    return settings


def checkpoint_defaults(path: str | os.PathLike[str]) -> dict[str, object]:
    """``kv_settings`` of an engine that runs the checkpoint at ``path`` as its ``config.json``
    says (its dtype, its quantization method, no overrides): what ``tierd hash --model`` and
    ``tierd route --model`` assume. ``ValueError`` if the config names no dtype."""
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    dtype = config.get("torch_dtype") or config.get("dtype")
    if not isinstance(dtype, str):
        raise ValueError(f"{config_path} names no torch_dtype: pass the model id the engine "
                         "logged (`tierd stats` lists it) instead of the folder")
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return kv_settings(dtype, method if isinstance(method, str) else None)


def identity_of_argument(text: str) -> ModelIdentity:
    """A command-line ``--model``: a checkpoint folder or file that exists (its id as an engine
    running it with ``checkpoint_defaults`` derives it), else a model id as engines log it."""
    if os.path.exists(text):
        return identity_from_checkpoint(text, checkpoint_defaults(text),
                                        label=os.path.basename(os.path.abspath(text)))
    return override(text)


def override(model_id: str) -> ModelIdentity:
    """The operator's explicit id (validated)."""
    return ModelIdentity(validate_model_id(model_id), "model_id override")


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr).encode()


def _weight_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root] if root.name.endswith(WEIGHT_SUFFIXES) else []
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())


@dataclass(slots=True)
class _Read:
    tensors: int = 0
    bytes_read: int = 0


def _file_parts(file: Path, stats: _Read) -> list[bytes]:
    """The byte strings of one weight file that go into the digest: its size, a safetensors
    header, then the sampled pieces (all announced to the kernel first with
    ``POSIX_FADV_WILLNEED``, so cold pieces are read from disk in parallel, not seek by seek)."""
    with open(file, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        out = [size.to_bytes(8, "little")]
        spans = _safetensors_spans(fd, size, out) if file.name.endswith(".safetensors") else None
        if spans is None:
            step = max(1, size // _SPREAD)
            spans = [(off, min(_SAMPLE, size - off)) for off in range(0, size, step)]
            spans.append((max(0, size - _SAMPLE), min(_SAMPLE, size)))
        else:
            stats.tensors += len(spans) // 3
        for offset, length in spans:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        pieces = [os.pread(fd, length, offset) for offset, length in spans]
    stats.bytes_read += sum(map(len, pieces))
    return out + pieces


def _safetensors_spans(fd: int, size: int, out: list[bytes]) -> list[tuple[int, int]] | None:
    """Append the header to ``out`` and return (offset, length) of the start, middle and end
    piece of every tensor; None if the file does not parse as safetensors."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    (length,) = struct.unpack("<Q", head)
    if not 0 < length <= min(_MAX_HEADER, size - 8):
        return None
    header = os.pread(fd, length, 8)
    try:
        tensors = json.loads(header)
    except ValueError:
        return None
    out.append(header)
    spans: list[tuple[int, int]] = []
    base = 8 + length
    for name in sorted(k for k in tensors if k != "__metadata__"):
        begin, end = tensors[name].get("data_offsets", (0, 0))
        begin, end = base + int(begin), min(size, base + int(end))
        n = min(_SAMPLE, max(0, end - begin))
        middle = begin + max(0, (end - begin - n) // 2)
        spans += [(begin, n), (middle, n), (max(begin, end - n), n)]
    return spans
