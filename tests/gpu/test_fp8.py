"""FP8 KV caches: dtype names, and paged attention within the reported error bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierd.gpu import paged_attention, resolve_cache_dtype
from tierd.gpu.fp8 import attention_error_bound, relative_rounding_error, scale_for


def test_cache_dtype_names() -> None:
    """auto keeps the model dtype; fp8 is e4m3 (finite-only); fp8_e5m2 is e5m2."""
    assert resolve_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_cache_dtype("fp8", torch.float16) == torch.float8_e4m3fn
    assert resolve_cache_dtype("fp8_e4m3", torch.float16) == torch.float8_e4m3fn
    assert resolve_cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    assert relative_rounding_error(torch.float8_e4m3fn) == 1 / 16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_cache_dtype("fp4", torch.float16)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_fp8_decode_within_bound(build_paged, kv_cache_dtype, block_size) -> None:  # type: ignore[no-untyped-def]
    """Decode over an FP8 cache (scales from the data) stays within attention_error_bound."""
    lens = [30, 77]
    probe = build_paged(lens, block_size=block_size, seed=8)  # same seed -> same K/V
    cache_dtype = resolve_cache_dtype(kv_cache_dtype, torch.float32)
    k_scale = scale_for(torch.cat(probe.keys), cache_dtype)
    v_scale = scale_for(torch.cat(probe.values), cache_dtype)
    batch = build_paged(
        lens, block_size=block_size, seed=8, kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(9))
    out = paged_attention(
        q, batch.cache.k_caches[0], batch.cache.v_caches[0], batch.block_tables, batch.seq_lens,
        0.125, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    for i in range(2):
        k, v = batch.keys[i].transpose(0, 1), batch.values[i].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=0.125, enable_gqa=True)
        err = float((out[i] - ref[:, 0]).abs().max())
        groups = q[i].view(2, 2, 64)  # query heads of each KV head
        bound = max(
            attention_error_bound(groups[h], k[h], v[h], 0.125, cache_dtype,
                                  k_scale=k_scale, v_scale=v_scale)
            for h in range(2)
        )  # fmt: skip
        print(f"{kv_cache_dtype} B={block_size} seq {i}: max |err| {err:.4f} <= bound {bound:.4f}")
        assert 0.0 < err <= bound
