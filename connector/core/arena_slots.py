"""Moving KV blocks between the daemon's shared-memory arena and an engine's paged pool.

Engine-agnostic: a *pool* is any 2-D uint8 tensor ``[num_blocks, block_bytes]`` whose row ``b`` is
block ``b`` of every layer (``tierd.gpu.layout.KVCache.pool``; an adapter for another engine
passes a view of the same shape), on CPU or a GPU. An arena slot holds exactly one such row.

Copies on the engine thread are one batched torch op each (``index_select`` / ``index_copy_``
over an int64-word view of the arena) or one ``copy_`` per run of consecutive rows, never a
Python loop per block; the checksums (xxh3-64,
``tierd.checksum.block_checksum``) are computed block by block over memory already in
place.

Load (``load_blocks``, the copy under ``core.sinks.PoolRows``), host pool: each slot checked
where it lies in the arena (pinned by the caller's lease) as it is copied into its pool row, in
one pass (``native.verified_copy``), or, without the native helper, verify every slot, then one
gather of the leading run that verified straight into the pool rows. Device pool: arena slots ->
private
pre-touched host staging (one gather) -> verify there -> pool rows (one scatter). Either way a
mismatch makes that block and every later one a miss, recomputed in its row (in one pass its
row may hold some of the bad bytes until then, as it held stale ones before).

Save (``ArenaSlots.write``, used by ``core.save.write_rows``): rows already copied out of the
pool into staging -> reserved arena slots, by plain host memcpys of runs of adjacent slots (no
torch op, so a background thread does not start a second OpenMP team beside the engine's). The
daemon checksums the slots at the Commit.

Staging memory is allocated and zero-filled once (the first touch of fresh pages is slow; a
per-call temporary would pay it on every transfer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tierd.checksum import block_checksum
from tierd.connector.native.verified_copy import BlockRows, load_verified
from tierd.wire.geometry import SlotGeometry


class ArenaSlots:
    """Batched access to the slots of one size class in an arena tensor (``ShmArena.as_tensor``).

    Holds views of ``arena`` (keeping the mapping alive) and nothing else; thread-safe for
    disjoint slots. Slot ids must come from the daemon for this geometry."""

    def __init__(self, arena: torch.Tensor, geometry: SlotGeometry) -> None:
        if arena.dtype != torch.uint8 or arena.dim() != 1:
            raise ValueError("arena must be the 1-D uint8 tensor of ShmArena.as_tensor()")
        if geometry.slots_per_slab * geometry.slot_bytes > geometry.slab_bytes:
            raise ValueError(f"geometry {geometry} puts more slot bytes in a slab than it has")
        self.arena = arena  # the whole mapping, as given
        self.geometry = geometry
        self.slot_bytes = geometry.slot_bytes
        size = arena.numel()
        self.num_slots = (size // geometry.slab_bytes) * geometry.slots_per_slab
        # Copy in 8-byte words where the geometry allows: torch's indexed copies move one
        # element at a time, so uint8 elements would be far slower than memcpy.
        unit = 8 if (geometry.slab_bytes % 8 == 0 and self.slot_bytes % 8 == 0
                     and arena.data_ptr() % 8 == 0) else 1
        base = arena[:size // unit * unit].view(torch.int64) if unit == 8 else arena
        width = self.slot_bytes // unit
        # Reads: every slot offset is a multiple of g, so one 2-D (possibly overlapping) row view
        # with row stride g reaches every slot; index_select reads it without a temporary.
        self._unit = unit
        self._base, self._width = base, width
        self._g = math.gcd(geometry.slab_bytes, geometry.slot_bytes) // unit
        rows = (base.numel() - width) // self._g + 1 if base.numel() >= width else 0
        self._read_rows = base.as_strided((rows, width), (self._g, 1))
        self._bytes = arena.numpy()  # the same mapping, for plain memcpys (``write``)

    def _check(self, slot_ids: Sequence[int]) -> None:
        if slot_ids and (min(slot_ids) < 0 or max(slot_ids) >= self.num_slots):
            raise ValueError(f"slot ids must lie in [0, {self.num_slots}): a stale geometry or a "
                             "slot id from another daemon")

    def read(self, slot_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy slots ``slot_ids`` into rows of ``out`` (contiguous uint8 ``[n, slot_bytes]``,
        host memory) in one ``index_select``. Blocks until done."""
        self._check(slot_ids)
        if tuple(out.shape) != (len(slot_ids), self.slot_bytes) or out.dtype != torch.uint8:
            raise ValueError(f"out must be uint8 [{len(slot_ids)}, {self.slot_bytes}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        offsets = torch.tensor([self.geometry.offset(s) for s in slot_ids], dtype=torch.int64)
        torch.index_select(self._read_rows, 0, offsets // self._unit // self._g,
                           out=words(out) if self._unit == 8 else out)

    def verified(self, slot_ids: Sequence[int], checksums: Sequence[int]) -> int:
        """How many leading slots hold bytes whose ``block_checksum`` is ``checksums[i]``,
        hashed where they lie in the arena (no copy; stops at the first mismatch)."""
        self._check(slot_ids)
        offset_of, width, data = self.geometry.offset, self.slot_bytes, self._bytes
        for i, (slot, want) in enumerate(zip(slot_ids, checksums)):
            offset = offset_of(slot)
            if block_checksum(data[offset:offset + width].data) != want:
                return i
        return len(slot_ids)

    def load_verified(self, slot_ids: Sequence[int], checksums: Sequence[int], rows: BlockRows,
                      block_ids: Sequence[int], *, threads: int | None = None) -> int | None:
        """Copy slot ``slot_ids[i]`` into engine block ``block_ids[i]`` of ``rows`` while
        checking it against ``checksums[i]``, in one pass (``verified_copy``); how many leading
        blocks verified, or None (nothing copied) where the native helper is unavailable. A
        block that failed, and those after it, may be partly written: recompute them.
        ``threads``: copying threads (default ``torch.get_num_threads()``)."""
        self._check(slot_ids)
        if rows.block_bytes != self.slot_bytes:
            raise ValueError(f"engine blocks of {rows.block_bytes} bytes cannot take slots of "
                             f"{self.slot_bytes}")
        base, offset_of = self._base.data_ptr(), self.geometry.offset
        return load_verified(rows, [base + offset_of(s) for s in slot_ids], block_ids, checksums,
                             threads=threads)

    def read_into(self, slot_ids: Sequence[int], pool: torch.Tensor,
                  block_ids: Sequence[int]) -> bool:
        """Copy slot ``slot_ids[i]`` into row ``block_ids[i]`` of a host ``pool`` (contiguous
        uint8 ``[num_blocks, slot_bytes]``) with no staging: one plain ``copy_`` (a memcpy) per
        run of slots adjacent in the arena going to consecutive pool rows (a slab allocator hands
        out adjacent slots and a fresh allocation is one run, so a load is a few memcpys).
        Returns False, having copied nothing, if the pool is not on the host or not addressable
        in the arena's copy unit (then go through staging: ``read``). Blocks until done."""
        if len(slot_ids) != len(block_ids):
            raise ValueError("need one pool block per slot")
        target = words(pool) if self._unit == 8 else pool
        if (pool.device.type != "cpu" or not pool.is_contiguous()
                or target.dtype != self._base.dtype):
            return False
        self._check(slot_ids)
        width, unit = self._width, self._unit
        for first, stop, offset in self._runs(slot_ids):
            start = first
            for i in range(first + 1, stop + 1):
                if i == stop or block_ids[i] != block_ids[i - 1] + 1:
                    n, row = i - start, block_ids[start]
                    at = (offset + (start - first) * self.slot_bytes) // unit
                    target[row:row + n].copy_(self._base[at:at + n * width].view(n, width))
                    start = i
        return True

    def write(self, slot_ids: Sequence[int | None], rows: torch.Tensor) -> None:
        """Copy row ``i`` of ``rows`` (uint8 ``[n, slot_bytes]``, any device) into slot
        ``slot_ids[i]`` (slots distinct; None: row ``i`` is not copied). Blocks until done.

        Meant for a background thread: one plain memcpy per run of rows that lie back to back
        in the arena (numpy, which drops the GIL while it copies; a slab allocator hands out
        adjacent slots, so a write is a few memcpys), never a torch op: a torch op started from
        a second thread brings up a second OpenMP team that fights the engine's for the cores."""
        if tuple(rows.shape) != (len(slot_ids), self.slot_bytes) or rows.dtype != torch.uint8:
            raise ValueError(f"rows must be uint8 [{len(slot_ids)}, {self.slot_bytes}], "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        given = [s for s in slot_ids if s is not None]
        self._check(given)
        if len(set(given)) != len(given):
            raise ValueError("slot ids must be distinct: a slot written twice is a race")
        src = rows.to("cpu").contiguous().numpy().reshape(-1)
        width = self.slot_bytes
        for first, stop, offset in self._runs(slot_ids):
            n = (stop - first) * width
            self._bytes[offset:offset + n] = src[first * width:first * width + n]

    def _runs(self, slot_ids: Sequence[int | None]) -> list[tuple[int, int, int]]:
        """``(first, stop, offset)``: rows ``first..stop-1`` go to ``[offset, offset + (stop -
        first) * slot_bytes)`` of the arena, back to back. Rows without a slot are skipped."""
        out: list[tuple[int, int, int]] = []
        offset_of, width = self.geometry.offset, self.slot_bytes
        first, start, end = 0, 0, -1
        for i, slot in enumerate(slot_ids):
            if slot is None:
                if end >= 0:
                    out.append((first, i, start))
                end = -1
                continue
            offset = offset_of(slot)
            if offset != end:
                if end >= 0:
                    out.append((first, i, start))
                first, start = i, offset
            end = offset + width
        if end >= 0:
            out.append((first, len(slot_ids), start))
        return out


def words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (uint8 ``[n, row_bytes]``, contiguous) viewed as int64 words when the row width
    and address allow it (indexed copies then move 8 bytes per element), else unchanged."""
    if rows.shape[-1] % 8 == 0 and rows.data_ptr() % 8 == 0 and rows.is_contiguous():
        return rows.view(torch.int64)
    return rows


def verified_prefix(rows: torch.Tensor, checksums: Sequence[int]) -> int:
    """How many leading rows of ``rows`` match ``checksums`` (stops at the first mismatch)."""
    width = rows.shape[1]
    flat = rows.numpy().data.cast("B")
    for i, want in enumerate(checksums):
        if block_checksum(flat[i * width:(i + 1) * width]) != want:
            return i
    return len(checksums)


def allocate_staging(num_rows: int, row_bytes: int) -> torch.Tensor:
    """A zero-filled (so already faulted-in) host tensor ``[num_rows, row_bytes]`` uint8.

    On a GPU host, pin it (``cudaHostRegister``) to make the pool side of a copy DMA."""
    if num_rows < 1 or row_bytes < 1:
        raise ValueError(f"staging needs at least one row of one byte, got {num_rows}x{row_bytes}")
    return torch.zeros(num_rows, row_bytes, dtype=torch.uint8)


def load_blocks(arena: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
                pool: torch.Tensor, block_ids: Sequence[int], staging: torch.Tensor, *,
                direct: bool = True) -> int:
    """Copy arena slots into pool rows, verifying every block; returns how many leading blocks
    are now in the pool and verified (the rest must be recomputed: in the one-pass copy their
    rows may hold bytes that failed).

    ``slot_ids[i]``/``checksums[i]`` describe the block that goes to ``block_ids[i]``; extra
    ``block_ids`` (past ``len(slot_ids)``) are left alone. ``direct`` (host pools): check the
    slots where they lie while copying them straight into the pool (one pass; or verify, then
    copy the verified run, without the native helper). Otherwise (device pools, or
    ``direct=False``), per chunk of
    ``len(staging)`` blocks: one gather from the arena into private staging, the checksums
    there, one scatter of the verified rows into the pool.
    The caller keeps the slots pinned (a lease) until this returns; blocks until done."""
    if len(slot_ids) != len(checksums) or len(slot_ids) > len(block_ids):
        raise ValueError("need one checksum per slot and a pool block for each slot")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != arena.slot_bytes:
        raise ValueError(f"pool must be uint8 [num_blocks, {arena.slot_bytes}] to match the slots")
    if staging.shape[1] != arena.slot_bytes:
        raise ValueError("staging rows must be one slot wide")
    if direct and pool.device.type == "cpu":
        one_pass = arena.load_verified(slot_ids, checksums, BlockRows.of(pool),
                                       block_ids[:len(slot_ids)])
        if one_pass is not None:
            return one_pass
        good = arena.verified(slot_ids, checksums)
        if arena.read_into(slot_ids[:good], pool, block_ids[:good]):
            return good
    done, chunk = 0, staging.shape[0]
    while done < len(slot_ids):
        n = min(chunk, len(slot_ids) - done)
        rows = staging[:n]
        arena.read(slot_ids[done:done + n], rows)
        good = verified_prefix(rows, checksums[done:done + n])
        if good:
            ids = torch.tensor(list(block_ids[done:done + good]), dtype=torch.int64)
            words(pool).index_copy_(0, ids.to(pool.device), words(rows[:good]).to(pool.device))
        done += good
        if good < n:
            break
    return done
