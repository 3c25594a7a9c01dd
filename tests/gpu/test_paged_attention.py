"""Paged attention equals dense SDPA on the same K/V: decode, prefill, chunked and mixed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierd.gpu import attention, paged_attention
from tierd.gpu.attention import compute_dtype, gather_k

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of q [Q, H, D] over contiguous k/v [L, Hk, D], causal with the queries last."""
    n_q, length = q.shape[0], k.shape[0]
    mask = torch.arange(length).view(1, -1) <= torch.arange(n_q).view(-1, 1) + (length - n_q)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("compute", ["query dtype", "fp32"])
def test_decode_matches_dense(  # type: ignore[no-untyped-def]
        build_paged, monkeypatch, dtype, block_size, head_size, compute) -> None:
    """Ragged lengths 1, 37, block-aligned and 100 over scattered blocks, GQA 8 query / 2 KV
    heads; both matmul orientations (the compute dtype is forced: which one a host picks
    depends on its CPU)."""
    forced = (lambda q: q.dtype) if compute == "query dtype" else (lambda q: torch.float32)
    monkeypatch.setattr(attention, "compute_dtype", forced)
    lens = [1, 37, 2 * block_size, 100]
    batch = build_paged(lens, head_size=head_size, block_size=block_size, dtype=dtype, seed=3)
    q = torch.randn(len(lens), 8, head_size, generator=torch.Generator().manual_seed(4)).to(dtype)
    scale = head_size**-0.5
    out = paged_attention(
        q, batch.cache.k_caches[0], batch.cache.v_caches[0], batch.block_tables, batch.seq_lens,
        scale
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i in range(len(lens)):
        ref = _dense(q[i : i + 1], batch.keys[i], batch.values[i], scale)[0]
        torch.testing.assert_close(out[i].float(), ref, **TOL[dtype])


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_chunked_and_mixed_match_dense(build_paged, block_size) -> None:  # type: ignore[no-untyped-def]
    """Full prefill (40 new), chunked prefill (30 cached + 20 new), decode (1 new) and an
    idle sequence (0 new) in one varlen batch, each causal over its cached prefix."""
    lens, q_lens = [40, 50, 23, 9], [40, 20, 1, 0]
    batch = build_paged(lens, block_size=block_size, seed=5)
    q = torch.randn(sum(q_lens), 4, 64, generator=torch.Generator().manual_seed(6))
    loc = torch.tensor([0, 40, 60, 61, 61], dtype=torch.int32)
    out = paged_attention(
        q, batch.cache.k_caches[0], batch.cache.v_caches[0], batch.block_tables, batch.seq_lens,
        0.125, query_start_loc=loc,
    )  # fmt: skip
    for i in range(3):
        rows = slice(int(loc[i]), int(loc[i + 1]))
        ref = _dense(q[rows], batch.keys[i], batch.values[i], 0.125)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


def test_decode_ignores_nan_in_padding_slots(build_paged) -> None:  # type: ignore[no-untyped-def]
    """Table entries past a sequence's end (-1 here) are never read into the result."""
    batch = build_paged([5, 20], block_size=16)
    q = torch.randn(2, 2, 64)
    out = paged_attention(
        q, batch.cache.k_caches[0], batch.cache.v_caches[0], batch.block_tables, batch.seq_lens, 0.1
    )
    assert int(batch.block_tables[0, 1]) == -1
    ref = _dense(q[:1], batch.keys[0], batch.values[0], 0.1)[0]
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def test_gather_moves_16_byte_units_bit_exactly() -> None:
    """Gathering K through complex128 units keeps arbitrary bit patterns (NaNs, subnormals)."""
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (6, 2, 8, 16, 16), dtype=torch.uint8, generator=gen)
    k_cache = raw.view(torch.bfloat16)  # [6, 2, 8, 16, 8]: head 64, block 16, x 8
    table = torch.tensor([[4, 0], [5, 5]])
    got = gather_k(k_cache, table, torch.bfloat16, 1.0).view(torch.int16)
    ref = k_cache.view(torch.int16)[table].permute(0, 2, 1, 4, 3, 5).reshape(2, 2, 32, 64)
    assert torch.equal(got, ref)


def test_bad_arguments_raise_before_any_work(build_paged) -> None:  # type: ignore[no-untyped-def]
    """Mismatched heads/head size/dtype, a short table and an outside block id raise ValueError."""
    batch = build_paged([5, 20], block_size=16)
    k, v, table, lens = (
        batch.cache.k_caches[0], batch.cache.v_caches[0], batch.block_tables, batch.seq_lens
    )  # fmt: skip
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(torch.randn(2, 3, 64), k, v, table, lens, 0.1)
    with pytest.raises(ValueError, match="head_size"):
        paged_attention(torch.randn(2, 4, 128), k, v, table, lens, 0.1)
    with pytest.raises(ValueError, match="cache dtype"):
        paged_attention(q.half(), k, v, table, lens, 0.1)
    with pytest.raises(ValueError, match="model dtype"):
        paged_attention(q.double(), k, v, table, lens, 0.1)
    with pytest.raises(ValueError, match="more blocks"):
        paged_attention(q, k, v, table[:, :1], lens, 0.1)
    bad = table.clone()
    bad[1, 1] = batch.cache.spec.num_blocks
    with pytest.raises(ValueError, match="outside the pool"):
        paged_attention(q, k, v, bad, lens, 0.1)
    with pytest.raises(ValueError, match="one query token per sequence"):
        paged_attention(torch.randn(3, 4, 64), k, v, table, lens, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, k, v, table, lens, 0.1, query_start_loc=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="seq_len >= max"):
        paged_attention(q, k, v, table, torch.tensor([0, 20]), 0.1)
    with pytest.raises(ValueError, match="backend='cupy'"):
        paged_attention(q, k, v, table, lens, 0.1, backend="cupy")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunked_prefill_half_precision_matches_dense(build_paged, dtype) -> None:  # type: ignore[no-untyped-def]
    """Chunked prefill (70 cached + 30 new) and full prefill (33) in fp16/bf16, GQA 8/2 heads:
    the cached-prefix and causal-new parts, merged by log-sum-exp, match dense SDPA."""
    lens, q_lens = [100, 33], [30, 33]
    batch = build_paged(lens, head_size=128, block_size=16, dtype=dtype, seed=8)
    q = torch.randn(sum(q_lens), 8, 128, generator=torch.Generator().manual_seed(9)).to(dtype)
    loc = torch.tensor([0, 30, 63], dtype=torch.int32)
    out = paged_attention(
        q, batch.cache.k_caches[0], batch.cache.v_caches[0], batch.block_tables, batch.seq_lens,
        128**-0.5, query_start_loc=loc,
    )  # fmt: skip
    for i in range(2):
        rows = slice(int(loc[i]), int(loc[i + 1]))
        ref = _dense(q[rows], batch.keys[i], batch.values[i], 128**-0.5)
        torch.testing.assert_close(out[rows].float(), ref, **TOL[dtype])


def test_compute_dtype_keeps_fp32_and_upcasts_half_only_on_cpu() -> None:
    """fp32 queries compute in fp32; half-precision ones in their own dtype or in fp32."""
    assert compute_dtype(torch.zeros(1, 1, 64)) == torch.float32
    for dtype in (torch.float16, torch.bfloat16):
        assert compute_dtype(torch.zeros(1, 1, 64, dtype=dtype)) in (dtype, torch.float32)
