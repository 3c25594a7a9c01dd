"""Reads: what a Lookup, a Probe, an Acquire and a Release pin, count and start.

A lookup counts a chain's queried and hit tokens and pins nothing; a probe also pins the
chain's leading DRAM run and starts promoting the SSD blocks right after it, unpinned, so the
acquire that usually follows finds them read or in flight; an acquire pins the whole held
prefix, reading SSD blocks into DRAM first (``promotion``). Every pin is under a read lease.
The node store validates engines and keys and calls in here; this module owns the in-flight
pins of acquires waiting for their promotions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tierd.daemon.errors import FailedPrecondition, NotFound, ResourceExhausted
from tierd.daemon.leases import EMPTY_LEASE, LeaseTable, ReadLease, new_lease_id
from tierd.daemon.lru import DramBlock
from tierd.daemon.node_types import EngineInfo, Lease, LookupResult, NodeConfig
from tierd.daemon.promotion import Promoter, Promotion
from tierd.types import BlockHash, Namespace, NamespacedKey, Tier
from tierd.wire.clip import clip

if TYPE_CHECKING:
    from tierd.daemon.hbm import HbmIndex
    from tierd.daemon.quota_gate import QuotaGate
    from tierd.daemon.ssd import SsdStore
    from tierd.daemon.tier_index import TierIndex
    from tierd.wire.arena import ShmArena

LookedUp = Callable[[Namespace, Sequence[NamespacedKey], int, int], None]
"""The insight hook told of each counted lookup: (namespace, keys, tokens per block, hit)."""


class Reads:
    """The read path of one node store. Not thread-safe: one event loop.

    ``expire(now)`` ends every overdue lease (the node store's, as it also ends reservations);
    ``registered(engine_id)`` says whether an engine is still registered (an acquire that
    outlives its engine pins nothing)."""

    def __init__(self, tiers: TierIndex, arena: ShmArena, ssd: SsdStore | None,
                 leases: LeaseTable, gate: QuotaGate, hbm: HbmIndex, config: NodeConfig,
                 clock: Callable[[], float], *, writing: Callable[[NamespacedKey], bool],
                 expire: Callable[[float], None], registered: Callable[[str], bool]) -> None:
        self._tiers, self._leases, self._gate = tiers, leases, gate
        self._hbm, self._config, self._clock = hbm, config, clock
        self._expire, self._registered = expire, registered
        self._counts = tiers.counts
        self.inflight_pins: Counter[NamespacedKey] = Counter()  # pins of acquires in progress
        self.promoter = Promoter(tiers, arena, ssd, writing, self._landed_pinned, clock)
        self.looked_up: LookedUp | None = None

    def lookup(self, info: EngineInfo, hashes: Sequence[BlockHash],
               keys: list[NamespacedKey]) -> LookupResult:
        """``NodeStore.lookup``: the held prefix's tiers, counted; pins nothing."""
        return LookupResult(self._query(info, hashes, keys, len(self._tiers.dram_run(keys))))

    def _query(self, info: EngineInfo, hashes: Sequence[BlockHash],
               keys: Sequence[NamespacedKey], dram_run: int) -> list[Tier]:
        """The tiers of the held prefix (``lookup``'s answer), counted as queried and hit
        tokens. ``dram_run``: how many leading ``keys`` DRAM holds."""
        hbm = self._hbm.held(info.engine_id)
        ssd_up = self._tiers.ssd_up
        in_dram = self._tiers.dram.get
        tiers: list[Tier] = (["hbm" if h in hbm else "dram" for h in hashes[:dram_run]] if hbm
                             else ["dram"] * dram_run)
        for block_hash, key in zip(hashes[dram_run:], keys[dram_run:]):
            if block_hash in hbm:
                tiers.append("hbm")
            elif (block := in_dram(key)) is not None:
                if block.corrupt:
                    break
                tiers.append("dram")
            elif ssd_up and key in self._tiers.disk:
                tiers.append("ssd")
            else:
                break
        tokens = info.layout.block_size
        self._counts.queries += len(hashes) * tokens
        for tier in set(tiers):
            count = tiers.count(tier)
            self._counts.hits[tier] += count * tokens
        if self.looked_up is not None:  # per-model counts, what-if sample: queued (insight)
            self.looked_up(info.namespace, keys, tokens, len(tiers))
        return tiers

    def probe(self, info: EngineInfo, hashes: Sequence[BlockHash], keys: list[NamespacedKey],
              *, hold: bool) -> Lease:
        """``NodeStore.probe``: count, pin the leading DRAM run, list the tiers held after it,
        and start promoting the SSD blocks that directly follow it (``_prefetch``)."""
        blocks = self._tiers.dram_run(keys)
        tiers = self._query(info, hashes, keys, len(blocks))
        pinnable, blocks, now = self._pinnable(info, keys, blocks)
        lease = self._lease(info, pinnable[:len(blocks)], blocks, now, pin=True, served=not hold)
        after = tiers[len(blocks):]
        self._prefetch(info, keys[len(blocks):len(blocks) + len(after)], now)
        return dataclasses.replace(lease, held_after=after)

    def _prefetch(self, info: EngineInfo, keys: list[NamespacedKey], now: float) -> None:
        """Start reading the SSD blocks at the head of ``keys`` into DRAM (up to the first key
        DRAM holds or that is already in flight), pinned by nobody: each lands as an unpinned
        DRAM block that an acquire then pins without waiting for the disk. As many as free or
        evictable slots allow (never evicting the chain's own DRAM blocks); nothing while the
        SSD is unhealthy."""
        if not keys or not self._tiers.ssd_up:
            return
        run: list[NamespacedKey] = []
        for key in keys:
            if key in self.promoter.active or self._tiers.dram.get(key) is not None \
                    or key not in self._tiers.disk:
                break
            run.append(key)
        if not run:
            return
        # The chain's later DRAM blocks are pinned while slots are found, so no eviction for
        # this read takes a block the same acquire would pin.
        later = [k for k in keys[len(run):] if self._tiers.dram.get(k) is not None]
        for key in later:
            self._tiers.pin(key)
        try:
            slots = self._tiers.allocate_many(info.geometry.slot_bytes, len(run), now,
                                              info.namespace)
        finally:
            self._tiers.unpin(later)
        reads: list[tuple[Promotion, memoryview]] = []
        for n, slot in enumerate(slots):
            if self.promoter.stage(run[n], info.geometry, slot, reads) is None:
                self._tiers.free_slots(info.geometry.slot_bytes, slots[n:])
                break
        self.promoter.start(reads)

    def _pinnable(self, info: EngineInfo, keys: list[NamespacedKey], blocks: list[DramBlock]
                  ) -> tuple[list[NamespacedKey], list[DramBlock], float]:
        """``keys`` and the DRAM run ``blocks`` leading them, cut to what the tenant may still
        pin (expired leases ended first), and the time a lease issued now starts at."""
        now = self._clock()
        self._expire(now)
        active = self.promoter.active
        keys, blocks = self._gate.pin_limit(info, keys, blocks, lambda: keys[0] in active
                                            or (self._tiers.ssd_up and keys[0] in self._tiers.disk))
        return keys, blocks, now

    async def acquire(self, info: EngineInfo, keys: list[NamespacedKey], *,
                      hold: bool) -> Lease:
        """``NodeStore.acquire``: pin the held prefix, SSD blocks read into DRAM first."""
        keys, blocks, now = self._pinnable(info, keys, self._tiers.dram_run(keys))
        hit = len(blocks)
        promoting = self.promoter.active
        if hit == len(keys) or not (keys[hit] in promoting or (
                self._tiers.ssd_up and keys[hit] in self._tiers.disk)):
            return self._lease(info, keys[:hit], blocks, now, pin=True,  # nothing to read
                               served=not hold)
        self._leases.check_room(info.engine_id, hit + 1)  # before any read (again at the end)
        # The plan: the prefix held in DRAM, in flight from SSD, or on SSD. Promotions may
        # evict unpinned DRAM blocks, so the plan's DRAM hits take in-flight pins first; then
        # the new promotions' slots are allocated in one batch (one eviction pass).
        plan: list[tuple[NamespacedKey, Promotion | None]] = []  # None: DRAM, or not staged
        new: list[int] = []  # plan indices still to stage
        for key in keys:
            if (held := self._tiers.dram.get(key)) is not None:
                if held.corrupt:
                    break
                self._pin_inflight(key)
            elif (promotion := promoting.get(key)) is not None:
                promotion.waiters += 1
                plan.append((key, promotion))
                continue
            elif self._tiers.ssd_up and key in self._tiers.disk:
                new.append(len(plan))
            else:
                break
            plan.append((key, None))
        slots = self._tiers.allocate_many(info.geometry.slot_bytes, len(new), now, info.namespace)
        reads: list[tuple[Promotion, memoryview]] = []  # started here: one batched SSD read
        for n, i in enumerate(new):
            promotion = (self.promoter.stage(plan[i][0], info.geometry, slots[n], reads)
                         if n < len(slots) else None)
            if promotion is None:  # no room: the plan ends before this key
                self._tiers.free_slots(info.geometry.slot_bytes, slots[n:])
                unstaged = set(new[n:])
                for j, (key, staged) in enumerate(plan[i:], i):
                    if staged is not None:
                        staged.waiters -= 1
                    elif j not in unstaged:  # a DRAM hit past the end
                        self._unpin_inflight(key)
                del plan[i:]
                break
            promotion.waiters += 1
            plan[i] = (plan[i][0], promotion)
        self.promoter.start(reads)
        return await asyncio.shield(asyncio.ensure_future(self._promoted(info, plan, now, hold)))

    async def _promoted(self, info: EngineInfo, plan: list[tuple[NamespacedKey,
                        Promotion | None]], start: float, hold: bool) -> Lease:
        """With the plan's promotions done: the prefix that made it, under a new lease. The
        plan's DRAM hits and landed promotions carry in-flight pins: kept for the prefix,
        dropped past its end."""
        for _, promotion in plan:
            if promotion is not None:
                await promotion.done
        keys: list[NamespacedKey] = []
        blocks: list[DramBlock] = []
        ended = not self._registered(info.engine_id)
        for key, promotion in plan:
            inflight = promotion is None or promotion.landed
            if inflight:
                self._drop_inflight(key)
            block = self._tiers.dram.get(key)
            if ended or block is None or block.corrupt or (
                    promotion is not None and not promotion.done.result()):
                ended = True
                if inflight:
                    self._tiers.unpin((key,))
                continue
            if not inflight:
                self._tiers.pin(key)
            keys.append(key)
            blocks.append(block)
        if not self._registered(info.engine_id):
            self._tiers.unpin(keys)
            raise NotFound(f"engine {info.engine_id} was unregistered during acquire")
        return self._lease(info, keys, blocks, start, pin=False, served=not hold)

    def _lease(self, info: EngineInfo, keys: list[NamespacedKey], blocks: list[DramBlock],
               start: float, *, pin: bool, served: bool) -> Lease:
        """Put a prefix (``blocks[i]`` under ``keys[i]``; ``pin``: not pinned yet) under a new
        lease, counting each block's hit and reuse gap as of ``start``. A miss gets the empty
        lease. ResourceExhausted past a cap of the lease table (unpinning what was pinned).
        ``served``: the blocks count as prefill served (not for a hold)."""
        deadline = self._clock() + self._config.lease_seconds
        if not keys:  # a miss pins nothing: no lease to track (release("") is a no-op)
            return Lease(EMPTY_LEASE, deadline, [], [], self._config.lease_seconds)
        refused = self._leases.over_cap(info.engine_id, len(keys))
        if refused is not None:
            if not pin:
                self._tiers.unpin(keys)
            raise ResourceExhausted(refused)
        from_ssd = self._tiers.count_hits(keys, blocks, start, pin=pin, served=served)
        lease = ReadLease(new_lease_id(), info.engine_id, deadline, keys,
                          None if served else (info.namespace, from_ssd))
        self._gate.read_began(lease)
        self._leases.add(lease)
        return Lease(lease.lease_id, deadline, [b.slot_id for b in blocks],
                     [b.checksum for b in blocks], self._config.lease_seconds)

    def release(self, lease_id: str, engine_id: str | None, corrupt_from: int | None,
                served: int | None = None) -> bool:
        """``NodeStore.release``: end a read lease; count ``served`` blocks of a hold as served;
        re-check a reported corrupt block and, if its bytes are indeed bad, drop it now or once
        its other readers are done (returns whether it was bad)."""
        if lease_id == EMPTY_LEASE:
            return False
        self._expire(self._clock())
        ending = self._leases.ending(lease_id)
        if ending is not None:  # NOT_FOUND, as the proto says (a commit would be a precondition)
            raise NotFound(f"lease {clip(lease_id)} already {ending}: nothing to release")
        lease = self._leases.get(lease_id, engine_id)
        if not isinstance(lease, ReadLease):
            raise FailedPrecondition(f"lease {clip(lease_id)} is a reservation: commit or abort it")
        if corrupt_from is not None and not 0 <= corrupt_from < len(lease.keys):
            raise ValueError(f"corrupt_from {corrupt_from} is outside the lease's "
                             f"{len(lease.keys)} blocks: give the index of the failed block")
        if served is not None and lease.held is None:
            raise ValueError("served goes with a held lease (Acquire or Probe with hold); an "
                             "Acquire without hold counted its blocks as served already")
        if served is not None and served > len(lease.keys):
            raise ValueError(f"served {served} is more than the lease's {len(lease.keys)} "
                             "blocks: give how many of its blocks were loaded under it")
        finished = self._leases.finish(lease_id, "released")
        assert isinstance(finished, ReadLease)
        self.end(finished)
        if served and lease.held is not None:
            namespace, from_ssd = lease.held
            self._tiers.serve(namespace, served, min(from_ssd, served))
        return corrupt_from is not None and self._tiers.condemn(lease.keys[corrupt_from])

    def end(self, lease: ReadLease) -> None:
        """Unpin an already finished read lease's blocks."""
        self._tiers.unpin(lease.keys)
        self._gate.read_ended(lease)

    def _pin_inflight(self, key: NamespacedKey) -> None:
        self._tiers.pin(key)
        self.inflight_pins[key] += 1

    def _landed_pinned(self, key: NamespacedKey, pins: int) -> None:  # once per waiting acquire
        if pins:
            self.inflight_pins[key] += pins

    def _drop_inflight(self, key: NamespacedKey) -> None:
        self.inflight_pins[key] -= 1
        if not self.inflight_pins[key]:
            del self.inflight_pins[key]

    def _unpin_inflight(self, key: NamespacedKey) -> None:
        self._drop_inflight(key)
        self._tiers.unpin((key,))
