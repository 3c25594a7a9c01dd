"""Write-behind: committed DRAM blocks reach the SSD tier within a bounded delay, and a graceful
stop writes down what is still only in DRAM, so a restart finds the cache.

Without it a block gets an SSD copy only when the flusher demotes it (DRAM above the high
watermark), so a mostly empty arena lives in DRAM only and a restart loses it all. With it:

- **Steady state.** ``WriteBehind`` is a ``TierListener`` of the tier index: every block that
  enters DRAM is noted (commit time order); one that leaves DRAM, or gains an SSD copy by other
  means (a demotion), is forgotten. The daemon runs ``run`` every half ``delay`` seconds: it
  writes the noted blocks still without an SSD copy, oldest first, in batches of at most
  ``batch_bytes``, through ``TierIndex.write_to_ssd`` (the SSD's own admission: its byte bound,
  LRU room-making, ``ssd_min_hits``, its health). A batch starts only once the SSD promotions in
  flight are done (waiting at most a quarter of ``delay``), and one batch at a time, between
  which the event loop serves calls: engine loads go first. A block committed more than
  ``delay`` seconds before a ``kill -9`` is on SSD as long as the disk sustains the commit rate
  (``lag_seconds`` says by how much it does not).
- **Graceful stop.** ``flush`` writes every DRAM block without an SSD copy, most recently used
  first, in the same batches, starting none after its deadline, and never more than the SSD's
  bound (so it does not evict what it just wrote).

The noted set holds at most one entry per DRAM block (it is forgotten with the block), so it is
bounded by the arena. Only the event loop touches it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierd.daemon.listeners import Payload
from tierd.daemon.lru import DramBlock
from tierd.daemon.tier_index import TierIndex
from tierd.types import NamespacedKey, Tier


@dataclass(frozen=True, slots=True)
class Flushed:
    """What a ``flush`` did: blocks written, DRAM-only blocks left unwritten (budget, bound or
    admission), and the seconds it took."""

    written: int
    left: int
    seconds: float


class WriteBehind:
    """The blocks committed into DRAM and not yet given an SSD copy, and the passes that write
    them. Construct over the store's ``TierIndex`` and add it to the index's listeners."""

    def __init__(self, tiers: TierIndex, *, delay: float, min_hits: int, batch_bytes: int,
                 clock: Callable[[], float]) -> None:
        self._tiers, self.delay, self._min_hits = tiers, delay, min_hits
        self._batch_bytes, self._clock = batch_bytes, clock
        self._noted: OrderedDict[NamespacedKey, float] = OrderedDict()  # key -> noted at
        self.written = 0          # blocks written by ``run`` since start-up

    def __len__(self) -> int:
        return len(self._noted)

    def lag_seconds(self, now: float) -> float:
        """How long the oldest noted block has waited (0 when none waits)."""
        return now - next(iter(self._noted.values())) if self._noted else 0.0

    async def run(self, lock: asyncio.Lock, loads: Callable[[], Sequence[asyncio.Future[bool]]]
                  ) -> int:
        """One pass: write every noted block still without an SSD copy, oldest first, one batch
        at a time under ``lock`` (the store's maintenance lock), each after ``loads()`` (the
        promotions in flight) are done or a quarter of ``delay`` passed. Blocks the SSD does not
        admit are forgotten (demotion or ``flush`` may still write them). With the SSD tier
        hidden (unhealthy) everything noted is forgotten. Returns the blocks written."""
        total = 0
        while self._noted:
            if not self._tiers.ssd_up:
                self._noted.clear()
                break
            batch = self._take()
            if not batch:
                break
            waiting = [f for f in loads() if not f.done()]
            if waiting:
                await asyncio.wait(waiting, timeout=self.delay / 4)
            async with lock:  # the awaits above may have evicted some: their slots moved on
                batch = [(k, b) for k, b in batch if self._tiers.dram.get(k) is b]
                total += await self._tiers.write_to_ssd(batch, self._min_hits, self._clock())
        self.written += total
        return total

    async def flush(self, deadline: float) -> Flushed:
        """Write every DRAM block without an SSD copy, most recently used first, in batches,
        starting none once the clock passes ``deadline`` and stopping before the SSD's bound
        would make it drop what this flush wrote. Call with no other pass running (at stop)."""
        start = self._clock()
        self._noted.clear()
        ssd = self._tiers.ssd
        if ssd is None or not self._tiers.ssd_up:
            return Flushed(0, self._dram_only(), 0.0)
        todo = [(k, b) for k, b in self._tiers.dram.newest_first() if k not in self._tiers.disk]
        room, written, i = ssd.capacity_bytes, 0, 0
        while i < len(todo) and self._clock() < deadline and self._tiers.ssd_up:
            batch: list[tuple[NamespacedKey, DramBlock]] = []
            size = 0
            while i < len(todo) and size < self._batch_bytes:
                need = ssd.record_bytes(todo[i][1].slot_bytes)
                if need > room:
                    break
                batch.append(todo[i])
                size, room, i = size + todo[i][1].slot_bytes, room - need, i + 1
            if not batch:
                break
            batch = [(k, b) for k, b in batch if self._tiers.dram.get(k) is b]
            written += await self._tiers.write_to_ssd(batch, self._min_hits, self._clock())
        return Flushed(written, self._dram_only(), self._clock() - start)

    def _take(self) -> list[tuple[NamespacedKey, DramBlock]]:
        """Pop up to ``batch_bytes`` of noted blocks (oldest first) that are in DRAM without an
        SSD copy and not being written; drop noted keys that no longer are."""
        batch: list[tuple[NamespacedKey, DramBlock]] = []
        size = 0
        dram, disk = self._tiers.dram, self._tiers.disk
        while self._noted and size < self._batch_bytes:
            key, _ = self._noted.popitem(last=False)
            block = dram.get(key)
            if block is None or key in disk or block.demoting:
                continue
            batch.append((key, block))
            size += block.slot_bytes
        return batch

    def _dram_only(self) -> int:
        return sum(1 for k, _ in self._tiers.dram.oldest_first() if k not in self._tiers.disk)

    def check_integrity(self) -> None:
        """Assert every noted key is a DRAM block (the set is bounded by the arena)."""
        assert all(k in self._tiers.dram for k in self._noted), "a noted key has no DRAM block"

    # -- TierListener --------------------------------------------------------------------------

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        if tier == "dram":
            now = self._clock()
            for key in keys:
                self._noted[key] = now
        elif tier == "ssd":
            for key in keys:
                self._noted.pop(key, None)

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        if tier == "dram":
            for key in keys:
                self._noted.pop(key, None)

    def cleared(self, tier: Tier) -> None:
        """Nothing: a hidden SSD tier empties the noted set at the next ``run``."""

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        """Nothing: the index reports the copy's removal separately."""
