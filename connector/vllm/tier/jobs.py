"""The copies a ``TierdTier`` runs on its ``core.runner.Runner`` (probes first, then loads, then
stores), off vLLM's scheduler thread.

The copies move chunk rows between vLLM's primary region (``PrimaryRows``) and arena slots, one
copy each way: a store (``store_rows``) is ``verified_copy.store_rows`` (all threads, the GIL
released; without the native helper one strided torch copy per run of rows going to adjacent
slots); a load goes through ``core.load`` with ``PrimaryRows`` as its ``Sink``:
``verified_copy``'s one pass (xxh3 folded into the copy), or, without the native helper, a check
of every slot where it lies and a copy of the verified ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tierd.checksum import block_checksum
from tierd.connector.core.arena_slots import ArenaSlots
from tierd.connector.native.verified_copy import BlockRows, load_verified
from tierd.connector.native.verified_copy import store_rows as native_store


@dataclass(frozen=True, slots=True)
class PrimaryRows:
    """vLLM's primary region as rows: chunk ``c`` is ``array[c, :slot_bytes]`` (the rest of a
    row is page padding), and the ``core.load.Sink`` of loads into them. Holds the region's
    only export this tier makes (the tier drops it at shutdown)."""

    array: np.ndarray
    tensor: torch.Tensor
    slot_bytes: int

    @classmethod
    def of(cls, view: memoryview, slot_bytes: int) -> PrimaryRows:
        array = np.asarray(view).view(np.uint8)
        assert array.ndim == 2 and array.shape[1] >= slot_bytes, \
            f"the primary view must be [chunks, row bytes >= {slot_bytes}], got {array.shape}"
        return cls(array, torch.from_numpy(array), slot_bytes)

    def block_rows(self) -> BlockRows:
        """The rows as ``verified_copy`` addresses them: one ``slot_bytes`` row per chunk."""
        chunks, row_bytes = self.array.shape
        return BlockRows(self.array.ctypes.data, chunks, 1, 1, 1, self.slot_bytes, 0, row_bytes,
                         0, 0)

    def place(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
              block_ids: Sequence[int]) -> int:
        """The ``core.load.Sink`` of the rows: copy slot ``slot_ids[i]`` into chunk row
        ``block_ids[i]`` while checking it against ``checksums[i]``; how many leading slots
        verified (those after a bad one may be partly written)."""
        _check(slots, slot_ids)
        base, offset, size = slots.arena.data_ptr(), slots.geometry.offset, self.slot_bytes
        done = load_verified(self.block_rows(), [base + offset(s) for s in slot_ids], block_ids,
                             checksums)
        if done is not None:
            return done
        arena = slots.arena.numpy()
        for i, (slot, want, chunk) in enumerate(zip(slot_ids, checksums, block_ids)):
            piece = arena[offset(slot):offset(slot) + size]
            if block_checksum(piece.data) != want:
                return i
            self.array[chunk, :size] = piece
        return len(slot_ids)

    def settle(self) -> None:
        """Nothing to wait for: ``place`` copies synchronously."""


def store_rows(primary: PrimaryRows, slots: ArenaSlots, chunk_ids: Sequence[int],
               slot_ids: Sequence[int | None]) -> list[bool]:
    """Copy chunk ``chunk_ids[i]`` into slot ``slot_ids[i]`` (None: skipped); which were
    written. ``verified_copy.store_rows`` (all threads, non-temporal stores, one call), or
    without the native helper one ``copy_`` per run of consecutive chunks going to adjacent
    slots."""
    size, offset = primary.slot_bytes, slots.geometry.offset
    chosen = [(c, s) for c, s in zip(chunk_ids, slot_ids) if s is not None]
    _check(slots, [s for _, s in chosen])
    base = slots.arena.data_ptr()
    if native_store(primary.block_rows(), [base + offset(s) for _, s in chosen],
                    [c for c, _ in chosen]):
        return [s is not None for s in slot_ids]
    i = 0
    while i < len(slot_ids):
        slot = slot_ids[i]
        if slot is None:
            i += 1
            continue
        start, at = i, offset(slot)
        while (i + 1 < len(slot_ids) and slot_ids[i + 1] is not None
               and chunk_ids[i + 1] == chunk_ids[i] + 1
               and offset(slot_ids[i + 1]) == at + (i + 1 - start) * size):  # type: ignore[arg-type]
            i += 1
        n, chunk = i + 1 - start, chunk_ids[start]
        slots.arena[at:at + n * size].view(n, size).copy_(primary.tensor[chunk:chunk + n, :size])
        i += 1
    return [s is not None for s in slot_ids]


def _check(slots: ArenaSlots, slot_ids: Sequence[int]) -> None:
    if slot_ids and (min(slot_ids) < 0 or max(slot_ids) >= slots.num_slots):
        raise ValueError(f"slot ids must lie in [0, {slots.num_slots}): the daemon "
                         "answered for another arena")
