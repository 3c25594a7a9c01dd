"""The CuPy decode kernel matches the Torch path on a real GPU (marked gpu: skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from tierd.gpu import allocate_kv_cache, cupy_attention, paged_attention, reshape_and_cache


def test_cupy_is_off_without_cuda() -> None:
    """Without CUDA (or CuPy) the kernel is not available and auto stays on Torch."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the gpu tests")
    assert cupy_attention.available() is False
    assert cupy_attention.kernel_name(torch.bfloat16, torch.float8_e4m3fn, 128, 16) == (
        "paged_attention_decode<2, 3, 128, 16, 128>"
    )
    assert cupy_attention.shared_mem_bytes(2048, 128, 16) == 8192


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
def test_kernel_matches_torch(dtype, kv_cache_dtype, block_size, head_size) -> None:  # type: ignore[no-untyped-def]
    """Ragged lengths over scattered blocks of a 2-layer pool, GQA 8/2, layer 1."""
    if not cupy_attention.available():
        pytest.skip("CuPy is not installed (pip install 'tierd[gpu]')")
    gen = torch.Generator().manual_seed(0)
    lens = [1, 45, 300, 1000]
    need = [-(-n // block_size) for n in lens]
    cache = allocate_kv_cache(2, sum(need) + 5, 2, head_size, block_size, dtype, "cuda",
                              kv_cache_dtype)
    perm = torch.randperm(sum(need) + 5, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        blocks = perm[used : used + need[i]]
        used += need[i]
        table[i, : need[i]] = blocks.to(torch.int32)
        pos = torch.arange(n)
        slots = (blocks[pos // block_size] * block_size + pos % block_size).cuda()
        kv = torch.randn(2, n, 2, head_size, generator=gen).to(dtype).cuda()
        reshape_and_cache(kv[0], kv[1], cache.k_caches[1], cache.v_caches[1], slots,
                          k_scale=0.02, v_scale=0.02)
    q = torch.randn(len(lens), 8, head_size, generator=gen).to(dtype).cuda()
    args = (q, cache.k_caches[1], cache.v_caches[1], table.cuda(), torch.tensor(lens).cuda(),
            head_size**-0.5)
    scales = dict(k_scale=0.02, v_scale=0.02) if kv_cache_dtype != "auto" else {}
    ref = paged_attention(*args, backend="torch", **scales)
    out = paged_attention(*args, backend="cupy", **scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
