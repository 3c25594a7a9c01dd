"""Paged attention in Torch (CPU and CUDA): decode, prefill and chunked prefill, with GQA.

Varlen convention (vLLM's): ``query`` is ``[num_tokens, num_heads, head_size]``, the new tokens of
all sequences back to back. ``query_start_loc`` (``[num_seqs + 1]``, cumulative, starting at 0)
says where each sequence's tokens start; ``None`` means decode, one token per sequence.
``seq_lens[i]`` is sequence ``i``'s total length *including* its new tokens, whose K/V must
already be in the cache (``reshape_and_cache`` first); the new tokens are its last
``query_len`` positions. Query token ``j`` of sequence ``i`` sits at position
``seq_lens[i] - query_len + j`` and attends to every key at or before it (causal over cached
prefix + new tokens). ``block_tables[i, k]`` is the pool block holding tokens
``[k * block_size, (k + 1) * block_size)``; entries past a sequence's length are ignored.

How it is computed (Torch path): only whole 16-byte ``x`` vectors and whole rows are moved,
and nothing is upcast in bulk (fp32 only for the softmax).
- decode: chunks of sequences sorted by length (each chunk's gathered K/V, ~16 MiB, stays
  cache-warm). K is gathered as (block, head) slabs already token-major (the transposition
  rides inside the one index op) for one batched matmul with ``q``; V is gathered as rows
  and never transposed: P.V is a matmul per (block, head) over its tokens, summed over
  blocks. Length mask, fp32 softmax (max-subtracted, so it never overflows). Half-precision
  queries on a CPU without native half-precision matmuls (AVX2 hosts) compute in fp32: each
  gathered chunk is upcast in a reused buffer (``compute_dtype``).
- prefill: per sequence, gathered K/V. On CPU, flash attention over the cached prefix (no
  mask) and over the new tokens (``is_causal``, skipping the masked half), merged by their
  log-sum-exps; elsewhere one SDPA with a causal-offset mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .fp8 import dequantize, is_fp8
from .layout import cache_geometry, check_geometry

Backend = Literal["auto", "torch", "cupy"]

# Gathered K+V bytes per decode chunk: small enough to stay in a CPU's caches between the
# gather and the matmuls, large enough that per-chunk Python overhead is noise.
DECODE_CHUNK_BYTES = 16 << 20

_UNITS: dict[int, torch.dtype] = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """Validated host-side shape of one call: lengths per sequence and the decode/prefill split."""

    seq_lens: list[int]
    query_starts: list[int]
    query_lens: list[int]
    block_size: int
    is_decode: bool  # every sequence has exactly one query token


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    query_start_loc: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Attention of ``query`` over one layer's paged K/V; returns ``[num_tokens, heads, head]``.

    See the module docstring for the varlen convention. ``k_scale`` / ``v_scale`` dequantize FP8
    caches. ``backend="auto"`` runs the CuPy kernel for decode on CUDA when CuPy is installed,
    else Torch. Raises ValueError on bad arguments before launching anything; reads the length
    tensors on the host (a device sync on CUDA). Does not modify the cache.
    """
    batch = validate_attention_args(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out
    )
    result = torch.empty_like(query) if out is None else out
    if backend != "torch" and batch.is_decode and query.is_cuda:
        from . import cupy_attention

        if cupy_attention.available():
            cupy_attention.paged_attention_decode(
                query, k_cache, v_cache, block_tables, seq_lens, scale,
                k_scale=k_scale, v_scale=v_scale, out=result,
            )  # fmt: skip
            return result
    if backend == "cupy":
        raise ValueError("backend='cupy' needs decode on a CUDA tensor with CuPy installed")
    tables = _used_block_table(block_tables.to(k_cache.device), batch)
    decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
    prefill = [i for i, n in enumerate(batch.query_lens) if n > 1]
    args = (k_cache, v_cache, tables, batch, scale, k_scale, v_scale)
    if batch.is_decode:
        _decode(query, result, list(range(len(batch.seq_lens))), *args)
        return result
    if decode:
        rows = torch.tensor([batch.query_starts[i] for i in decode], device=query.device)
        part = torch.empty(len(decode), *query.shape[1:], dtype=query.dtype, device=query.device)
        _decode(query.index_select(0, rows), part, decode, *args)
        result.index_copy_(0, rows, part)
    if prefill:
        _prefill(query, result, prefill, *args)
    return result


def validate_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    out: torch.Tensor | None,
) -> AttentionBatch:
    """Check every argument of :func:`paged_attention`; raise ValueError naming the fix."""
    num_blocks, num_kv_heads, head_size, block_size = cache_geometry(k_cache, v_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
    check_geometry(query.shape[2], block_size, query.dtype)
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} != cache head_size {head_size}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"num_heads {query.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if k_cache.dtype != query.dtype and not is_fp8(k_cache.dtype):
        raise ValueError(f"cache dtype {k_cache.dtype} must be {query.dtype} or an FP8 dtype")
    if query.device != k_cache.device or k_cache.device != v_cache.device:
        raise ValueError("query, k_cache and v_cache must be on the same device")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError("out must have the query's shape and dtype")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables must be a 2-D int32/int64 tensor [num_seqs, max_blocks]")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError("seq_lens must be 1-D with one entry per block_tables row")
    lens = [int(n) for n in seq_lens.tolist()]
    if query_start_loc is None:
        starts, qlens = list(range(len(lens))), [1] * len(lens)
        if query.shape[0] != len(lens):
            raise ValueError("decode (no query_start_loc) needs one query token per sequence")
    else:
        loc = [int(n) for n in query_start_loc.tolist()]
        if len(loc) != len(lens) + 1 or loc[0] != 0 or loc[-1] != query.shape[0]:
            raise ValueError("query_start_loc must be [num_seqs + 1], from 0 to num_tokens")
        starts, qlens = loc[:-1], [b - a for a, b in zip(loc, loc[1:])]
    for i, (n, q) in enumerate(zip(lens, qlens)):
        if q < 0 or n < max(q, 1):
            raise ValueError(f"sequence {i}: need seq_len >= max(query_len, 1), got {n}, {q}")
        if -(-n // block_size) > block_tables.shape[1]:
            raise ValueError(f"sequence {i}: seq_len {n} needs more blocks than block_tables has")
    used = torch.arange(block_tables.shape[1]) < torch.tensor(lens).view(-1, 1).add(
        block_size - 1
    ).div(block_size, rounding_mode="floor")
    table = block_tables.cpu()
    if bool(((table < 0) | (table >= num_blocks))[used].any()):
        raise ValueError(f"block_tables points outside the pool [0, {num_blocks})")
    return AttentionBatch(lens, starts, qlens, block_size, all(q == 1 for q in qlens))


def _used_block_table(block_tables: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """The int64 table cut to the longest sequence, unused entries pointed at block 0."""
    width = -(-max(batch.seq_lens, default=1) // batch.block_size)
    table = block_tables[:, :width].to(torch.int64)
    lens = torch.tensor(batch.seq_lens, device=table.device).view(-1, 1)
    used = torch.arange(width, device=table.device) * batch.block_size < lens
    return torch.where(used, table, 0)


def _units(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dimension reinterpreted as the widest whole units (<= 16 bytes)."""
    row = t.shape[-1] * t.element_size()
    return t.view(_UNITS[math.gcd(row, 16)])


def gather_k(
    k_cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, k_scale: float
) -> torch.Tensor:
    """K of the blocks in ``table`` [n, blocks] as contiguous ``[n, heads, blocks * B, D]``.

    Moves whole 16-byte x-vectors: one row gather, then one transposing copy of units.
    """
    n, nb = table.shape
    _, h, d_over_x, b, x = k_cache.shape
    units = _units(k_cache).squeeze(-1)  # [N, H, D/x, B] of 16-byte units
    rows = units.index_select(0, table.reshape(-1)).view(n, nb, h, d_over_x, b)
    out = units.new_empty(n, h, nb, b, d_over_x).copy_(rows.permute(0, 2, 1, 4, 3))
    k = out.view(k_cache.dtype).view(n, h, nb * b, d_over_x * x)
    return dequantize(k, k_scale, dtype) if k.dtype != dtype else k


def gather_v(
    v_cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, v_scale: float
) -> torch.Tensor:
    """V of the blocks in ``table`` as contiguous ``[n, heads, D, blocks * B]`` (token-minor)."""
    n, nb = table.shape
    _, h, d, b = v_cache.shape
    units = _units(v_cache)  # [N, H, D, U]
    rows = units.index_select(0, table.reshape(-1)).view(n, nb, h, d, -1)
    out = units.new_empty(n, h, d, nb, units.shape[-1]).copy_(rows.permute(0, 2, 3, 1, 4))
    v = out.view(v_cache.dtype).view(n, h, d, nb * b)
    return dequantize(v, v_scale, dtype) if v.dtype != dtype else v


def _decode(
    query: torch.Tensor,
    out: torch.Tensor,
    seqs: list[int],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> None:
    """One query token per sequence in ``seqs``; ``query``/``out`` rows follow ``seqs``.

    Per chunk of sequences (sorted by length, so a chunk's width fits its longest member):
    - K: one gather of whole (block, head) slabs through a ``[B, D/x]`` view of x-vectors, so
      the transposition to token-major rows rides inside the gather; then one batched matmul
      per (sequence, head): in half precision ``K [L, D] @ q^T [D, G]`` (faster than
      ``q @ K^T`` on a bf16-capable CPU), in fp32 ``q [G, D] @ K^T [D, L]`` (faster than the
      other there). The scale is folded into ``q``; an fp32 softmax over ``L``.
    - V: one row gather, no transposition: P.V is a batched matmul per (block, head), with
      V's tokens (already its innermost axis) as the reduction (``[D, B] @ [B, G]`` or
      ``[G, B] @ [B, D]``), summed over blocks.
    With an fp32 compute dtype (``compute_dtype``) each gathered K and V is upcast into one
    reused buffer before its matmul; FP8 caches are dequantized the same way.
    Every per-chunk intermediate lives in a buffer allocated once per call: a fresh MiB-sized
    tensor per chunk costs page faults comparable to the matmul it feeds.
    """
    num_kv_heads, head_size = k_cache.shape[1], query.shape[2]
    group = query.shape[1] // num_kv_heads
    b, dev = batch.block_size, query.device
    order = sorted(range(len(seqs)), key=lambda j: batch.seq_lens[seqs[j]], reverse=True)
    lengths = [batch.seq_lens[seqs[j]] for j in order]
    table = tables[torch.tensor([seqs[j] for j in order], device=tables.device)]
    rows = None if order == sorted(order) else torch.tensor(order, device=dev)
    q = query if rows is None else query.index_select(0, rows)
    q = q.reshape(len(seqs), num_kv_heads, group, head_size)
    # Scaled in fp32 (one rounding to the query dtype), as [S, Hk, D, G] for K @ q^T.
    cdt = compute_dtype(query)
    # Which operand is wide: fp32 matmuls (MKL sgemm) run fastest with the tokens as the
    # output's columns (``q @ K^T``, ``P @ V^T``); half-precision ones with the tokens as its
    # rows (``K @ q^T``, ``V @ P^T``).
    wide = cdt == torch.float32
    q_s = q.float().mul_(scale).to(cdt)
    q_c = q_s if wide else q_s.transpose(-1, -2).contiguous()  # [S, Hk, G, D] or [S, Hk, D, G]
    direct = rows is None and out.is_contiguous()  # write results straight into ``out``
    o = out.view(q.shape) if direct else torch.empty_like(q)
    per_seq = 2 * num_kv_heads * table.shape[1] * b * head_size
    per_seq *= k_cache.element_size() + (cdt.itemsize if cdt != k_cache.dtype else 0)
    chunk = min(len(seqs), max(1, DECODE_CHUNK_BYTES // per_seq))
    k_slabs, slabs_per_block = _key_slabs(k_cache)  # [slabs, B, D/x] x-vectors
    v_units = _units(v_cache)  # [N, Hk, D, U]
    head_offsets = torch.arange(num_kv_heads, device=dev).view(1, -1, 1)
    most = chunk * table.shape[1] * num_kv_heads  # (block, head) pairs in a full chunk
    k_rows = k_slabs.new_empty(most, *k_slabs.shape[1:])
    v_rows = v_units.new_empty(most // num_kv_heads, *v_units.shape[1:])
    # Upcast K and V land here when the compute dtype is not the cache's (FP8, or half
    # precision on a CPU without native half-precision matmuls).
    up_buf = query.new_empty(most * b * head_size if cdt != k_cache.dtype else 0, dtype=cdt)
    scores_buf = query.new_empty(most * b * group, dtype=cdt)
    p_buf = query.new_empty(most * b * group, dtype=cdt)
    partial_buf = query.new_empty(most * head_size * group, dtype=cdt)
    sum_buf = query.new_empty(chunk * num_kv_heads * head_size * group, dtype=cdt)
    for s0 in range(0, len(seqs), chunk):
        s1 = min(len(seqs), s0 + chunk)
        n, width = s1 - s0, -(-lengths[s0] // b)
        pairs, tokens = n * num_kv_heads * width, width * b
        blocks = table[s0:s1, :width]
        slabs = (blocks.unsqueeze(1) * slabs_per_block + head_offsets).view(-1)
        k = torch.index_select(k_slabs, 0, slabs, out=k_rows[:pairs])
        k = k.view(k_cache.dtype).view(n * num_kv_heads, tokens, head_size)
        k = _upcast(k, k_scale, up_buf) if k.dtype != cdt else k
        q_chunk = q_c[s0:s1].reshape(n * num_kv_heads, *q_c.shape[2:])
        scores = scores_buf[: pairs * b * group]
        if wide:  # logits [n, Hk, G, L]
            torch.bmm(q_chunk, k.transpose(1, 2), out=scores.view(-1, group, tokens))
            logits = scores.view(n, num_kv_heads, group, tokens)
        else:
            torch.bmm(k, q_chunk, out=scores.view(-1, tokens, group))
            logits = scores.view(n, num_kv_heads, tokens, group).transpose(-1, -2)
        if lengths[s1 - 1] < tokens:
            lens = torch.tensor(lengths[s0:s1], device=dev).view(-1, 1)
            past_end = torch.arange(tokens, device=dev) >= lens
            logits.masked_fill_(past_end.view(n, 1, 1, -1), float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        p = p_buf[: pairs * b * group].view(n, width, num_kv_heads, group, b)
        p.copy_(probs.view(n, num_kv_heads, group, width, b).permute(0, 3, 1, 2, 4))
        p = p.view(pairs, group, b)
        v = torch.index_select(v_units, 0, blocks.reshape(-1), out=v_rows[: n * width])
        v = v.view(v_cache.dtype).view(pairs, head_size, b)
        v = _upcast(v, v_scale, up_buf) if v.dtype != cdt else v
        partial = partial_buf[: pairs * head_size * group]
        summed = sum_buf[: n * num_kv_heads * head_size * group]
        if wide:  # per (block, head): P [G, B] @ V^T [B, D]
            torch.bmm(p, v.transpose(1, 2), out=partial.view(pairs, group, head_size))
            summed = summed.view(n, num_kv_heads, group, head_size)
            torch.sum(partial.view(n, width, num_kv_heads, group, head_size), 1, out=summed)
            o[s0:s1] = summed
        else:  # per (block, head): V [D, B] @ P^T [B, G]
            torch.bmm(v, p.transpose(1, 2), out=partial.view(pairs, head_size, group))
            summed = summed.view(n, num_kv_heads, head_size, group)
            torch.sum(partial.view(n, width, num_kv_heads, head_size, group), 1, out=summed)
            o[s0:s1] = summed.transpose(-1, -2)
    if rows is not None:
        out.index_copy_(0, rows, o.view(out.shape))
    elif not direct:
        out.copy_(o.view(out.shape))


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype decode's matmuls run in: the query's, except half precision on a CPU without
    native half-precision matrix units, where fp32 is several times faster (the upcast is a
    cache-warm copy)."""
    if query.device.type != "cpu" or query.dtype == torch.float32:
        return query.dtype
    native = {
        torch.bfloat16: torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported(),
        torch.float16: torch.cpu._is_amx_fp16_supported(),
    }
    return query.dtype if native.get(query.dtype, True) else torch.float32


def _upcast(x: torch.Tensor, scale: float, buf: torch.Tensor) -> torch.Tensor:
    """``x * scale`` in ``buf``'s dtype, written into the front of ``buf`` (reused per chunk:
    a fresh tensor per chunk would pay page faults comparable to the matmul it feeds)."""
    out = buf[: x.numel()].view(x.shape).copy_(x)
    return out if scale == 1.0 else out.mul_(scale)


def _key_slabs(k_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """K as ``[slabs, B, D/x]`` 16-byte units, one slab per (block, head), token-major.

    Slab ``block * per_block + head`` is that head's K in that block. It is a view over the
    cache's own memory when heads are contiguous within a block (always, for a pool's
    layer views); otherwise over a contiguous copy. Returns the view and ``per_block``.
    """
    units = _units(k_cache).squeeze(-1)  # [N, Hk, D/x, B]
    num_blocks, heads, d_over_x, b = units.shape
    slab = d_over_x * b
    if units.stride()[1:] != (slab, b, 1) or units.stride(0) % slab:
        units = units.contiguous()
    per_block = units.stride(0) // slab
    count = (num_blocks - 1) * per_block + heads
    return torch.as_strided(units, (count, b, d_over_x), (slab, 1, b)), per_block


def _prefill(
    query: torch.Tensor,
    out: torch.Tensor,
    seqs: list[int],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> None:
    """Several query tokens per sequence: SDPA per sequence over its gathered K/V.

    One call per sequence, not a padded batch: query lengths are ragged, padding would spend
    ``(max_q - q_i) * L`` work per sequence, and one sequence's SDPA (all heads, hundreds of
    tokens) already fills the cores. On CPU the keys split at the cached prefix: the prefix
    is visible to every query (no mask) and the new tokens are causal among themselves
    (``is_causal``, which skips the masked half), and the two partial results merge by their
    log-sum-exps. Elsewhere one SDPA with a causal-offset mask. K/V are gathered in the
    query's dtype even where decode computes in fp32 (``compute_dtype``): the flash kernel
    upcasts half precision block by block itself, and fp32 copies of the gathered K/V (fresh
    memory each call) were slower.
    """
    cdt = query.dtype  # SDPA's CPU flash kernel upcasts half precision block by block itself
    for i in seqs:
        n, q_len, start = batch.seq_lens[i], batch.query_lens[i], batch.query_starts[i]
        width = -(-n // batch.block_size)
        table = tables[i : i + 1, :width]
        k = gather_k(k_cache, table, cdt, k_scale)[:, :, :n]  # [1, Hk, n, D]
        v = gather_v(v_cache, table, cdt, v_scale)[:, :, :, :n]
        v = v.transpose(-1, -2).contiguous()  # [1, Hk, n, D]
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0).to(cdt)  # [1, H, q_len, D]
        rows = out[start : start + q_len].transpose(0, 1).unsqueeze(0)
        cached = n - q_len
        if query.device.type == "cpu":
            new, new_lse = _flash_cpu(q, k[:, :, cached:], v[:, :, cached:], scale, causal=True)
            if cached == 0:
                rows.copy_(new)
                continue
            old, old_lse = _flash_cpu(q, k[:, :, :cached], v[:, :, :cached], scale, causal=False)
            # Weights of the two parts: exp(lse_part - lse_all); the new part's is a sigmoid.
            weight = torch.sigmoid(new_lse - old_lse).unsqueeze(-1).to(cdt)
            if cdt == query.dtype:
                torch.lerp(old, new, weight, out=rows)
            else:
                rows.copy_(torch.lerp(old, new, weight))
            continue
        # Query j sits at position (n - q_len) + j and sees keys at or before it.
        positions = torch.arange(q_len, device=query.device).view(-1, 1) + cached
        mask = torch.arange(n, device=query.device) <= positions
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        rows.copy_(o)


def _flash_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention returning ``(output, logsumexp)``; GQA by head groups.

    ``is_causal`` here is top-left aligned, which is right only for a square block of
    queries and keys (the new tokens among themselves).
    """
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return output, lse
