"""Where an SGLang host page's bytes lie, the tierd ``Layout`` it is stored under, and the
copies between host pages and arena slots.

SGLang's host pool (``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost``) describes a page through
``get_page_buffer_meta``: a few runs of contiguous bytes per page, the same for every page
(``page_first``: K and V, 2 runs; ``layer_first``: K and V of each layer, 2 x layers runs; MLA: 1
latent run per page or per layer). A tierd slot holds a page's runs back to back in that order,
so a block's bytes are the page's bytes in SGLang's own zero-copy order, and ``kv_format`` names
that order (``sglang-<mha|mla>-<host layout>``, plus the pipeline stage and context-parallel
rank when there are several). The runs form a ``BlockRows`` grid (page ``p`` = block ``p``), so
a load is one verify-while-copy pass (``ArenaSlots.load_verified``).

The legacy (non-v1) calls hand SGLang's *flat* page (``get_data_page(flat=True)``): the same
runs with K/V outermost, which differs from the slot order only for MHA ``layer_first``
(``flat_to_slot``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from tierd.connector.native.verified_copy import BlockRows, store_rows
from tierd.gpu.layout import DTYPE_NAMES
from tierd.wire.layout import Layout

MIN_PAGE_SIZE = 16
"""Smaller pages make a daemon entry, a checksum and a lease slot per few tokens."""

_KINDS: dict[str, Literal["mha", "mla"]] = {
    "MHATokenToKVPoolHost": "mha", "MLATokenToKVPoolHost": "mla"}
_LAYOUTS = {"mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
            "mla": ("layer_first", "page_first", "page_first_direct")}


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of the model's KV this engine holds (``HiCacheStorageConfig``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1


@dataclass(frozen=True, slots=True)
class PageFormat:
    """One host pool's pages as tierd blocks."""

    kind: Literal["mha", "mla"]
    layout: Layout
    rows: BlockRows
    """Page ``p``'s runs: ``layers x heads`` rows of ``row`` bytes (BlockRows' grid, block =
    page); the slot holds them in (layer, head) order."""
    page_size: int
    host: np.ndarray[Any, np.dtype[np.uint8]]
    """The host pool's whole buffer as bytes (for the runs' memcpys)."""

    @property
    def page_bytes(self) -> int:
        return self.rows.block_bytes

    def pages_of(self, host_indices: torch.Tensor, count: int) -> list[int]:
        """Page numbers of the first ``count`` pages of ``host_indices`` (token slots, a page's
        ``page_size`` of them in a row, as SGLang hands them)."""
        firsts = host_indices[:count * self.page_size:self.page_size].tolist()
        if any(f % self.page_size for f in firsts):
            raise ValueError("host indices must start pages (SGLang allocates host pages whole)")
        return [f // self.page_size for f in firsts]

    def store(self, pages: Sequence[int], slot_addresses: Sequence[int | None]) -> list[bool]:
        """Copy page ``pages[i]`` into the slot at ``slot_addresses[i]`` (None: skip), the
        page's runs back to back: ``verified_copy.store_rows`` (all threads, one call), or one
        strided torch copy per page without the native helper. Returns the ``written`` flags
        of the Commit; the daemon checksums the slots itself."""
        written = [a is not None for a in slot_addresses]
        chosen = [(p, a) for p, a in zip(pages, slot_addresses) if a is not None]
        if store_rows(self.rows, [a for _, a in chosen], [p for p, _ in chosen]):
            return written
        r = self.rows
        host = torch.from_numpy(self.host)
        offset = r.base - self.host.ctypes.data
        shape = (r.layers, r.heads, r.tokens, r.row)
        strides = (r.s_layer, r.s_head, r.s_token, 1)
        for page, address in zip(pages, slot_addresses):
            if address is None:
                continue
            source = host.as_strided(shape, strides, offset + page * r.s_block)
            torch.from_numpy(bytes_at(address, self.page_bytes)).view(shape).copy_(source)
        return written

    def copy_in(self, pages: Sequence[int], slot_addresses: Sequence[int]) -> None:
        """Copy slots into host pages, unverified (the caller verified the slots first; the
        path without the native helper)."""
        rows, host = self.rows, self.host
        base = rows.base - host.ctypes.data
        width = rows.row
        for page, address in zip(pages, slot_addresses):
            src = bytes_at(address, self.page_bytes)
            for i, dst in enumerate(self._run_offsets(base, page)):
                host[dst:dst + width] = src[i * width:(i + 1) * width]

    def _run_offsets(self, base: int, page: int) -> list[int]:
        r = self.rows
        start = base + page * r.s_block
        return [start + layer * r.s_layer + h * r.s_head
                for layer in range(r.layers) for h in range(r.heads)]

    def flat_to_slot(self, flat: torch.Tensor) -> torch.Tensor:
        """A legacy flat page's bytes in slot order (contiguous uint8 ``[page_bytes]``)."""
        data = flat.contiguous().view(torch.uint8).reshape(-1)
        if data.numel() != self.page_bytes:
            raise ValueError(f"a page holds {self.page_bytes} bytes, got {data.numel()}")
        if self.rows.heads == 1:
            return data
        return data.view(self.rows.heads, self.rows.layers, -1).transpose(0, 1).contiguous() \
            .view(-1)

    def slot_to_flat(self, slot: torch.Tensor, flat: torch.Tensor) -> None:
        """Write slot-ordered bytes ``slot`` into the legacy flat page ``flat`` (in place)."""
        target = flat.view(torch.uint8).view(-1)
        if self.rows.heads == 1:
            target.copy_(slot)
        else:
            target.view(self.rows.heads, self.rows.layers, -1).copy_(
                slot.view(self.rows.layers, self.rows.heads, -1).transpose(0, 1))


def page_format(pool: Any, shard: Shard, model_id: str) -> PageFormat:
    """The ``PageFormat`` of SGLang host pool ``pool``; ``ValueError`` naming the fix for a pool
    tierd cannot store (another pool class or page format, a page under ``MIN_PAGE_SIZE``)."""
    kind = _KINDS.get(type(pool).__name__)
    if kind is None or getattr(pool, "storage_format_tag", None) is not None:
        raise ValueError(f"tierd stores SGLang's MHA and MLA host pools, not "
                         f"{type(pool).__name__} (hybrid, sparse and packed-scale KV are not "
                         "supported): use another HiCache storage backend for this model")
    if pool.layout not in _LAYOUTS[kind]:
        raise ValueError(f"tierd does not support --hicache-mem-layout {pool.layout} for "
                         f"{kind.upper()} pools; use one of {', '.join(_LAYOUTS[kind])}")
    if pool.page_size < MIN_PAGE_SIZE:
        raise ValueError(f"tierd needs --page-size >= {MIN_PAGE_SIZE} with HiCache storage, "
                         f"got {pool.page_size}")
    if getattr(pool, "dcp_size", 1) != 1:
        raise ValueError("tierd does not support decode context parallel (DCP) host pools")
    dtype = DTYPE_NAMES.get(pool.dtype)
    if dtype is None:
        raise ValueError(f"tierd stores KV of dtype {sorted(map(str, DTYPE_NAMES))}, "
                         f"not {pool.dtype}")
    rows = _rows(pool)
    if kind == "mha":
        if pool.v_head_dim != pool.head_dim:
            raise ValueError("tierd needs K and V heads of one width "
                             f"(got {pool.head_dim} and {pool.v_head_dim})")
        heads, head_size = pool.head_num, pool.head_dim
        tp_rank, tp_size = shard.tp_rank, shard.tp_size
    else:  # one latent row per token, replicated on every rank: stored once, shared by all
        if pool.kv_cache_dim % 2:
            raise ValueError(f"tierd stores MLA rows of even width, got {pool.kv_cache_dim}")
        heads, head_size = 1, pool.kv_cache_dim // 2  # K and V halves of the latent row
        tp_rank, tp_size = 0, 1
    fmt = f"sglang-{kind}-{pool.layout}"
    if shard.pp_size > 1:
        fmt += f"-pp{shard.pp_rank}of{shard.pp_size}"
    if shard.cp_size > 1:
        fmt += f"-cp{shard.cp_rank}of{shard.cp_size}"
    layout = Layout(num_layers=pool.layer_num, num_kv_heads=heads, head_size=head_size,
                    dtype=dtype, block_size=pool.page_size, tp_rank=tp_rank, tp_size=tp_size,
                    kv_format=fmt, model_id=model_id)
    layout.validate()
    assert layout.block_bytes == rows.block_bytes, (
        f"{fmt}: a page's runs hold {rows.block_bytes} bytes, the layout {layout.block_bytes}")
    buffer = pool.kv_buffer
    host = buffer.view(-1).view(torch.uint8).numpy()
    return PageFormat(kind, layout, rows, pool.page_size, host)


def _rows(pool: Any) -> BlockRows:
    """The ``BlockRows`` grid of ``pool``'s pages, read off ``get_page_buffer_meta`` of its
    first two pages and checked against its last one."""
    page, pages = pool.page_size, pool.size // pool.page_size
    assert pool.kv_buffer.is_contiguous(), "SGLang host pools are one contiguous buffer"
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * page, dtype=torch.int64))
    runs = len(ptrs) // 2
    if len(set(sizes)) != 1 or len(ptrs) != 2 * runs:
        raise ValueError(f"tierd needs pages of equal runs, got sizes {sorted(set(sizes))}")
    offsets = [p - ptrs[0] for p in ptrs[:runs]]
    grid = _grid(offsets)
    if grid is None:
        raise ValueError(f"the {pool.layout} page runs at {offsets[:6]}... form no grid")
    layers, heads, s_layer, s_head = grid
    s_block = ptrs[runs] - ptrs[0]
    last, _ = pool.get_page_buffer_meta(torch.arange((pages - 1) * page, pages * page))
    assert last[0] == ptrs[0] + (pages - 1) * s_block, "pages must lie at one stride"
    return BlockRows(ptrs[0], pages, layers, heads, 1, sizes[0], s_layer, s_block, s_head, 0)


def _grid(offsets: list[int]) -> tuple[int, int, int, int] | None:
    """``(layers, heads, s_layer, s_head)`` with run ``l * heads + h`` at ``l * s_layer + h *
    s_head``: heads is 1, or 2 for K/V pairs inside each layer (MHA ``layer_first``)."""
    for heads in (1, 2):
        if len(offsets) % heads:
            continue
        layers = len(offsets) // heads
        s_head = offsets[1] if heads == 2 else 0
        s_layer = offsets[heads] if layers > 1 else 0
        if all(offsets[layer * heads + h] == layer * s_layer + h * s_head
               for layer in range(layers) for h in range(heads)):
            return layers, heads, s_layer, s_head
    return None


def bytes_at(address: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``size`` bytes of mapped memory at ``address`` as a numpy array (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
