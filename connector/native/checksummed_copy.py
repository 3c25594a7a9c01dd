"""A store in one pass: each engine block is checksummed (xxh3-64) piece by piece as it is
copied into its arena slot (``checksummed_copy.c``), the reverse of ``verified_copy``.

Copying the rows, then hashing the slot, reads the bytes twice; this hashes 16 KiB of a block,
copies those bytes while they are still in the core's cache, and goes on, splitting the blocks
between ``torch.get_num_threads()`` threads; stores of 8 MiB or more write the arena with
non-temporal stores. ``store_checksummed`` returns the checksums to Commit, or None (nothing
copied) when the library is not available (no C compiler, ``TIERD_NATIVE=0``): the caller
copies and hashes in Python. The caller owns the slots (a reservation) for the call.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierd.checksum import block_checksum

from .build import shared_library
from .verified_copy import BlockRows, xxh3_api

_SOURCE = Path(__file__).with_name("checksummed_copy.c")
_I64, _U64, _PTR = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p


@dataclass(frozen=True)
class _Native:
    fn: Callable[..., int]
    api: ctypes.Structure

    def __call__(self, rows: BlockRows, block_ids: Sequence[int], addresses: Sequence[int],
                 threads: int) -> list[int] | None:
        n = len(addresses)
        out = (_U64 * n)()
        status = self.fn(ctypes.byref(self.api), n, (_U64 * n)(*addresses),
                         (_I64 * n)(*block_ids), out, rows.base, rows.layers, rows.heads,
                         rows.tokens, rows.row, rows.s_layer, rows.s_block, rows.s_head,
                         rows.s_token, threads)
        return list(out) if status == 0 else None


_lock = threading.Lock()
_loaded: list[_Native | None] = []


def _library() -> _Native | None:
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> _Native | None:
    lib = shared_library(_SOURCE)
    if lib is None:
        return None
    fn = lib.tierd_store_checksummed
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _U64, *[_I64] * 8, ctypes.c_int]
    native = _Native(fn, xxh3_api())
    return native if _self_test(native) else None


def _self_test(native: _Native) -> bool:
    """Three blocks of 3 strided rows of 40,000 bytes land in their slots with the checksums
    ``block_checksum`` gives the slots' bytes."""
    src = torch.randint(0, 256, (3, 3, 40_000), dtype=torch.uint8)
    dst = torch.zeros(3, 120_000, dtype=torch.uint8)
    rows = BlockRows(src.data_ptr(), 3, 3, 1, 1, 40_000, 40_000, 120_000, 0, 0)
    sums = native(rows, [2, 0, 1], [dst[i].data_ptr() for i in range(3)], 2)
    want = [block_checksum(dst[i].numpy().tobytes()) for i in range(3)]
    return sums == want and torch.equal(dst, src[[2, 0, 1]].reshape(3, -1))


def store_checksummed(rows: BlockRows, block_ids: Sequence[int], slot_addresses: Sequence[int],
                      *, threads: int | None = None) -> list[int] | None:
    """Copy engine block ``block_ids[i]`` of ``rows`` into the slot at ``slot_addresses[i]``
    (``rows.block_bytes`` each) and return each block's checksum; None (nothing copied) when
    the native helper is unavailable. Blocks until done; releases the GIL."""
    if len(block_ids) != len(slot_addresses):
        raise ValueError("need one slot per engine block")
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= rows.num_blocks):
        raise ValueError(f"engine block ids must lie in [0, {rows.num_blocks})")
    native = _library()
    if native is None:
        return None
    if not block_ids:
        return []
    count = torch.get_num_threads() if threads is None else threads
    return native(rows, block_ids, slot_addresses, max(1, count))
