"""What a ``TierdTier`` stores and under which namespace: vLLM's chunk rows as tierd slots.

vLLM's primary tier keeps one row per offloaded chunk in its shared region: every TP rank's KV
bytes for the chunk side by side (``worker_kv_bytes_per_block * copies * blocks_per_chunk``),
padded to a page (``primary_kv_view.strides[0]``). A slot holds the unpadded part of a row,
byte for byte, so a load is one copy back into a row and a store one copy out of it.

The namespace of those slots (``Layout``: model id, tenant by the daemon) must separate every
engine whose rows do not mean the same bytes. ``OffloadingConfig`` says what fixes them: the KV
cache groups (tokens per block, layer names), tokens per hash, blocks per chunk, the KV dtype,
TP/PP/PCP/DCP and world size, the replicated (MLA) and canonical layouts and vLLM's
``KVCacheLayout``, and the row sizes; all of it goes into ``kv_format`` as a digest, so two
engines share blocks exactly when all of it and the model id agree (DP replicas of one engine
do; no TP rank is in it, since a row holds every rank). These slots never share a namespace
with ``TierdConnector``'s (``vllm-hnc-v1``, one TP rank per slot): the two front ends do not
read each other's blocks.

Two layouts hold the same row bytes whatever the parallelism (``shared_across_parallelism``),
so the TP/PP/PCP/DCP and world sizes and the per-rank sizes leave the digest (the slot size
stays): a *replicated* layout (vLLM's ``replicated_layout``: a pure-MLA model under TP alone,
every rank holds the same latent KV and a row keeps one copy), and vLLM's *canonical* layout
where vLLM declares it parallelism-agnostic (``is_parallelism_agnostic``; vLLM certifies every
layer's mapping when its workers register and refuses to start otherwise). A direct
(non-canonical) layout keeps them even where vLLM calls it parallelism-agnostic: its row is
each rank's pages side by side in the engine's own KV layout, which this tier cannot check, and
a lost hit is better than another topology's bytes.

Keys: vLLM's ``OffloadKey`` is a block hash and a group index. Group 0 of a 32- or 16-byte
hash is stored under that hash (what vLLM hashed, as ``tierd hash`` prints it); any other key
under blake2b-256 of the whole key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tierd.types import HASH_LENGTHS, BlockHash
from tierd.wire.layout import DTYPE_BYTES, Dtype, Layout

FORMAT_PREFIX = "vllm-tier-v1-"
"""``Layout.kv_format`` of TierdTier slots: this prefix and 16 hex digits of the geometry."""

_DTYPES: dict[str, Dtype] = {
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32",
    "float": "float32", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
}


def shared_across_parallelism(offloading: Any) -> bool:
    """Whether a row's bytes are the same under every parallelism (module doc): a replicated
    layout, or vLLM's canonical layout declared parallelism-agnostic."""
    return bool(offloading.replicated_layout) or (
        bool(getattr(offloading, "canonical_layout", False))
        and bool(getattr(offloading.parallel, "is_parallelism_agnostic", False)))


def slot_bytes(offloading: Any, row_bytes: int) -> int:
    """Bytes of one chunk without the row's page padding (``row_bytes`` when vLLM gives no
    per-block size, e.g. host-side sparse caches)."""
    per_block = int(offloading.worker_kv_bytes_per_block)
    copies = 1 if offloading.replicated_layout else int(offloading.parallel.world_size)
    natural = per_block * copies * int(offloading.cache.blocks_per_chunk)
    if natural <= 0:
        return row_bytes
    assert natural <= row_bytes, f"a chunk of {natural} bytes cannot lie in a {row_bytes}-byte row"
    return natural


def tier_layout(offloading: Any, row_bytes: int, model_id: str) -> Layout:
    """The ``Layout`` a TierdTier registers: ``block_bytes`` is ``slot_bytes``, spelled as
    layers x one head x tokens of the KV dtype where it divides (else one layer of one token),
    ``kv_format`` the digest of the module doc, ``tp_size`` 1 where the row is the same under
    every parallelism. ``ValueError`` for a KV dtype tierd lacks or a config without KV cache
    groups."""
    if not offloading.groups:
        raise ValueError("TierdTier has nothing to store: vLLM's OffloadingConfig lists no KV "
                         "cache group (groups is empty); remove the TierdTier entry from "
                         "secondary_tiers for this model")
    dtype = _DTYPES.get(str(offloading.model.dtype))
    if dtype is None:
        raise ValueError(f"TierdTier cannot store KV of dtype {offloading.model.dtype!r}; "
                         f"supported: {sorted(_DTYPES)}")
    size, elem = slot_bytes(offloading, row_bytes), DTYPE_BYTES[dtype]
    layers = sum(len(group.layer_names) for group in offloading.groups) or 1
    tokens = int(offloading.groups[0].tokens_per_block) * int(offloading.cache.blocks_per_chunk)
    if size % (2 * layers * tokens * elem):
        layers = tokens = 1
    if size % (2 * layers * tokens * elem):
        raise ValueError(f"a chunk of {size} bytes is not a whole number of {dtype} K/V pairs")
    tp_size = 1 if shared_across_parallelism(offloading) else int(offloading.parallel.tp_size)
    return Layout(num_layers=layers, num_kv_heads=1,
                  head_size=size // (2 * layers * tokens * elem), dtype=dtype, block_size=tokens,
                  tp_rank=0, tp_size=tp_size,
                  kv_format=FORMAT_PREFIX + geometry_digest(offloading, row_bytes),
                  model_id=model_id)


def geometry_digest(offloading: Any, row_bytes: int) -> str:
    """16 hex digits of sha256 over every ``OffloadingConfig`` field that fixes a row's bytes
    (the module doc), canonical JSON. Where the row is the same under every parallelism, the
    parallel sizes and the per-rank and padded sizes are left out and the slot size stands for
    them."""
    parallel = offloading.parallel
    fields: dict[str, Any] = {
        "groups": [[int(g.tokens_per_block), list(g.layer_names)] for g in offloading.groups],
        "tokens_per_hash": int(offloading.cache.tokens_per_hash),
        "blocks_per_chunk": int(offloading.cache.blocks_per_chunk),
        "dtype": str(offloading.model.dtype),
        "replicated_layout": bool(offloading.replicated_layout),
        "canonical_layout": bool(getattr(offloading, "canonical_layout", False)),
        "kv_cache_layout": str(getattr(offloading, "kv_cache_layout", None)),
    }
    if shared_across_parallelism(offloading):
        fields["slot_bytes"] = slot_bytes(offloading, row_bytes)
    else:
        fields |= {
            "parallel": [int(parallel.tp_size), int(parallel.pp_size), int(parallel.pcp_size),
                         int(parallel.dcp_size), int(parallel.world_size)],
            "worker_kv_bytes_per_block": int(offloading.worker_kv_bytes_per_block),
            "row_bytes": int(row_bytes),
        }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def daemon_hash(key: bytes) -> BlockHash:
    """The tierd block hash of vLLM's ``OffloadKey`` ``key`` (hash + 4-byte group index)."""
    block_hash, group = key[:-4], key[-4:]
    if group == b"\0\0\0\0" and len(block_hash) in HASH_LENGTHS:
        return BlockHash(bytes(block_hash))
    return BlockHash(hashlib.blake2b(key, digest_size=32).digest())
