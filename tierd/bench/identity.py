"""`tierd bench identity`: the start-up cost of a model id against reading the weights.

Builds a checkpoint with the tensor list and byte size of a real model, as Hugging Face shards
it (safetensors shards of at most 5 GB): sparse files whose header is real and whose bytes are
real where the fingerprint samples them (start, middle and end of every tensor), so a 141 GB
checkpoint takes a few MB of disk. The page cache is dropped for every file
(``posix_fadvise(DONTNEED)`` after ``fsync``) and the model id derived cold, then warm.

The limit is measured in the same run: the time an engine needs to read those weights anyway,
checkpoint bytes / the cold sequential read bandwidth of a real 512 MiB file in the same
directory. The fingerprint must cost at most ``--limit`` (1%) of it.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time
from pathlib import Path

HELP = "Start-up cost of the weights fingerprint (model id), cold and warm, vs reading the weights."

SHAPES = {
    # name: (layers, hidden, kv dim, intermediate, vocab)
    "llama3-8b": (32, 4096, 1024, 14336, 128256),
    "llama3-70b": (80, 8192, 1024, 28672, 128256),
}
_SHARD = 5 * 10**9
_PIECE = 4096


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama3-70b", choices=sorted(SHAPES),
                        help="tensor list and size to fingerprint (default llama3-70b, 141 GB)")
    parser.add_argument("--dir", default=None, help="where to build it (default: a temp dir)")
    parser.add_argument("--limit", type=float, default=0.01,
                        help="max fingerprint time / weight read time (default 0.01)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def tensors_of(model: str) -> list[tuple[str, int]]:
    """(name, bf16 bytes) of every tensor, in the order HF saves them."""
    layers, hidden, kv, inter, vocab = SHAPES[model]
    out = [("model.embed_tokens.weight", vocab * hidden * 2)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", hidden * hidden * 2),
                (p + "self_attn.k_proj.weight", kv * hidden * 2),
                (p + "self_attn.v_proj.weight", kv * hidden * 2),
                (p + "self_attn.o_proj.weight", hidden * hidden * 2),
                (p + "mlp.gate_proj.weight", inter * hidden * 2),
                (p + "mlp.up_proj.weight", inter * hidden * 2),
                (p + "mlp.down_proj.weight", inter * hidden * 2),
                (p + "input_layernorm.weight", hidden * 2),
                (p + "post_attention_layernorm.weight", hidden * 2)]
    return out + [("model.norm.weight", hidden * 2), ("lm_head.weight", vocab * hidden * 2)]


def build(root: Path, model: str) -> tuple[list[Path], int]:
    """Write the sharded sparse checkpoint under ``root``; (its files, its bytes)."""
    shards: list[list[tuple[str, int]]] = [[]]
    size = 0
    for name, nbytes in tensors_of(model):
        if size + nbytes > _SHARD and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, nbytes))
        size += nbytes
    (root / "config.json").write_text(json.dumps({"model_type": "llama",
                                                  "torch_dtype": "bfloat16"}))
    files, total, rng = [], 0, os.urandom
    for i, shard in enumerate(shards):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, nbytes in shard:
            header[name] = {"dtype": "BF16", "shape": [nbytes // 2],
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header).encode()
        path = root / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        base = 8 + len(raw)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, nbytes in shard:
                begin = base + header[name]["data_offsets"][0]  # type: ignore[index]
                for at in (begin, begin + (nbytes - _PIECE) // 2, begin + nbytes - _PIECE):
                    os.pwrite(f.fileno(), rng(min(_PIECE, nbytes)), max(begin, at))
            f.truncate(base + offset)
            f.flush()
            os.fsync(f.fileno())
        files.append(path)
        total += offset
    return files, total


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bandwidth(root: Path, nbytes: int = 512 << 20) -> float:
    """Cold sequential read bandwidth (bytes/s) of a real ``nbytes`` file under ``root``."""
    path = root / "bandwidth.bin"
    chunk = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_cache([path])
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds


def run(args: argparse.Namespace) -> int:
    from tierd.model_identity import identity_from_checkpoint, kv_settings

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tierd-bench-id-") as tmp:
        root = Path(tmp)
        files, total = build(root, args.model)
        bandwidth = read_bandwidth(root)
        drop_cache(files)
        settings = kv_settings("bfloat16", None)
        cold = identity_from_checkpoint(root, settings)
        warm = identity_from_checkpoint(root, settings)
        assert cold.model_id == warm.model_id, "the fingerprint must not depend on the cache"
    load_s = total / bandwidth
    figures = {"model": args.model, "checkpoint_bytes": total, "files": len(files),
               "tensors": len(tensors_of(args.model)), "cold_ms": cold.seconds * 1e3,
               "warm_ms": warm.seconds * 1e3, "read_bandwidth_gbps": bandwidth / 1e9,
               "weights_read_s": load_s, "ratio": cold.seconds / load_s, "limit": args.limit,
               "source": cold.source}
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"{args.model}: {total / 1e9:.1f} GB in {len(files)} files, "
              f"{figures['tensors']} tensors; {cold.source}")
        print(f"model id cold {figures['cold_ms']:.1f} ms, warm {figures['warm_ms']:.1f} ms; "
              f"reading the weights at {bandwidth / 1e9:.2f} GB/s (cold, measured now) takes "
              f"{load_s:.1f} s")
        verdict = "ok" if figures["ratio"] <= args.limit else "OVER"
        print(f"cold fingerprint / weight read {figures['ratio']:.5f} (limit {args.limit}) "
              f"{verdict}")
    return 0 if figures["ratio"] <= args.limit else 1
