"""`tierd bench hash`: per-block cost of tierd.hashing against cbor2 + hashlib, same process.

The limit is vLLM's own path, ``hashlib.sha256(cbor2.dumps(obj, canonical=True))``, timed on
the same tokens in the same run; tierd's ``sha256_cbor`` must give bit-identical hashes at most
``--limit`` times its cost (1.3 by default). tierd encodes each block with cbor2 as vLLM does and
adds its check of the token ids (uint32), which vLLM skips.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections.abc import Callable

HELP = "Per-block hashing cost of tierd.hashing vs cbor2 + hashlib, with the ratio."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=2048, help="blocks per prompt (2048)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--vocab", type=int, default=128256, help="token ids drawn below this")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best is kept (5)")
    parser.add_argument("--limit", type=float, default=1.3,
                        help="max tierd/cbor2 cost ratio for sha256_cbor (1.3)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _best(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Best wall time of ``repeat`` calls (noise only ever adds time), and the last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run(args: argparse.Namespace) -> int:
    import cbor2
    import xxhash

    from tierd import hashing

    size, blocks = args.block_size, args.blocks
    limit = args.limit
    rng = random.Random(0)
    tokens = [rng.randrange(args.vocab) for _ in range(size * blocks)]
    chunks = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    lora, lora_path, salt = "adapter-a", "/adapters/a", "tenant-42"
    lora_key, salt_key = ("lora", lora, lora_path), ("cache_salt", salt)  # vLLM 0.33's keys

    def cbor_chain(digest: Callable[[bytes], bytes], root: bytes, extras: bool) -> list[bytes]:
        """vLLM's request hasher: slice each full block, tuple() it, hash the 3-tuple."""
        out, parent = [], root
        for i in range(blocks):
            extra = ((lora_key, salt_key) if i == 0 else (lora_key,)) if extras else None
            block = tuple(tokens[i * size : (i + 1) * size])
            parent = digest(cbor2.dumps((parent, block, extra), canonical=True))
            out.append(parent)
        return out

    def sha(data: bytes) -> bytes:
        return hashlib.sha256(data).digest()

    def decode_feed() -> list[bytes]:
        hasher = hashing.BlockHasher(size)
        out: list[bytes] = []
        for chunk in chunks:  # one block's worth per call, as a decode step would complete it
            out += hasher.append(chunk)
        return out

    sha_root = hashing.none_hash()
    xxh_root = hashing.none_hash(algo="xxhash_cbor")
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "cbor2+sha256 (vLLM)": (lambda: cbor_chain(sha, sha_root, False), ""),
        "tierd sha256_cbor": (lambda: hashing.block_hashes(tokens, size), "cbor2+sha256 (vLLM)"),
        "tierd sha256_cbor, one append per block": (decode_feed, "cbor2+sha256 (vLLM)"),
        "cbor2+sha256, lora+salt": (lambda: cbor_chain(sha, sha_root, True), ""),
        "tierd sha256_cbor, lora+salt": (
            lambda: hashing.block_hashes(
                tokens, size, lora_name=lora, lora_path=lora_path, cache_salt=salt
            ),
            "cbor2+sha256, lora+salt",
        ),
        "cbor2+xxh3_128 (vLLM)": (
            lambda: cbor_chain(xxhash.xxh3_128_digest, xxh_root, False),
            "",
        ),
        "tierd xxhash_cbor": (
            lambda: hashing.block_hashes(tokens, size, algo="xxhash_cbor"),
            "cbor2+xxh3_128 (vLLM)",
        ),
    }
    per_block: dict[str, float] = {}
    results: dict[str, object] = {}
    for name, (fn, _) in cases.items():
        seconds, results[name] = _best(fn, args.repeat)
        per_block[name] = seconds / blocks * 1e6
    mismatched = [n for n, (_, ref) in cases.items() if ref and results[n] != results[ref]]
    base = per_block["cbor2+sha256 (vLLM)"]
    ratio = per_block["tierd sha256_cbor"] / base
    ok = ratio <= limit and not mismatched
    if args.json:
        figures = {
            "block_size": size,
            "blocks": blocks,
            "us_per_block": per_block,
            "ratio_vs_cbor2_sha256": ratio,
            "limit": limit,
            "bit_identical": not mismatched,
            "ok": ok,
        }
        print(json.dumps(figures, indent=2))
    else:
        print(f"{blocks} blocks of {size} tokens (ids < {args.vocab}), best of {args.repeat}")
        for name, (_, ref) in cases.items():
            against = f"  {per_block[name] / per_block[ref]:.2f}x {ref}" if ref else ""
            print(f"  {name:<38} {per_block[name]:7.3f} us/block{against}")
        print(
            f"tierd sha256_cbor / cbor2+sha256 = {ratio:.2f} (limit {limit:.2f}), "
            f"bit-identical: {'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)}"
        )
        print("PASS" if ok else "FAIL")
    return 0 if ok else 1
