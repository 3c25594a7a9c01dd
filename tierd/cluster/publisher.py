"""A node's side of the directory: what it holds, and a background task that tells Redis.

The daemon calls ``stored`` / ``removed`` / ``cleared`` as blocks change tier (synchronous, no
I/O, O(blocks)); ``run()`` (one task per daemon) pushes the changes to Redis in pipelined
batches, sends heartbeats, refreshes every entry's TTL, and re-publishes the whole held set
after Redis comes back from an outage (or restarted empty). Separating the two means a slow or
dead Redis never blocks the daemon's request path.

Memory is bounded: the held set mirrors the node's own index (one dict entry per block, about
150 bytes), and the pending-change set holds at most ``max_pending`` keys; past that it is
dropped and replaced by one full re-publish (removals it held then expire with their TTL).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tierd.cluster.directory import Directory, NodeRecord
from tierd.types import TIERS, NamespacedKey, Tier

_log = logging.getLogger(__name__)

_BITS: dict[Tier, int] = {tier: 1 << i for i, tier in enumerate(TIERS)}


def best_tier(mask: int) -> Tier:
    """The fastest tier in a non-empty tier bit mask."""
    assert mask, "an empty tier mask has no best tier"
    return TIERS[(mask & -mask).bit_length() - 1]


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Identity of this node and the cadence of its Redis traffic."""

    node: NodeRecord
    heartbeat_s: float = 5.0        # must be well under the directory's node_ttl_s
    refresh_s: float = 200.0        # re-publish everything (TTL refresh); under block_ttl_s
    batch_size: int = 512           # blocks per publish/unpublish round trip
    max_pending: int = 65_536       # pending changes before falling back to a full re-publish

    def validate(self, block_ttl_s: float, node_ttl_s: float) -> None:
        """Raise ``ValueError`` naming the fix for an inconsistent value."""
        if not self.node.node_id:
            raise ValueError("cluster node_id must not be empty (use the host name)")
        if not 0 < self.heartbeat_s < node_ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be in (0, node_ttl_s "
                             f"= {node_ttl_s})")
        if not 0 < self.refresh_s < block_ttl_s:
            raise ValueError(f"refresh_s ({self.refresh_s}) must be in (0, block_ttl_s "
                             f"= {block_ttl_s})")
        if self.batch_size <= 0 or self.max_pending <= 0:
            raise ValueError("batch_size and max_pending must be positive")


@dataclass(slots=True)
class PublisherStats:
    pending_overflows: int = 0      # times the pending set was dropped for a full re-publish
    full_publishes: int = 0         # resyncs and TTL refreshes
    resyncs: int = 0                # re-publishes after an outage or an emptied Redis


class Publisher:
    """The held set of one node and the task that publishes it. One event loop only."""

    def __init__(self, directory: Directory, config: PublisherConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config.validate(directory.config.block_ttl_s, directory.config.node_ttl_s)
        self.directory = directory
        self.config = config
        self._clock = clock
        self._held: dict[NamespacedKey, int] = {}       # key -> bit mask of tiers holding it
        self._pending: dict[NamespacedKey, None] = {}   # ordered set of keys to (un)publish
        self._resync = True             # publish everything at the first step
        self._seen_outages = directory.outages
        self._next_heartbeat = 0.0
        self._next_refresh = clock() + config.refresh_s
        self._wake = asyncio.Event()
        self._closed = False
        self.stats = PublisherStats()

    # --- the daemon's side: synchronous, no I/O -------------------------------------------

    def stored(self, keys: Iterable[NamespacedKey], tier: Tier) -> None:
        """These blocks are now held in ``tier`` (besides any other tier they are in)."""
        bit = _BITS[tier]
        for key in keys:
            old = self._held.get(key, 0)
            self._held[key] = old | bit
            if old == 0 or best_tier(old | bit) != best_tier(old):
                self._mark(key)

    def removed(self, keys: Iterable[NamespacedKey], tier: Tier) -> None:
        """These blocks left ``tier``; a block left in no tier is withdrawn from the cluster."""
        bit = _BITS[tier]
        for key in keys:
            old = self._held.get(key, 0)
            if not old & bit:
                continue
            new = old & ~bit
            if new:
                self._held[key] = new
                if best_tier(new) != best_tier(old):
                    self._mark(key)
            else:
                del self._held[key]
                self._mark(key)

    def cleared(self, tier: Tier) -> None:
        """Every block of ``tier`` is gone (e.g. the SSD went unhealthy)."""
        self.removed([k for k, mask in self._held.items() if mask & _BITS[tier]], tier)

    def held(self) -> dict[NamespacedKey, Tier]:
        """A copy of what this node advertises: key -> best tier."""
        return {key: best_tier(mask) for key, mask in self._held.items()}

    @property
    def pending(self) -> int:
        """Changes not yet sent to Redis."""
        return len(self._pending)

    def _mark(self, key: NamespacedKey) -> None:
        if self._resync:
            return                      # the full re-publish will carry it
        self._pending[key] = None
        if len(self._pending) > self.config.max_pending:
            self._pending.clear()
            self._resync = True
            self.stats.pending_overflows += 1
            _log.warning("cluster publisher: more than %d pending changes; re-publishing all",
                         self.config.max_pending)
        self._wake.set()

    # --- the Redis side: one task --------------------------------------------------------

    async def step(self) -> bool:
        """One pass: heartbeat if due, a full publish if due (resync or TTL refresh), then the
        pending changes in batches. Returns True if everything due reached Redis; False if
        Redis failed (the work stays due; the directory is stale and backs off)."""
        now = self._clock()
        if self.directory.outages != self._seen_outages:
            self._seen_outages = self.directory.outages
            self._resync = True
        if now >= self._next_heartbeat or self._resync:   # a resync rewrites the record too
            existed = await self.directory.heartbeat(self.config.node)
            if existed is None:
                return False
            self._next_heartbeat = now + self.config.heartbeat_s
            if not existed and not self._resync:
                _log.warning("cluster publisher: Redis lost this node's state; re-publishing")
                self._resync = True
        if self._resync or now >= self._next_refresh:
            return await self._publish_all()
        return await self._flush_pending()

    async def _publish_all(self) -> bool:
        # A snapshot: changes made while the batches are in flight go to the pending set.
        resync, self._resync = self._resync, False
        self._pending.clear()
        entries = [(key, best_tier(mask)) for key, mask in self._held.items()]
        node_id = self.config.node.node_id
        for i in range(0, len(entries), self.config.batch_size):
            if not await self.directory.publish(node_id, entries[i:i + self.config.batch_size]):
                self._pending.clear()
                self._resync = True
                return False
        self._next_refresh = self._clock() + self.config.refresh_s
        self.stats.resyncs += resync and self.stats.full_publishes > 0   # not the first one
        self.stats.full_publishes += 1
        return True

    async def _flush_pending(self) -> bool:
        # A batch leaves the pending set *before* its round trip: a key changed again while
        # the batch is in flight is marked anew and goes out in a later batch (popping it
        # afterwards would lose that change until the next TTL refresh).
        node_id = self.config.node.node_id
        while self._pending:
            batch = list(itertools.islice(self._pending, self.config.batch_size))
            for key in batch:
                del self._pending[key]
            held = [(k, best_tier(self._held[k])) for k in batch if k in self._held]
            gone = [k for k in batch if k not in self._held]
            if not (await self.directory.publish(node_id, held)
                    and await self.directory.unpublish(node_id, gone)):
                self._pending.clear()       # the batch is lost: re-publish everything
                self._resync = True
                return False
        return True

    async def run(self) -> None:
        """Publish until ``close()``: wakes on new changes, on the heartbeat, or after a
        failure once the directory's backoff allows a retry. Never raises for Redis."""
        while not self._closed:
            ok = await self.step()
            wait = self.config.heartbeat_s if ok else self.directory.config.backoff_min_s
            if ok and self._pending:
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, min(
                    wait, self._next_heartbeat - self._clock())))
            except asyncio.TimeoutError:
                pass

    async def close(self, *, withdraw: bool = True) -> None:
        """Stop ``run`` and, with ``withdraw``, remove this node's record so locate stops
        returning it at once (its block entries expire with their TTL)."""
        self._closed = True
        self._wake.set()
        if withdraw:
            await self.directory.remove_node(self.config.node.node_id)

    def check_integrity(self) -> None:
        """Every held key has at least one tier; pending is within its bound."""
        assert all(0 < mask < (1 << len(TIERS)) for mask in self._held.values()), (
            "a held key with an empty or unknown tier mask")
        assert len(self._pending) <= self.config.max_pending, "pending set over its bound"
        assert not (self._resync and self._pending), "pending changes kept during a resync"
