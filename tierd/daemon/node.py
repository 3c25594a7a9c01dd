"""The node store: one daemon's block index over its DRAM arena and SSD directory (no gRPC).

Every RPC is one method here; the store owns metadata only (engines copy KV bytes themselves).
Methods run on the daemon's event loop: sync ones never block, async ones await SSD I/O only.
Keys are ``make_key(namespace_for(tenant, layout), hash)``: models, TP ranks and tenants never
share an entry. Which copy moves and how it is counted: ``tier_index.TierIndex``.
Policy, in docs/daemon.md: commits publish reserved slots (``writes``); ``maintain`` demotes
above the high watermark; reads and reservations evict synchronously, never waiting on a write;
lookups, probes, acquires and releases pin and count in ``reads`` (SSD hits are promoted:
``promotion``); a write-behind copies commits to SSD (``writebehind``);
quotas shed over-quota tenants first (``quota_eviction``, ``quota_gate``). Pinned blocks never
move. Cross-table checks: ``node_integrity``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tierd.daemon.chunks import Steps, run_now
from tierd.daemon.engines import EngineTable
from tierd.daemon.errors import ResourceExhausted, UnknownEngine
from tierd.daemon.hbm import HbmIndex
from tierd.daemon.insight import Insight
from tierd.daemon.leases import EMPTY_LEASE, LeaseTable, ReadLease, WriteLease
from tierd.daemon.listeners import TierListener, TierListeners
from tierd.daemon.metrics import NodeMetrics, NodeStats, TierStats
from tierd.daemon.models import ModelTable, NamespaceModel
from tierd.daemon.node_integrity import check_slots_and_pins
from tierd.daemon.node_types import EngineInfo, Lease, LookupResult, NodeConfig, Reservation
from tierd.daemon.quota_eviction import QuotaEviction
from tierd.daemon.quota_gate import QuotaGate
from tierd.daemon.quotas import QuotaCollector, QuotaLedger
from tierd.daemon.reads import Reads
from tierd.daemon.slots import SlabAllocator
from tierd.daemon.tier_index import TierIndex
from tierd.daemon.writebehind import Flushed, WriteBehind
from tierd.daemon.writes import Reservations
from tierd.events import EventLog, KVEvent
from tierd.types import BlockHash, Namespace, NamespacedKey, make_keys
from tierd.wire.layout import Layout, namespace_for
from tierd.wire.replies import ModelUsage, TenantUsage

if TYPE_CHECKING:
    from tierd.daemon.ssd import SsdStore
    from tierd.wire.arena import ShmArena

__all__ = ["EMPTY_LEASE", "EngineInfo", "Flushed", "Lease", "LookupResult", "NodeConfig",
           "NodeStore", "Reservation"]

log = logging.getLogger(__name__)


class NodeStore:
    """The node's block index, leases and tier policy. Not thread-safe: one event loop."""

    def __init__(self, arena: ShmArena, allocator: SlabAllocator, ssd: SsdStore | None,
                 config: NodeConfig, *, clock: Callable[[], float] = time.monotonic,
                 listener: TierListener | None = None) -> None:
        config.validate()
        self._arena, self._ssd, self._config, self._clock = arena, ssd, config, clock
        self.metrics, self._events = NodeMetrics(), EventLog(config.event_log_events)
        if ssd is not None:
            self.metrics.watch_ssd(ssd)
        self.models = ModelTable(config.max_models)
        self.quotas = QuotaLedger(config.tenant_quotas, arena.size,
                                  ssd.full_bytes if ssd is not None else 0,
                                  config.blank_fraction, self._model_tenant)
        self.metrics.registry.register(QuotaCollector(self.quotas))
        outside: list[TierListener] = [self.models, self.quotas, *filter(None, [listener])]
        self._tiers = TierIndex(arena, allocator, ssd, self.metrics, self._events,
                            config.ghost_entries, clock, TierListeners(outside),
                            max_classes=config.max_size_classes)
        if config.tenant_quotas:
            self._tiers.eviction = QuotaEviction(self.quotas)
        self._gate = QuotaGate(self.quotas, self._tiers.dram, config.lease_seconds,
                               config.blank_fraction)
        self._counts = self._tiers.counts
        self._write_behind = WriteBehind(self._tiers, delay=config.write_behind_seconds,
                               min_hits=config.ssd_min_hits, batch_bytes=config.write_batch_bytes,
                               clock=clock)
        if ssd is not None and config.write_behind_seconds > 0:
            self._tiers.listener = TierListeners([self._write_behind, *outside])
        self._engines = EngineTable(config.engines)
        self._engine_gone: Callable[[str], None] = lambda engine_id: None
        self._leases = LeaseTable(config.lease_seconds, per_engine=config.max_leases_per_engine,
                                  total=config.max_leases, blocks=config.max_lease_keys)
        self._reservations = Reservations(self._tiers, self._leases, config.lease_seconds,
                                          self._expire, clock,
                                          int(config.blank_fraction * arena.size),
                                          self._gate.write_ended,
                                          self._gate.hold)
        self._writing = self._reservations.writing  # reserved key -> its write lease id
        self._hbm = HbmIndex(config.hbm_max_blocks_per_engine, TierListeners(outside))
        self._reads = Reads(self._tiers, arena, ssd, self._leases, self._gate, self._hbm, config,
                            lambda: self._clock(), writing=self._writing.__contains__,
                            expire=self._expire, registered=self._engines.__contains__)
        self._promoting = self._reads.promoter.active
        self.insight = Insight.over(self._tiers, self._hbm, self._engines, self.models, clock,
                                    config)
        self.set_insight_hooks(config.insight_hooks)
        self._maintaining = asyncio.Lock()
        self.metrics.ssd_healthy.set(0.0)

    @property
    def insight_hooks(self) -> bool:
        """Whether the insight hooks are called (``set_insight_hooks``)."""
        return self._reads.looked_up is not None

    def set_insight_hooks(self, on: bool) -> None:
        """Call the insight hooks (``Insight.looked_up`` on each counted lookup, ``served`` on
        each acquire) from now on, or none at all (``NodeConfig.insight_hooks`` at start)."""
        self._reads.looked_up = self.insight.looked_up if on else None
        self._tiers.served = self.insight.served if on else None

    # -- engines -------------------------------------------------------------------------------

    def open(self) -> None:
        """Rebuild the SSD index from the records on disk, oldest first, dropping the oldest if
        the bound shrank below them, and read ``models.json`` if the SSD lock is ours (blocking;
        call once at start-up)."""
        if self._ssd is None:
            return
        entries = self._ssd.open()
        self.models.open(self._ssd.state_directory(), str(self._ssd.directory))
        self._tiers.load(entries, self._clock())
        self.metrics.ssd_healthy.set(1.0 if self._tiers.ssd_up else 0.0)

    def register_engine(self, tenant: str, layout: Layout, engine_name: str = "") -> EngineInfo:
        """Give an engine an id, its namespace and its slot geometry. ValueError for a bad
        layout or tenant, a block under ``min_block_bytes`` or a name over ``max_name_bytes``;
        ResourceExhausted if one block cannot fit a slab, the tenant has
        ``max_engines_per_tenant`` engines or its block size would pass ``max_size_classes``."""
        namespace = namespace_for(tenant, layout)
        if layout.block_bytes < self._config.min_block_bytes:
            raise ValueError(f"a block of {layout.block_bytes} bytes is under min_block_bytes "
                             f"({self._config.min_block_bytes}): use more tokens per block, or "
                             "lower TIERD_MIN_BLOCK_BYTES")
        try:
            geometry = self._tiers.alloc.geometry(layout.block_bytes)
        except ValueError as e:
            raise ResourceExhausted(f"a block of {layout.block_bytes} bytes cannot fit: {e}") from e
        self._tiers.classes.check_room(geometry.slot_bytes)
        info = EngineInfo(self._engines.new_id(tenant, engine_name), tenant, namespace, layout,
                          geometry, engine_name)
        self._engines.add(info, self._clock())
        self._tiers.classes.join(geometry.slot_bytes)
        self.models.registered(namespace, NamespaceModel(tenant, layout.model_id,
                                                         layout.block_bytes))
        self.quotas.register(namespace, tenant, layout.block_bytes)
        return info

    @property
    def has_ssd(self) -> bool:  # an SSD tier, healthy or not
        return self._ssd is not None

    def engine(self, engine_id: str, tenant: str) -> EngineInfo:
        """The registered engine, heard from now. NotFound if unknown, lapsed or ``tenant``'s
        not (the same answer, so ids leak nothing across tenants)."""
        info = self._engine(engine_id)
        if info.tenant != tenant:
            raise UnknownEngine(engine_id)
        return info

    def engines_of(self, tenant: str) -> list[EngineInfo]:
        """The registered engines of ``tenant``."""
        return self._engines.of_tenant(tenant)

    def watch_engines(self, gone: Callable[[str], None]) -> None:
        """``gone(engine_id)`` is called for each engine ``maintain`` unregisters because it
        lapsed (not for ``unregister_engine``: its caller knows)."""
        self._engine_gone = gone

    def unregister_engine(self, engine_id: str) -> None:
        """Forget an engine: its leases end (pins dropped, reserved slots freed) and its HBM
        report is discarded. Its committed blocks stay (its size class too, until they leave).
        NotFound if unknown."""
        info = self._engine(engine_id)
        for lease in self._leases.of_engine(engine_id):
            self._end(self._leases.finish(lease.lease_id, "unregistered"))
        self._hbm.drop(engine_id)
        self.models.unregistered(self._engines.remove(engine_id).namespace)
        self._tiers.classes.leave(info.geometry.slot_bytes)
        self.quotas.unregister(info.namespace)

    # -- reads ---------------------------------------------------------------------------------

    def held_keys(self) -> list[NamespacedKey]:  # every DRAM copy and every served SSD copy
        return self._tiers.held_keys()

    def lookup(self, engine_id: str, hashes: Sequence[BlockHash]) -> LookupResult:
        """The longest consecutive prefix of ``hashes`` held on this node, with the fastest tier
        of each block. Pins nothing, changes no LRU order; counts queried and hit tokens."""
        info = self._engine(engine_id)
        return self._reads.lookup(info, hashes, self._keys(info, hashes))

    def probe(self, engine_id: str, hashes: Sequence[BlockHash], *, hold: bool = False
              ) -> Lease:
        """``lookup`` and a pin of the leading DRAM run in one: counts the chain as ``lookup``
        does, pins the blocks DRAM holds at its head (reading nothing), and lists in the lease's
        ``held_after`` the tiers of the held blocks after them. The SSD blocks right after the
        pinned run start moving into DRAM, unpinned, for the acquire that usually follows.
        ``hold`` as ``acquire``'s: the run is not counted as served. ResourceExhausted as
        ``acquire``."""
        info = self._engine(engine_id)
        return self._reads.probe(info, hashes, self._keys(info, hashes), hold=hold)

    async def acquire(self, engine_id: str, hashes: Sequence[BlockHash], *,
                      hold: bool = False) -> Lease:
        """Pin the longest consecutive prefix held in DRAM or SSD and return its slots.

        SSD hits are read into fresh DRAM slots, all at once (a block another acquire or a
        probe is promoting is awaited, not read twice); each lands as a DRAM block even if the
        prefix ends before it. A failed SSD read ends the prefix there (a miss). Every returned
        block stays pinned until ``release`` or the deadline; each counts a hit and its reuse
        gap. Awaits SSD reads only; a cancelled caller's lease still completes and simply
        expires. ResourceExhausted (pinning nothing) if the lease would pass a cap of the lease
        table. ``hold``: the blocks are held for a later acquire that loads them: not counted as
        prefill served (``Savings``).
        """
        info = self._engine(engine_id)
        return await self._reads.acquire(info, self._keys(info, hashes), hold=hold)

    def release(self, lease_id: str, *, engine_id: str | None = None,
                corrupt_from: int | None = None, served: int | None = None) -> bool:
        """Unpin a read lease's blocks. NotFound if unknown or already ended (expired: what
        was copied may have been overwritten, so verify checksums); FailedPrecondition for a
        reservation.
        The empty lease of an acquire that pinned nothing (``EMPTY_LEASE``) is a no-op.
        ``engine_id`` (the gRPC edge always passes it): a lease of another engine is NotFound.

        ``corrupt_from``: index (in the acquired prefix) of the first block whose checksum did
        not verify on the engine's side. The node re-checks that block's bytes itself and, if
        they are indeed corrupt, drops it (a miss for every engine from now on, instead of a
        recompute each time): at once, or once the other leases pinning it end and no lookup
        or lease sees it meanwhile (``TierIndex.condemn``); a false report changes nothing.
        Returns whether the block was corrupt.

        ``served``: for a held lease (``acquire`` or ``probe`` with ``hold``), how many of its
        blocks the engine loaded under it: counted as prefill served then (``Savings``).
        ValueError past the lease's blocks or for a lease not held (its blocks were counted)."""
        return self._reads.release(lease_id, engine_id, corrupt_from, served)

    # -- writes --------------------------------------------------------------------------------

    def reserve(self, engine_id: str, hashes: Sequence[BlockHash], *,
                filtered_query_tokens: int = 0) -> Reservation:
        """Allocate a slot for each hash not yet on the node (DRAM or SSD), under a write lease.
        ``filtered_query_tokens`` (lookups the engine answered from the presence filter) are
        counted as queried tokens, none hit.

        Reserved slots are invisible to lookups until ``commit``. A hash already stored gets
        ``already_stored=True`` and no slot; one that another lease is writing, a repeat within
        the request, or one past the point where no room could be made gets no slot either.
        With no free slot, LRU unpinned DRAM blocks are evicted synchronously. Never blocks.
        """
        return run_now(self.reserve_steps(engine_id, hashes,
                                          filtered_query_tokens=filtered_query_tokens))

    def reserve_steps(self, engine_id: str, hashes: Sequence[BlockHash], *,
                      filtered_query_tokens: int = 0) -> Steps[Reservation]:
        """``reserve`` in steps of ``chunks.STEP_BLOCKS`` hashes (NotFound if the engine is
        unregistered between two)."""
        info = self._engine(engine_id)
        self.models.queried(info.namespace, filtered_query_tokens, 0)
        keys = self._keys(info, hashes)
        self._expire(self._clock())
        limit = self._gate.hold_limit(info, len(keys), "reserved")
        res = yield from self._reservations.reserve_steps(info, hashes, keys,
                                                          filtered_query_tokens, limit)
        return self._gate.reserved(info, res, "reserved", limit, held=True)

    def reserve_blank(self, engine_id: str, count: int) -> Reservation:
        """Allocate ``count`` slots not yet named, under a write lease (evicting as ``reserve``
        does; fewer, None, where no room could be made or where every engine's blank slots
        together would pass ``blank_fraction`` of the arena): an engine holds them ahead of the
        blocks it will store and names each at ``commit``. ResourceExhausted above
        ``max_blocks_per_request``; ValueError for a negative count."""
        return run_now(self.reserve_blank_steps(engine_id, count))

    def reserve_blank_steps(self, engine_id: str, count: int) -> Steps[Reservation]:
        """``reserve_blank`` in steps of ``chunks.STEP_BLOCKS`` slots (NotFound if the engine is
        unregistered between two)."""
        info = self._engine(engine_id)
        if count < 0:
            raise ValueError(f"blank_slots must be >= 0, got {count}")
        if count > self._config.max_blocks_per_request:
            raise ResourceExhausted(f"{count} blank slots in one request; at most "
                                    f"{self._config.max_blocks_per_request}: ask for fewer")
        self._expire(self._clock())
        limit = self._gate.hold_limit(info, count, "blank")
        res = yield from self._reservations.reserve_blank_steps(info, count, limit)
        return self._gate.reserved(info, res, "blank", limit, held=True)

    def commit(self, lease_id: str, checksums: Sequence[int | None], *,
               engine_id: str | None = None, names: Sequence[BlockHash] = ()) -> int:
        """Publish a reservation: each slot with a checksum becomes a DRAM block (one
        ``BlockStored(tier="dram")`` per consecutive run); a None checksum (the engine's copy
        failed) frees its slot. ``names``: for blank slots (``reserve_blank``) the hash of each,
        in slot order (slots past them must not be written); a name the node holds already, or
        that another reservation is writing, frees its slot. Returns the blocks stored.
        NotFound if unknown (or, with ``engine_id``, another engine's); FailedPrecondition after
        expiry, commit or abort; ValueError for bad checksums or names."""
        return run_now(self.commit_steps(lease_id, checksums, engine_id=engine_id, names=names))

    def commit_steps(self, lease_id: str, checksums: Sequence[int | None], *,
                     engine_id: str | None = None, names: Sequence[BlockHash] = ()) -> Steps[int]:
        """``commit`` in steps of ``chunks.STEP_BLOCKS`` slots (another Commit or Abort of the
        lease meanwhile is FailedPrecondition)."""
        return self._reservations.commit_steps(lease_id, checksums, engine_id, names)

    def written_spans(self, lease_id: str, written: Sequence[bool], *,
                      engine_id: str | None = None, names: Sequence[BlockHash] = ()
                      ) -> list[tuple[int, int] | None]:
        """For an engine that leaves checksums to the daemon: ``written[i]`` says the i-th
        reserved slot was written; returns where each written slot lies in the arena (address,
        length; None for the others) for ``checksums_at``, whose results go to ``commit`` (with
        the same ``names``). Same errors as ``commit`` (checked now and again at the commit: a
        lease may end meanwhile)."""
        return self._reservations.written_spans(lease_id, written, engine_id, names)

    def abort(self, lease_id: str, *, engine_id: str | None = None) -> None:
        """Free a reservation's slots. Idempotent after abort or expiry (while the lease is
        remembered: ``lease_seconds`` past its deadline); NotFound if unknown
        (or, with ``engine_id``, another engine's); FailedPrecondition after commit."""
        self._reservations.abort(lease_id, engine_id)

    def report_hbm(self, engine_id: str, stored: Sequence[BlockHash],
                   removed: Sequence[BlockHash], cleared: bool = False) -> None:
        """Apply an engine's batched GPU-pool events: ``cleared`` first, then ``stored``, then
        ``removed``. At most ``hbm_max_blocks_per_engine`` hashes are kept (oldest dropped)."""
        info = self._engine(engine_id)
        self._keys(info, [*stored, *removed], limit=False)
        self._hbm.report(engine_id, stored, removed, cleared, info.namespace)

    # -- upkeep --------------------------------------------------------------------------------

    async def maintain(self) -> None:
        """One flusher pass: expire leases; above the high watermark, demote LRU unpinned DRAM
        blocks to SSD until the low watermark (see the module doc); refresh the gauges. Awaits
        SSD writes (concurrently); one pass at a time. With the SSD unhealthy, one block is
        tried per pass (a write that succeeds brings the tier back)."""
        async with self._maintaining:
            now = self._clock()
            self._expire(now)
            for engine_id in self._engines.lapsed(now):
                log.info("engine %s silent for %.0f s: unregistered", engine_id,
                         self._config.engines.idle_seconds)
                self.unregister_engine(engine_id)
                self._engine_gone(engine_id)
            self._tiers.check_ssd()
            high = self._config.dram_high_watermark * self._arena.size
            if self._ssd is not None and self._tiers.dram_used_bytes() > high:
                low = self._config.dram_low_watermark * self._arena.size
                await self._tiers.demote(low, self._config.ssd_min_hits, not self._tiers.ssd_up,
                                         now)
            await self.insight.refresh(self.stats())

    def take_events(self) -> list[KVEvent]:
        """Every tier event since the last call, oldest first (the last
        ``event_log_events`` of them; none when that is 0, as in `tierd serve`, whose
        listeners are told of every change as it happens)."""
        return self._events.take_events()

    async def write_behind(self) -> int:
        """One write-behind pass (``WriteBehind.run``): the blocks committed since the last
        one that still have no SSD copy are written, oldest first, in batches that wait for
        the SSD promotions in flight; demotion can run between batches. Returns the blocks
        written. The daemon calls it every half ``write_behind_seconds``."""
        if self._ssd is None:
            return 0
        written = await self._write_behind.run(self._maintaining,
                                     lambda: [p.done for p in self._promoting.values()])
        self.metrics.persisted.labels("write_behind").inc(written)
        self.metrics.write_behind_lag.set(self._write_behind.lag_seconds(self._clock()))
        return written

    async def close(self) -> Flushed:
        """Wait for in-flight promotions, write the DRAM blocks that have no SSD copy to SSD
        (most recently used first, starting no batch after ``stop_flush_seconds``; the SSD's
        admission and bound apply), then close the SSD store. Returns what the flush did.
        Call once, with no maintain or write-behind pass running."""
        for promotion in list(self._promoting.values()):
            await promotion.done
        self.insight.tally()  # the queued lookup counts reach models.json
        flushed = Flushed(0, 0, 0.0)
        if self._ssd is not None:
            async with self._maintaining:
                flushed = await self._write_behind.flush(
                    self._clock() + self._config.stop_flush_seconds)
            self.metrics.persisted.labels("stop").inc(flushed.written)
            await asyncio.get_running_loop().run_in_executor(None, self.models.close)
            self._ssd.close()
        return flushed

    # -- observability -------------------------------------------------------------------------

    def stats(self) -> NodeStats:
        """A snapshot of every tier (see ``TierStats``) and refresh the Prometheus gauges.
        Demotions are reported on "dram" (where blocks left), promotions on "ssd"."""
        self._expire(self._clock())
        n = self._counts
        tiers = self._tiers.stats(reserved=len(self._writing) + len(self._promoting))
        hbm = self._hbm.counts()
        tiers["hbm"] = TierStats(sum(hbm.values()), 0, 0, 0, 0, n.hits["hbm"], n.queries, 0, 0, 0)
        self.metrics.set_gauges(tiers, hbm, self._tiers.ssd_up)
        return NodeStats(
            tiers=tiers, hbm_blocks=hbm, checksum_failures=n.checksum_failures.total(),
            lease_expiries=n.lease_expiries.total(), ssd_healthy=self._tiers.ssd_up,
            hit_ratio=sum(n.hits.values()) / n.queries if n.queries else 0.0,
            reuse_gap_p90=self.metrics.reuse_gap.quantile(0.9),
            idle_before_evict_p50=self.metrics.idle_before_evict.quantile(0.5))

    def tenants(self, tenant: str | None = None) -> list[TenantUsage]:
        """What ``tenant`` (None: all) uses and holds against its quota (overdue leases end)."""
        self._expire(self._clock())
        return self.quotas.usage(None if tenant is None else [tenant])

    def models_of(self, tenant: str) -> list[ModelUsage]:
        """Occupancy and hits per model of ``tenant`` (``ModelTable.usage_of``), the queued
        lookups counted first (``Insight.tally``)."""
        self.insight.tally()
        return self.models.usage_of(tenant, [e.namespace for e in self.engines_of(tenant)])

    def check_integrity(self) -> None:
        """Assert every index, pin, lease and slot agrees with the allocator and the SSD store.
        Call between operations (tests do, after every step)."""
        self._tiers.check_integrity()
        dram = [k for k, _ in self._tiers.dram.oldest_first()]
        ssd = [k for k, _ in self._tiers.disk.oldest_first()] if self._tiers.ssd_told_up else []
        self.models.check_integrity({"dram": dram, "ssd": ssd, "hbm": self._hbm.told_keys()})
        owned = check_slots_and_pins(self._tiers, self._leases.live(), self._writing,
                                     self._reads.inflight_pins, self._reservations.blank_bytes,
                                     self._promoting.values())
        assert {size for size, _ in owned} <= set(self._tiers.classes), "a slot of no class"
        assert all(e in self._engines for e in self._hbm.counts()), "HBM of unknown engine"
        self._leases.check_integrity()
        self._tiers.classes.check_integrity(Counter(
            e.geometry.slot_bytes for e in self._engines.infos()))
        self._gate.check_integrity(self._leases.live(), {"dram": dram, "ssd": ssd})
        self._hbm.check_integrity()
        self._engines.check_integrity()
        self._write_behind.check_integrity()
        self.insight.check_integrity()

    # -- helpers -------------------------------------------------------------------------------

    def _engine(self, engine_id: str) -> EngineInfo:
        return self._engines.get(engine_id, self._clock())

    def _keys(self, info: EngineInfo, hashes: Sequence[BlockHash],
              limit: bool = True) -> list[NamespacedKey]:
        """Validate a request's hashes and scope them to the engine's namespace."""
        if limit and len(hashes) > self._config.max_blocks_per_request:
            raise ResourceExhausted(f"{len(hashes)} blocks in one request; at most "
                                    f"{self._config.max_blocks_per_request}: split the request")
        return make_keys(info.namespace, hashes)

    def _expire(self, now: float) -> None:
        """End every lease past its deadline, freeing what it held."""
        for lease in self._leases.pop_expired(now):
            kind = "read" if isinstance(lease, ReadLease) else "write"
            self._counts.lease_expiries[kind] += 1
            self._end(lease)

    def _end(self, lease: ReadLease | WriteLease) -> None:
        """Free what an already finished lease held: unpin its blocks or free its slots."""
        if isinstance(lease, ReadLease):
            self._reads.end(lease)
            return
        self._reservations.free(lease)

    def _model_tenant(self, namespace: Namespace) -> tuple[str, int] | None:
        """The (tenant, block bytes) the model table remembers of a namespace, or None."""
        model = self.models.model_of(namespace)
        return (model.tenant, model.block_bytes) if model is not None else None
