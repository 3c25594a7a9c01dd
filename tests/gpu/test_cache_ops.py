"""reshape_and_cache slots, copy-on-write and tier gather/scatter: exact placement, bit-exact."""

from __future__ import annotations

import pytest
import torch

from tierd.gpu import (
    allocate_kv_cache,
    copy_blocks,
    gather_blocks,
    reshape_and_cache,
    scatter_blocks,
)
from tierd.gpu.layout import KVCache


def _random_bytes(cache: KVCache, seed: int = 0) -> None:
    """Fill the pool with random bytes (NaN and subnormal patterns included)."""
    gen = torch.Generator().manual_seed(seed)
    cache.pool.copy_(torch.randint(0, 256, cache.pool.shape, dtype=torch.uint8, generator=gen))


def test_tokens_land_in_their_slots_and_padding_is_skipped() -> None:
    """Slots 3 and 17 (block 1, offset 1) receive tokens 0 and 2; the -1 token writes nothing."""
    cache = allocate_kv_cache(1, 4, 2, 64, 16, torch.float32)
    k, v = cache.k_caches[0], cache.v_caches[0]
    key = torch.arange(3 * 2 * 64, dtype=torch.float32).view(3, 2, 64) + 1
    value = -key
    reshape_and_cache(key, value, k, v, torch.tensor([3, -1, 17]))
    x = cache.spec.x
    assert torch.equal(k[0, :, :, 3, :].reshape(2, 64), key[0])
    assert torch.equal(k[1, :, :, 1, :].reshape(2, 64), key[2])
    assert torch.equal(v[0, :, :, 3], value[0])
    assert torch.equal(v[1, :, :, 1], value[2])
    assert int(cache.pool.view(torch.float32).count_nonzero()) == 4 * 2 * 64  # 2 tokens, K and V
    assert k[0, 1, 63 // x, 3, 63 % x].item() == key[0, 1, 63].item()
    cache.check_integrity()


def test_fp8_store_saturates_and_scales() -> None:
    """FP8 stores saturate(x / scale): 1000 clamps to 448 (e4m3 max), 2.0 / 0.5 stores 4.0."""
    cache = allocate_kv_cache(1, 2, 1, 64, 8, torch.float32, kv_cache_dtype="fp8")
    key = torch.zeros(1, 1, 64)
    key[0, 0, 0], key[0, 0, 1] = 1000.0, 2.0
    reshape_and_cache(key, key, cache.k_caches[0], cache.v_caches[0], torch.tensor([9]),
                      k_scale=0.5)
    stored = cache.k_caches[0][1, 0, 0, 1, :].float()
    assert stored[0].item() == 448.0
    assert stored[1].item() == 4.0
    assert cache.v_caches[0][1, 0, 1, 1].float().item() == 2.0


def test_bad_slots_and_shapes_raise() -> None:
    """Slots beyond the pool, below -1, and mismatched shapes raise ValueError."""
    cache = allocate_kv_cache(1, 2, 2, 64, 16, torch.float32)
    k, v = cache.k_caches[0], cache.v_caches[0]
    kv = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(kv, kv, k, v, torch.tensor([32]))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(kv, kv, k, v, torch.tensor([-2]))
    with pytest.raises(ValueError, match="num_tokens"):
        reshape_and_cache(torch.zeros(1, 1, 64), kv, k, v, torch.tensor([0]))
    with pytest.raises(ValueError, match="slot_mapping must be int"):
        reshape_and_cache(kv, kv, k, v, torch.tensor([0.0]))
    assert int(cache.pool.count_nonzero()) == 0


def test_copy_blocks_is_bit_exact_and_reads_before_writing() -> None:
    """Pairs (2->5) and (5->2) swap rows exactly across all layers; other rows are untouched."""
    cache = allocate_kv_cache(3, 8, 2, 64, 8, torch.bfloat16)
    _random_bytes(cache)
    before = cache.pool.clone()
    copy_blocks(cache, [(2, 5), (5, 2), (0, 7)])
    assert torch.equal(cache.pool[5], before[2])
    assert torch.equal(cache.pool[2], before[5])
    assert torch.equal(cache.pool[7], before[0])
    for b in (0, 1, 3, 4, 6):
        assert torch.equal(cache.pool[b], before[b])
    cache.check_integrity()


def test_copy_blocks_rejects_duplicate_or_outside_ids() -> None:
    """Two copies into one block, or an id outside the pool, raise ValueError."""
    cache = allocate_kv_cache(1, 4, 1, 64, 8, torch.float16)
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks(cache, [(0, 3), (1, 3)])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        copy_blocks(cache, torch.tensor([[4, 0]]))


def test_gather_scatter_round_trip_is_bit_exact() -> None:
    """Blocks 6, 1, 4 gathered to flat rows and scattered into 0, 2, 3 of a second pool match."""
    src = allocate_kv_cache(2, 8, 2, 64, 16, torch.float16, kv_cache_dtype="fp8_e5m2")
    _random_bytes(src, seed=1)
    ids = torch.tensor([6, 1, 4])
    flat = torch.empty(3, src.spec.block_bytes, dtype=torch.uint8)
    gather_blocks(src, ids, flat)
    assert torch.equal(flat, src.pool[ids])
    dst = allocate_kv_cache(2, 5, 2, 64, 16, torch.float16, kv_cache_dtype="fp8_e5m2")
    scatter_blocks(dst, torch.tensor([0, 2, 3], dtype=torch.int32), flat)
    assert torch.equal(dst.pool[torch.tensor([0, 2, 3])], src.pool[ids])
    assert int(dst.pool[torch.tensor([1, 4])].count_nonzero()) == 0
    assert torch.equal(dst.k_caches[1][2].view(torch.uint8), src.k_caches[1][1].view(torch.uint8))
    dst.check_integrity()


def test_gather_into_typed_view_of_slots() -> None:
    """A bf16-typed [n, block_bytes / 2] staging buffer receives the same bytes as uint8 rows."""
    cache = allocate_kv_cache(2, 4, 1, 64, 8, torch.bfloat16)
    _random_bytes(cache, seed=2)
    typed = torch.empty(2, cache.spec.block_bytes // 2, dtype=torch.bfloat16)
    gather_blocks(cache, torch.tensor([3, 0]), typed)
    assert torch.equal(typed.view(torch.uint8), cache.pool[torch.tensor([3, 0])])
    scatter_blocks(cache, torch.tensor([1, 2]), typed)
    assert torch.equal(cache.pool[1], cache.pool[3])
    assert torch.equal(cache.pool[2], cache.pool[0])


def test_gather_scatter_bad_arguments() -> None:
    """Wrong row size, wrong row count, out-of-pool ids and duplicate scatter ids raise."""
    cache = allocate_kv_cache(1, 4, 1, 64, 8, torch.float16)
    rows = torch.empty(2, cache.spec.block_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes"):
        gather_blocks(cache, torch.tensor([0, 1]), rows[:, :-2])
    with pytest.raises(ValueError, match="rows"):
        gather_blocks(cache, torch.tensor([0]), rows)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        gather_blocks(cache, torch.tensor([0, 9]), rows)
    with pytest.raises(ValueError, match="distinct"):
        scatter_blocks(cache, torch.tensor([1, 1]), rows)
