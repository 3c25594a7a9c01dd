"""TierdTier's namespace and slot size from vLLM's OffloadingConfig (plain values here: the
module reads attributes only; tests/vllm/test_tier.py runs it on vLLM's real config)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from tierd.connector.vllm.tier.layout import daemon_hash, slot_bytes, tier_layout

PER_BLOCK = 2 * 32 * 8 * 128 * 16 * 2  # Llama-3-8B, fp16, block 16, one worker


def config(**changes: Any) -> SimpleNamespace:
    parallel = SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, world_size=1,
                               is_parallelism_agnostic=False)
    fields: dict[str, Any] = dict(
        groups=(SimpleNamespace(tokens_per_block=16,
                                layer_names=tuple(f"l{i}" for i in range(32))),),
        worker_kv_bytes_per_block=PER_BLOCK, replicated_layout=False, canonical_layout=False,
        kv_cache_layout=None, model=SimpleNamespace(name="m", dtype="float16"),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1), parallel=parallel)
    for key, value in changes.items():
        if key in ("tp_size", "world_size", "is_parallelism_agnostic"):
            setattr(parallel, key, value)
        else:
            fields[key] = value
    return SimpleNamespace(**fields)


def test_slot_is_the_row_without_padding() -> None:
    """A chunk's slot holds every worker's bytes; a row's page padding is not stored."""
    assert slot_bytes(config(), PER_BLOCK) == PER_BLOCK
    assert slot_bytes(config(world_size=2, tp_size=2), 2 * PER_BLOCK + 4096) == 2 * PER_BLOCK
    assert slot_bytes(config(replicated_layout=True, world_size=2), PER_BLOCK) == PER_BLOCK
    assert slot_bytes(config(worker_kv_bytes_per_block=0), 8192) == 8192


def test_layout_spells_the_chunk_and_separates_every_geometry() -> None:
    """The Layout's block bytes are the slot's; any field that changes a row's bytes changes
    the namespace's kv_format, the model id is kept, TP ranks share one slot."""
    base = tier_layout(config(), PER_BLOCK, "llama@0123456789abcdef")
    assert base.block_bytes == PER_BLOCK and base.num_layers == 32 and base.block_size == 16
    assert base.kv_format.startswith("vllm-tier-v1-") and base.model_id.startswith("llama@")
    others = [config(tp_size=2, world_size=2), config(model=SimpleNamespace(name="m",
                                                                             dtype="bfloat16")),
              config(cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=2)),
              config(kv_cache_layout="HND"), config(canonical_layout=True)]
    formats = {base.kv_format}
    for other in others:
        row = PER_BLOCK * other.parallel.world_size * other.cache.blocks_per_chunk
        formats.add(tier_layout(other, row, base.model_id).kv_format)
    assert len(formats) == 1 + len(others)
    assert tier_layout(config(), PER_BLOCK + 4096, base.model_id).kv_format != base.kv_format
    assert replace(base, kv_format="x").fingerprint() != base.fingerprint()


def test_replicated_rows_share_across_tp_sizes_and_sharded_rows_do_not() -> None:
    """A replicated (MLA) layout keeps one copy of the latent KV per row whatever the TP size:
    TP 2 and TP 4 share one namespace (TP size 1 in it). Sharded rows of TP 2 and TP 4 hold
    other bytes and stay apart, also where vLLM calls a direct layout parallelism-agnostic; a
    canonical layout it calls so shares, by its slot size."""
    def layout(tp: int, **changes: Any) -> Any:
        copies = 1 if changes.get("replicated_layout") else tp
        per_block = PER_BLOCK if copies == 1 else PER_BLOCK // tp
        return tier_layout(config(tp_size=tp, world_size=tp, worker_kv_bytes_per_block=per_block,
                                  **changes), per_block * copies, "m@1")

    two, four = layout(2, replicated_layout=True), layout(4, replicated_layout=True)
    assert two.fingerprint() == four.fingerprint() and two.tp_size == 1
    assert two.fingerprint() != layout(1).fingerprint()  # one copy, but not vLLM's replicated
    assert layout(2).fingerprint() != layout(4).fingerprint()
    direct = [layout(tp, is_parallelism_agnostic=True) for tp in (2, 4)]
    assert direct[0].fingerprint() != direct[1].fingerprint() and direct[0].tp_size == 2
    canonical = [layout(tp, is_parallelism_agnostic=True, canonical_layout=True) for tp in (2, 4)]
    assert canonical[0].fingerprint() == canonical[1].fingerprint()
    assert canonical[0].fingerprint() != layout(2, canonical_layout=True).fingerprint()


def test_no_kv_cache_group_is_a_clear_error() -> None:
    """A config without KV cache groups fails at start naming the fix, not an IndexError."""
    with pytest.raises(ValueError, match="no KV cache group.*remove the TierdTier entry"):
        tier_layout(config(groups=()), PER_BLOCK, "m@1")


def test_unsupported_dtype_is_refused() -> None:
    """A KV dtype tierd has no element size for fails at start, naming the supported ones."""
    with pytest.raises(ValueError, match="supported"):
        tier_layout(config(model=SimpleNamespace(name="m", dtype="int4")), PER_BLOCK, "m@1")


def test_keys_of_group_zero_keep_vllms_hash() -> None:
    """Group 0 of a sha256 hash is stored under that hash (what `tierd hash` prints); other
    groups and lengths under a digest of the whole key, all 32 bytes."""
    h = bytes(range(32))
    assert daemon_hash(h + b"\0\0\0\0") == h
    assert daemon_hash(h + b"\0\0\0\1") not in (h, daemon_hash(h + b"\0\0\0\0"))
    assert len(daemon_hash(b"x" * 8 + b"\0\0\0\0")) == 32
