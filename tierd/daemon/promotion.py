"""Promotion: an SSD block read into a fresh DRAM slot for an acquire, and its landing.

``Promoter.stage`` allocates the slot (evicting LRU unpinned DRAM blocks if needed) and pins the
SSD record; ``start`` begins the staged reads as one batch (``SsdStore.read_many``: runs of
adjacent records, one ``preadv`` each); each read lands on its own, in a done-callback on the
event loop: the block becomes a DRAM block carrying one in-flight pin per waiting acquire (so no
demotion or eviction takes it before the acquire's lease), or its slot is freed and the bad
record dropped (a checksum failure). Two acquires of one block share one promotion. The node
store decides which blocks to promote and builds the leases; this module owns the reads.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierd.daemon.lru import SsdBlock
from tierd.daemon.ssd.index import READ_BATCH_BYTES
from tierd.daemon.tier_index import TierIndex
from tierd.types import NamespacedKey
from tierd.wire.geometry import SlotGeometry

if TYPE_CHECKING:
    from collections.abc import Callable

    from tierd.daemon.ssd import SsdStore
    from tierd.wire.arena import ShmArena


@dataclass(slots=True)
class Promotion:
    """An SSD read into a staged DRAM slot; lands (or fails) in a done-callback, then ``done``
    resolves for every waiting acquire. The landed block carries one in-flight pin per waiter,
    so no demotion or eviction takes it between landing and the acquire's lease."""

    key: NamespacedKey
    source: SsdBlock
    slot_bytes: int
    slot_id: int
    done: asyncio.Future[bool]
    waiters: int = 0
    landed: bool = False  # the read became this DRAM block, pinned once per waiter


class Promoter:
    """The promotions in flight (``active``, by key). Not thread-safe: one event loop.

    Asks the node store two things, and owns none of its tables: ``writing(key)``, whether an
    engine is writing the key under a reservation (a promotion of it does not land), and
    ``landed(key, pins)``, told when a promotion lands pinned once per waiter (the acquires'
    in-flight pins, which the node store accounts)."""

    def __init__(self, tiers: TierIndex, arena: ShmArena, ssd: SsdStore | None,
                 writing: Callable[[NamespacedKey], bool],
                 landed: Callable[[NamespacedKey, int], None],
                 clock: Callable[[], float]) -> None:
        self._tiers, self._arena, self._ssd = tiers, arena, ssd
        self._writing, self._landed, self._clock = writing, landed, clock
        self.active: dict[NamespacedKey, Promotion] = {}

    def stage(self, key: NamespacedKey, geometry: SlotGeometry, slot: int,
              reads: list[tuple[Promotion, memoryview]]) -> Promotion | None:
        """Stage an SSD block's promotion into ``slot`` (of ``geometry``, allocated by the
        caller), its read added to ``reads``; None if not on (a served) SSD (the caller keeps
        the slot). Every ``READ_BATCH_BYTES`` of records, ``reads`` is started and emptied (an
        I/O thread starts while the rest of a long prefix is staged, once it gets the GIL); the
        caller starts what is left."""
        source = self._tiers.disk.get(key) if self._tiers.ssd_up else None
        if source is None:
            return None
        assert self._ssd is not None
        source.pins += 1
        loop = asyncio.get_running_loop()
        p = Promotion(key, source, geometry.slot_bytes, slot, loop.create_future())
        self.active[key] = p
        reads.append((p, self._arena.view(geometry.offset(slot), p.slot_bytes)))
        if (len(reads) + 1) * source.stored_bytes > READ_BATCH_BYTES:
            self.start(reads)
            reads.clear()
        return p

    def start(self, reads: list[tuple[Promotion, memoryview]]) -> None:
        """Start the staged promotions' SSD reads as one batch; each lands on its own."""
        if not reads:
            return
        assert self._ssd is not None
        futures = self._ssd.read_many([(p.source.namespace, p.source.block_hash, view)
                                       for p, view in reads])
        for (p, _), read in zip(reads, futures):
            read.add_done_callback(functools.partial(self._land, p))

    def _land(self, p: Promotion, read: asyncio.Future[bool]) -> None:
        """A promotion's read finished: the block becomes an unpinned DRAM block (``BlockStored``
        "dram"), or its slot is freed and the bad record's entry dropped (a checksum failure).
        A key an engine is writing meanwhile (reserved while the SSD was hidden) is not landed."""
        failure = None if read.cancelled() else read.exception()
        ok = not read.cancelled() and failure is None and read.result()
        del self.active[p.key]
        p.source.pins -= 1
        t = self._tiers
        if ok and p.key not in t.dram and not self._writing(p.key):
            t.land(p.key, p.source, p.slot_bytes, p.slot_id, p.waiters)
            p.landed = True
            self._landed(p.key, p.waiters)
        else:
            t.free_slot(p.slot_bytes, p.slot_id)
        if not ok:
            t.unreadable(p.key, p.source, failure, self._clock())
        p.done.set_result(bool(ok))
