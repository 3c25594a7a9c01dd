"""A DRAM load in one pass: each slot is checked (xxh3-64) as it is copied; and the copy of a
store (``store_rows``: engine blocks into slots, the same threads, no hash: the daemon checksums
what is committed).

A load must verify every block where it lies in the arena (docs/connector.md, "Integrity");
verifying, then copying, reads the arena twice. ``verified_copy.c`` (built at install, see
``library``) reads it once, on ``torch.get_num_threads()`` threads, with the kernels of ``ISAS``;
the fused ones are checked against ``block_checksum`` when the library loads and are not used if
they disagree.

``load_verified`` returns how many leading blocks verified (all of them in the engine's KV), or
None when the library is not available, so the caller verifies, then copies. The bytes of a
block that failed, and of blocks after it, may have been partly copied into their engine blocks:
they are reported failed and recomputed, and nothing may use them meanwhile. The caller keeps
the slots pinned (a lease) for the call and has checked the slot ids (``ArenaSlots``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from tierd.checksum import block_checksum

from .library import shared_library

_log = logging.getLogger(__name__)
_SOURCE = "verified_copy.c"
_I64, _U64, _PTR = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p


@dataclass(frozen=True, slots=True)
class BlockRows:
    """Where the bytes of each engine block lie: ``layers x heads x tokens`` rows of ``row``
    contiguous bytes, row (l, h, n) of block b at ``base + l*s_layer + b*s_block + h*s_head +
    n*s_token`` (byte strides). A slot holds the same rows back to back in (l, h, n) order."""

    base: int
    num_blocks: int
    layers: int
    heads: int
    tokens: int
    row: int
    s_layer: int
    s_block: int
    s_head: int
    s_token: int

    @classmethod
    def of(cls, kv: torch.Tensor) -> BlockRows:
        """From a host uint8 ``[L, B, H, N, C]`` view (vLLM's layers, ``stack_layers``) or a
        ``[B, block_bytes]`` pool (the reference engine). ValueError for anything else."""
        if kv.dtype != torch.uint8 or kv.device.type != "cpu" or kv.stride(-1) != 1:
            raise ValueError("need a host uint8 view whose last axis is contiguous")
        if kv.dim() == 2:
            (blocks, width), (s_block, _) = kv.shape, kv.stride()
            rows = cls(kv.data_ptr(), blocks, 1, 1, 1, width, 0, s_block, 0, 0)
        elif kv.dim() == 5:
            layers, blocks, heads, tokens, width = kv.shape
            s_layer, s_block, s_head, s_token, _ = kv.stride()
            rows = cls(kv.data_ptr(), blocks, layers, heads, tokens, width, s_layer, s_block,
                       s_head, s_token)
        else:
            raise ValueError(f"need [L, B, H, N, C] or [B, bytes], got shape {tuple(kv.shape)}")
        if min(kv.stride()) < 0:
            raise ValueError("negative strides are not supported")
        return rows.coalesced()

    @property
    def block_bytes(self) -> int:
        return self.layers * self.heads * self.tokens * self.row

    def coalesced(self) -> BlockRows:
        """The same bytes in fewer, longer rows where consecutive rows are adjacent (vLLM's CPU
        layout LBHNC: one 64 KiB row per layer and block; block-major layouts: one per block)."""
        rows = self
        if rows.tokens == 1 or rows.s_token == rows.row:
            rows = replace(rows, row=rows.row * rows.tokens, tokens=1, s_token=0)
        if rows.tokens == 1 and (rows.heads == 1 or rows.s_head == rows.row):
            rows = replace(rows, row=rows.row * rows.heads, heads=1, s_head=0)
        if rows.tokens == 1 and rows.heads == 1 and (rows.layers == 1
                                                      or rows.s_layer == rows.row):
            rows = replace(rows, row=rows.row * rows.layers, layers=1, s_layer=0)
        return rows


ISAS = {"pieces": 0, "avx2": 2, "avx512": 3}
"""The load kernels of ``verified_copy.c``: hash a piece then copy it (any CPU, any rows), or
fold xxh3 into the copy, one load per 64-byte stripe, with AVX2 or AVX-512 (rows a multiple of
64 bytes; other rows take the pieces)."""


@dataclass(frozen=True)
class _Native:
    """The built ``tierd_load_verified`` and ``tierd_store_rows``, the best load kernel this CPU
    runs and ``TIERD_LOAD_KERNEL`` allows (``ISAS``), and the one used: the best of those that
    agreed with ``block_checksum`` at load."""

    fn: Callable[..., int]
    store_fn: Callable[..., None]
    cpu_isa: int
    isa: int

    def __call__(self, rows: BlockRows, addresses: Sequence[int], block_ids: Sequence[int],
                 checksums: Sequence[int], threads: int) -> int:
        n = len(addresses)
        return int(self.fn(n, (_U64 * n)(*addresses),
                           (_I64 * n)(*block_ids), (_U64 * n)(*checksums), *_grid(rows),
                           threads, self.isa))

    def store(self, rows: BlockRows, addresses: Sequence[int], block_ids: Sequence[int],
              threads: int) -> None:
        n = len(addresses)
        self.store_fn(n, (_U64 * n)(*addresses), (_I64 * n)(*block_ids), *_grid(rows), threads)


def _grid(rows: BlockRows) -> tuple[int, ...]:
    return (rows.base, rows.layers, rows.heads, rows.tokens, rows.row, rows.s_layer,
            rows.s_block, rows.s_head, rows.s_token)


_lock = threading.Lock()
_loaded: list[_Native | None] = []  # empty until the first call


def _library() -> _Native | None:
    """The helper, built and checked once per process; None if unavailable."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> _Native | None:
    lib = shared_library()
    if lib is None:
        return None
    fn = lib.tierd_load_verified
    fn.restype = _I64
    fn.argtypes = [_I64, _PTR, _PTR, _PTR, _U64, *[_I64] * 8, ctypes.c_int, ctypes.c_int]
    store = lib.tierd_store_rows
    store.restype = None
    store.argtypes = [_I64, _PTR, _PTR, _U64, *[_I64] * 8, ctypes.c_int]
    best = min(int(lib.tierd_fused_isa()), _kernel_cap())
    native = _Native(fn, store, best, ISAS["pieces"])
    if not _self_test(native):
        _log.warning("tierd: %s disagrees with block_checksum; DRAM loads take the Python path",
                     _SOURCE)
        return None
    for isa in sorted((i for i in ISAS.values() if 0 < i <= best), reverse=True):
        if _fused_agrees(replace(native, isa=isa)):
            return replace(native, isa=isa)
        _log.warning("tierd: the fused %s load of %s disagrees with block_checksum; not used",
                     next(k for k, v in ISAS.items() if v == isa), _SOURCE)
    return native


def _kernel_cap() -> int:
    """``TIERD_LOAD_KERNEL`` (pieces, avx2, avx512): the best load kernel allowed, for A/B
    measurements and for a CPU where a fused kernel should not run; unset: any."""
    name = os.environ.get("TIERD_LOAD_KERNEL", "")
    if name and name not in ISAS:
        _log.warning("tierd: TIERD_LOAD_KERNEL=%s is not one of %s; ignored", name,
                     ", ".join(ISAS))
    return ISAS.get(name, max(ISAS.values()))


def _self_test(native: _Native) -> bool:
    """Three blocks of 3 strided rows of 40,000 bytes, then again with the middle one's checksum
    wrong: all three verify and land, then only the first counts; and stored back into fresh
    slots, in another order, they come out equal."""
    src = torch.randint(0, 256, (3, 120_000), dtype=torch.uint8)
    dst = torch.zeros(3, 3, 40_000, dtype=torch.uint8)
    sums = [block_checksum(src[i].numpy().tobytes()) for i in range(3)]
    rows = BlockRows(dst.data_ptr(), 3, 3, 1, 1, 40_000, 40_000, 120_000, 0, 0)
    addresses = [src[i].data_ptr() for i in range(3)]
    good = native(rows, addresses, [0, 1, 2], sums, 1)
    landed = torch.equal(dst.reshape(3, -1), src)
    bad = native(rows, addresses, [0, 1, 2], [sums[0], sums[1] ^ 1, sums[2]], 2)
    back = torch.zeros_like(src)
    native.store(rows, [back[i].data_ptr() for i in range(3)], [2, 0, 1], 2)
    stored = torch.equal(back, dst.reshape(3, -1)[[2, 0, 1]])
    return good == 3 and landed and bad == 1 and stored


def _fused_agrees(native: _Native) -> bool:
    """One block of each length that decides a turn of xxh3's loop (one stripe past its 1 KiB
    blocks, a block less one stripe, 120 KB in strided rows...): the fused kernel lands it and
    verifies it against ``block_checksum``, and refuses it when the checksum is off by one."""
    for length in (256, 960, 1024, 1088, 2048, 17_536, 120_000):
        src = torch.randint(0, 256, (1, length), dtype=torch.uint8)
        dst = torch.zeros(2, length // 64, 128, dtype=torch.uint8)  # rows of 64 B, 128 B apart
        rows = BlockRows(dst.data_ptr(), 2, length // 64, 1, 1, 64, 128, length * 2, 0, 0)
        want = block_checksum(src.numpy().tobytes())
        if native(rows, [src.data_ptr()], [1], [want], 1) != 1:
            return False
        if not torch.equal(dst[1, :, :64].reshape(1, -1), src):
            return False
        if native(rows, [src.data_ptr()], [0], [want ^ 1], 1) != 0:
            return False
    return True


def available() -> bool:
    """True when ``load_verified`` runs natively here (loads the library on first call)."""
    return _library() is not None


def load_verified(rows: BlockRows, slot_addresses: Sequence[int], block_ids: Sequence[int],
                  checksums: Sequence[int], *, threads: int | None = None) -> int | None:
    """Copy slot ``i`` (``rows.block_bytes`` at address ``slot_addresses[i]``) into engine
    block ``block_ids[i]`` while checking it against ``checksums[i]``; returns how many leading
    blocks verified, or None (nothing copied) when the native helper is unavailable. ``threads``
    defaults to ``torch.get_num_threads()``. Blocks until done; releases the GIL."""
    if len(checksums) != len(slot_addresses):
        raise ValueError("need one engine block and one checksum per slot")
    native, count = _prepared(rows, slot_addresses, block_ids, threads)
    if native is None:
        return None
    return native(rows, slot_addresses, block_ids, checksums, count) if slot_addresses else 0


def store_rows(rows: BlockRows, slot_addresses: Sequence[int], block_ids: Sequence[int], *,
               threads: int | None = None) -> bool:
    """Copy engine block ``block_ids[i]`` of ``rows`` into the slot at ``slot_addresses[i]``
    (``rows.block_bytes`` each, its rows back to back); False (nothing copied) when the native
    helper is unavailable. The caller holds the slots (a reservation) and has checked their
    ids. ``threads`` defaults to ``torch.get_num_threads()``. Blocks until done; releases the
    GIL."""
    native, count = _prepared(rows, slot_addresses, block_ids, threads)
    if native is None:
        return False
    if slot_addresses:
        native.store(rows, slot_addresses, block_ids, count)
    return True


def _prepared(rows: BlockRows, slot_addresses: Sequence[int], block_ids: Sequence[int],
              threads: int | None) -> tuple[_Native | None, int]:
    """The checks of both directions (``ValueError``: one block per slot, ids in ``rows``),
    then the helper (None where unavailable) and the threads to use."""
    if len(slot_addresses) != len(block_ids):
        raise ValueError("need one engine block per slot")
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= rows.num_blocks):
        raise ValueError(f"engine block ids must lie in [0, {rows.num_blocks})")
    count = torch.get_num_threads() if threads is None else threads
    return _library(), max(1, count)
