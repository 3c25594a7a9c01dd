"""``load_leased``: the one load of every front end.

A load takes a ``Lease`` (an Acquire made now, or a pin taken earlier, e.g. at lookup), has a
``Sink`` check each leased slot where it lies in the arena against its checksum and put the
leading verified blocks into the engine's blocks, then releases the lease, naming the first
block that failed (``corrupt_from``) so the daemon re-checks and drops a bad copy.

The lease-outlives-copy rule, enforced one way: **a copy counts only if the lease still held
when the copy's reads of the arena were done**. ``finish_load`` checks it after the copy (after
``Sink.settle`` for a sink that reads asynchronously): the engine clock must be before the
lease's conservative ``deadline`` and, where the Release is made at once, the daemon must
confirm it still held the lease. Otherwise nothing of the load counts (``lease_lost``): the
slots may have been reused under the copy. A front end that defers its Release off the engine
thread (the reference hooks) relies on the deadline alone.

A load returns how many leading blocks are in place (``LoadResult.placed``); every block after
them must be recomputed by the engine, whatever bytes its memory holds (a one-pass copy may
have written part of the first bad block): invariant 2, a block whose load failed is never used.

Two steps for a sink whose copy is still reading when it returns (``DeviceSink``: DMAs on a
side stream): ``start_load`` (check and queue) now, ``finish_load`` (settle, release, check the
lease) later, before the engine may use the blocks' result; ``load_leased`` is both at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tierd.connector.core.arena_slots import ArenaSlots
from tierd.connector.core.lease import Clock, Lease, Release

_log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where a load's verified blocks go (engine memory of one layout)."""

    def place(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
              block_ids: Sequence[int]) -> int:
        """Check ``slot_ids[i]`` against ``checksums[i]`` where it lies in the arena and put
        the leading verified blocks into engine blocks ``block_ids[i]`` (equal lengths);
        returns how many verified. A block that failed, and those after it, may be partly
        written. Reads the slots before it returns, or, for an asynchronous sink, until
        ``settle``; the caller's lease pins them meanwhile. ``ValueError`` for slot ids outside
        the mapped arena (a stale geometry, another daemon's slots)."""
        ...

    def settle(self) -> None:
        """Block until every read of the arena ``place`` started has finished (the leases may
        then go). Nothing to do for a sink that copies synchronously."""
        ...


@dataclass(frozen=True, slots=True)
class OpenLoad:
    """A load whose copy has started; its lease is still held (``finish_load`` ends it)."""

    lease: Lease
    block_ids: list[int]        # engine blocks the copy targets, one per leased slot used
    verified: int               # leading blocks that verified (and were copied or queued)

    @property
    def corrupt_from(self) -> int | None:
        """Index of the first block that failed its check (None: all verified)."""
        return self.verified if self.verified < len(self.block_ids) else None


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load placed. ``placed``: leading blocks in the engine's memory, verified, under a
    lease that held; ``verified``: leading blocks that passed their check; ``acquired``: blocks
    the lease pinned and the load used; ``lease_lost``: the lease ended before the copy was
    done, so nothing counts."""

    placed: int
    verified: int
    acquired: int
    lease_lost: bool

    @property
    def corrupt(self) -> bool:
        """A leased block failed its check (the daemon was told, ``corrupt_from``)."""
        return self.verified < self.acquired


def start_load(lease: Lease, block_ids: Sequence[int], slots: ArenaSlots, sink: Sink) -> OpenLoad:
    """Check and copy (or queue the copy of) the leased blocks into ``block_ids[:n]`` (``n``:
    the fewer of the two). A ``ValueError`` from the sink (slots outside the arena) is a load
    of nothing verified, not an exception. Blocks for the checks (and a synchronous copy)."""
    n = min(len(block_ids), lease.num_blocks)
    targets = list(block_ids[:n])
    try:
        verified = sink.place(slots, lease.slot_ids[:n], lease.checksums[:n], targets) if n else 0
    except ValueError as exc:  # slots outside the arena we mapped: a daemon bug, a miss here
        _log.warning("tierd load rejected: %s", exc)
        verified = 0
    return OpenLoad(lease, targets, verified)


def finish_load(load: OpenLoad, sink: Sink, release: Release, clock: Clock) -> LoadResult:
    """Wait for the copy's reads (``sink.settle``), release the lease (``corrupt_from`` for the
    first bad block) and apply the lease-outlives-copy rule (module doc)."""
    sink.settle()
    in_time = clock() < load.lease.deadline
    confirmed = release(load.lease, load.corrupt_from) if load.lease.num_blocks else True
    lost = bool(load.block_ids) and (not in_time or confirmed is False)
    return LoadResult(0 if lost else load.verified, load.verified, len(load.block_ids), lost)


def load_leased(lease: Lease, block_ids: Sequence[int], slots: ArenaSlots, sink: Sink,
                release: Release, clock: Clock) -> LoadResult:
    """``start_load`` then ``finish_load``: the whole load, blocking until done. A sink that
    raises (anything but the ``ValueError`` of bad slot ids) has its reads settled and the
    lease released before the exception goes on: no path keeps a lease."""
    try:
        opened = start_load(lease, block_ids, slots, sink)
    except BaseException:
        try:
            sink.settle()
        finally:
            release(lease, None)
        raise
    return finish_load(opened, sink, release, clock)
