"""Writes and block moves on the paged pool: new tokens, copy-on-write, tier transfers.

Every function validates its arguments (raising ValueError) before touching memory and issues a
fixed number of batched tensor ops, never a Python loop per block or per layer. On CUDA they are
asynchronous on the current stream unless noted; on CPU they return when the copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fp8 import is_fp8, quantize
from .layout import KVCache, cache_geometry

BlockPairs = Sequence[tuple[int, int]] | torch.Tensor


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new tokens' K/V ([num_tokens, num_kv_heads, head_size]) into one layer's cache.

    ``slot_mapping[t]`` is the absolute slot ``block_id * block_size + offset`` of token ``t``;
    ``-1`` marks a padding token, which is skipped. FP8 caches store ``saturate(x / scale)``.
    Reads ``slot_mapping`` on the host to validate it (a device sync on CUDA).
    """
    num_blocks, num_kv_heads, head_size, block_size = cache_geometry(k_cache, v_cache)
    shape = (slot_mapping.shape[0], num_kv_heads, head_size)
    if slot_mapping.dim() != 1 or tuple(key.shape) != shape or tuple(value.shape) != shape:
        raise ValueError(
            f"key/value must be [num_tokens, num_kv_heads, head_size] = {shape} with a 1-D "
            f"slot_mapping; got {tuple(key.shape)}, {tuple(value.shape)}, "
            f"{tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(
            f"slot_mapping holds slots outside [-1, {num_blocks * block_size}): "
            "use -1 for padding and block_id * block_size + offset otherwise"
        )
    keep = slots >= 0
    slots = slots[keep]
    key, value = key.to(k_cache.device)[keep], value.to(v_cache.device)[keep]
    if is_fp8(k_cache.dtype):
        key = quantize(key, k_scale, k_cache.dtype)
        value = quantize(value, v_scale, v_cache.dtype)
    else:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    blocks, offsets = slots // block_size, slots % block_size
    x = k_cache.shape[-1]
    # Advanced indices on dims 0 and 3 put the token dimension first: [T, H, D // x, x].
    k_cache[blocks, :, :, offsets, :] = key.reshape(-1, num_kv_heads, head_size // x, x)
    v_cache[blocks, :, :, offsets] = value


def copy_blocks(kv_cache: KVCache, pairs: BlockPairs) -> None:
    """Copy whole blocks (every layer, K and V) ``src -> dst`` for copy-on-write.

    All sources are read before any destination is written, so a block may be both a source and
    (in another pair) a destination. Destinations must be distinct.
    """
    table = torch.as_tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    src, dst = table[:, 0], table[:, 1]
    _check_block_ids(src, kv_cache.spec.num_blocks, "copy_blocks source")
    _check_block_ids(dst, kv_cache.spec.num_blocks, "copy_blocks destination", unique=True)
    pool = kv_cache.pool
    src, dst = src.to(pool.device), dst.to(pool.device)
    pool.index_copy_(0, dst, pool.index_select(0, src))


def gather_blocks(kv_cache: KVCache, block_ids: torch.Tensor, out_flat: torch.Tensor) -> None:
    """Copy blocks ``block_ids`` of the pool into rows of ``out_flat`` (one row per block).

    ``out_flat`` is ``[n, block_bytes]`` uint8 or any contiguous 2-D typed view of the same bytes
    (e.g. the daemon's DRAM slots). It may live on another device (pinned host memory for a GPU
    pool); then the copy is one device-side gather plus one transfer. The caller must not reuse
    ``out_flat`` until the copy is done (synchronize the current stream on CUDA).
    """
    pool = kv_cache.pool
    ids = _check_block_ids(block_ids, kv_cache.spec.num_blocks, "gather_blocks")
    out = _as_rows(out_flat, ids.numel(), kv_cache.spec.block_bytes, "out_flat")
    ids = ids.to(pool.device)
    if out.device == pool.device:
        torch.index_select(pool, 0, ids, out=out)
    else:
        out.copy_(pool.index_select(0, ids), non_blocking=True)


def scatter_blocks(kv_cache: KVCache, block_ids: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy rows of ``flat`` (one block each) into pool blocks ``block_ids`` (distinct ids).

    The inverse of :func:`gather_blocks`, with the same row format and device rules. ``flat``
    must stay unchanged until the copy is done.
    """
    pool = kv_cache.pool
    ids = _check_block_ids(block_ids, kv_cache.spec.num_blocks, "scatter_blocks", unique=True)
    rows = _as_rows(flat, ids.numel(), kv_cache.spec.block_bytes, "flat")
    pool.index_copy_(0, ids.to(pool.device), rows.to(pool.device, non_blocking=True))


def _check_block_ids(
    block_ids: torch.Tensor, num_blocks: int, what: str, *, unique: bool = False
) -> torch.Tensor:
    ids = torch.as_tensor(block_ids)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: block ids must be a 1-D int32/int64 tensor")
    ids = ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{what}: block ids must lie in [0, {num_blocks})")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{what}: block ids must be distinct (a block written twice is a race)")
    return ids


def _as_rows(flat: torch.Tensor, n: int, block_bytes: int, what: str) -> torch.Tensor:
    if flat.dim() != 2 or not flat.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 2-D tensor [n, block_bytes / itemsize]")
    if flat.shape[0] != n or flat.shape[1] * flat.element_size() != block_bytes:
        raise ValueError(
            f"{what} must hold {n} rows of {block_bytes} bytes, got {tuple(flat.shape)} "
            f"of {flat.dtype}"
        )
    return flat.view(torch.uint8)
