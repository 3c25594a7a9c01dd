"""KV cache geometry, the per-block unit a daemon slot holds, and argument checks."""

from __future__ import annotations

import pytest
import torch

from tierd.gpu import KVCacheSpec, allocate_kv_cache, kv_cache_from_pool


def test_llama3_8b_block_is_two_mib() -> None:
    """Llama-3-8B fp16 (32 layers, 8 KV heads, head 128, block 16): one block is 2 MiB."""
    spec = KVCacheSpec(32, 10, 8, 128, 16, torch.float16)
    assert spec.x == 8
    assert spec.k_shape == (10, 8, 16, 16, 8)
    assert spec.v_shape == (10, 8, 128, 16)
    assert spec.block_bytes == 2 * 1024 * 1024
    assert spec.layout_tag == "tierd-paged-v1/L32/H8/D128/B16/float16"


def test_fp8_halves_the_block_and_widens_x() -> None:
    """An fp8 cache stores 1-byte elements: x = 16 and the block is half the fp16 size."""
    spec = KVCacheSpec(32, 10, 8, 128, 16, torch.bfloat16, "fp8")
    assert spec.cache_dtype == torch.float8_e4m3fn
    assert spec.x == 16
    assert spec.block_bytes == 1024 * 1024
    assert KVCacheSpec(1, 1, 1, 64, 8, torch.float32, "fp8_e5m2").cache_dtype == torch.float8_e5m2


def test_layer_views_alias_pool_rows() -> None:
    """Layer 1's K element (block 3, head 1, d 9, token 5) lands at its documented pool byte."""
    cache = allocate_kv_cache(2, 4, 2, 64, 8, torch.float16)
    cache.check_integrity()
    spec = cache.spec
    cache.k_caches[1][3, 1, 9 // 8, 5, 9 % 8] = 1.5
    cache.v_caches[0][2, 0, 63, 7] = -2.0
    row3 = cache.pool[3].view(torch.float16)
    unit = spec.layer_block_elems  # elements per layer per K (or V)
    k_index = 2 * unit + (((1 * 8 + 1) * 8 + 5) * 8 + 1)  # layer 1 K, [H][D/x][B][x]
    assert row3[k_index].item() == 1.5
    assert int(row3.count_nonzero()) == 1
    row2 = cache.pool[2].view(torch.float16)
    assert row2[unit + (0 * 64 + 63) * 8 + 7].item() == -2.0  # layer 0 V, [H][D][B]
    cache.check_integrity()


def test_bad_geometry_names_the_fix() -> None:
    """Unsupported head size, block size, dtype or cache dtype raise ValueError."""
    with pytest.raises(ValueError, match="head_size 72"):
        KVCacheSpec(1, 1, 1, 72, 16, torch.float16)
    with pytest.raises(ValueError, match="block_size 64"):
        KVCacheSpec(1, 1, 1, 64, 64, torch.float16)
    with pytest.raises(ValueError, match="model dtype"):
        KVCacheSpec(1, 1, 1, 64, 16, torch.int8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCacheSpec(1, 1, 1, 64, 16, torch.float16, "int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheSpec(1, 0, 1, 64, 16, torch.float16)
    spec = KVCacheSpec(1, 2, 1, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="pool shape"):
        kv_cache_from_pool(spec, torch.zeros(3, spec.block_bytes, dtype=torch.uint8))
