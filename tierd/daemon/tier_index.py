"""What the node holds below HBM: the DRAM and SSD indexes with the arena's allocator and the
SSD store, and the only code that drops a copy of a block.

The node store decides *when* (leases, watermarks); the eviction policy decides *which*; this
module frees the slot or record, tells the listener and counts the drop. Times come from the
node store's clock (monotonic seconds). A ``TierListener`` (``tierd.daemon.listeners``) is told
of every change of what the node holds, with namespaced keys, at the moment it happens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from tierd.checksum import block_checksum
from tierd.daemon.classes import SizeClasses
from tierd.daemon.eviction import LruEviction
from tierd.daemon.ghosts import Ghost, GhostList, Pressure
from tierd.daemon.listeners import TierListener
from tierd.daemon.lru import DramBlock, LruIndex, SsdBlock
from tierd.daemon.metrics import NodeMetrics, TierStats
from tierd.daemon.slots import SlabAllocator
from tierd.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog, KVEvent
from tierd.types import BlockHash, Namespace, NamespacedKey, Tier, make_key

if TYPE_CHECKING:
    from tierd.daemon.ssd import SsdEntry, SsdStore
    from tierd.wire.arena import ShmArena

log = logging.getLogger(__name__)

DropReason = Literal["evicted", "corrupt"]
"""Why a copy leaves a tier: LRU policy (counted as an eviction or demotion, may be handed to
the remote tier) or bytes that failed their checksum (counted as a checksum failure)."""


class TierIndex:
    """What is where below HBM: the DRAM and SSD indexes, the arena's allocator and the SSD
    store. The only code that drops a copy of a block: it frees the slot or record, emits
    ``BlockRemoved`` with the tier, and counts and times the drop.

    A key may be in both tiers (a promoted block keeps its SSD copy). Dropping a DRAM copy is a
    *demotion* if an SSD copy remains, else an *eviction*; every SSD drop is an eviction. When a
    block's last copy leaves, its lifetime and idle time are observed and it is remembered as a
    ghost (bounded) so a later re-store can measure its reuse gap.
    """

    def __init__(self, arena: ShmArena, allocator: SlabAllocator, ssd: SsdStore | None,
                 metrics: NodeMetrics, events: EventLog, ghost_entries: int,
                 clock: Callable[[], float], listener: TierListener | None = None,
                 max_classes: int = 64) -> None:
        self.arena, self.alloc, self.ssd = arena, allocator, ssd
        self.metrics, self.events, self._clock = metrics, events, clock
        self.listener = listener
        self.dram: LruIndex[DramBlock] = LruIndex()
        self.disk: LruIndex[SsdBlock] = LruIndex()
        self.classes = SizeClasses(allocator, max_classes)  # slot sizes in use
        self.counts = metrics.counts
        self.ghosts = GhostList(ghost_entries)  # blocks that recently left the node
        self._was_up = ssd is not None
        self.eviction = LruEviction()
        self.served: Callable[[Namespace, int, int], None] | None = None
        """Told of each acquire's blocks: (namespace, blocks already in DRAM, read from SSD)."""
        self._promoted = 0  # DRAM blocks with ``promoted`` set (none: hits skip the check)
        self._condemned = 0  # DRAM blocks with ``corrupt`` set (none: runs skip the check)

    def load(self, entries: list[SsdEntry], now: float) -> None:
        """Index the records an opened SSD store found (oldest first), then drop the oldest
        while they pass its bound (it may have shrunk since they were written)."""
        for e in entries:
            self.disk.add(make_key(e.namespace, e.block_hash), SsdBlock(
                e.namespace, e.block_hash, e.payload_len, e.stored_bytes, e.checksum,
                created=now, last_access=now))
        if self.listener is not None and entries:
            self.listener.stored([make_key(e.namespace, e.block_hash) for e in entries], "ssd")
        if self.ssd is not None:
            self.make_ssd_room([], now)
        self.check_ssd()

    def emit(self, event: KVEvent, namespace: Namespace | None = None) -> None:
        """Record a tier event and tell the listener (``namespace`` scopes the event's hashes;
        needed for ``BlockStored`` / ``BlockRemoved``). While the SSD tier is hidden its block
        events are not told: the listener heard it cleared, and hears every SSD block stored
        when it is served again, so its view stays exact."""
        self.events.append(event)
        if self.listener is None:
            return
        if isinstance(event, AllBlocksCleared):
            self.listener.cleared(event.tier)
            return
        assert namespace is not None, "a block event for the listener needs its namespace"
        if event.tier == "ssd" and not self._was_up:
            return  # the listener holds no SSD block until check_ssd announces them all
        keys = [make_key(namespace, h) for h in event.block_hashes]
        if isinstance(event, BlockStored):
            self.listener.stored(keys, event.tier)
        else:
            self.listener.removed(keys, event.tier)

    def held_keys(self) -> list[NamespacedKey]:
        """The key of every DRAM copy and every served SSD copy (one entry per copy)."""
        keys = [k for k, _ in self.dram.oldest_first()]
        if self.ssd_up:
            keys += [k for k, _ in self.disk.oldest_first()]
        return keys

    @property
    def ssd_told_up(self) -> bool:
        """Whether the listener last heard the SSD tier as served (``check_ssd`` tells it)."""
        return self._was_up

    @property
    def ssd_up(self) -> bool:
        """Whether SSD blocks are served (the store exists and reports itself healthy)."""
        return self.ssd is not None and self.ssd.healthy

    def dram_used_bytes(self) -> int:
        """Bytes of every allocated slot (stored, reserved and staged blocks)."""
        return sum(self.alloc.used_slots(c) * c for c in self.classes)

    def allocate_many(self, slot_bytes: int, count: int, now: float,
                      owner: Namespace | None = None) -> list[int]:
        """Up to ``count`` free slots of ``slot_bytes``, in order, evicting the DRAM blocks the
        eviction policy names until they free up (this size class first, found in one pass for
        the whole batch, then other classes one at a time); fewer if the rest are pinned (or
        the policy spares them: ``owner``, the namespace the slots are for). Never blocks."""
        slots = self.alloc.allocate_many(slot_bytes, count)
        batch_done = False
        while len(slots) < count:
            slot = self.alloc.allocate(slot_bytes)
            if slot is not None:
                slots.append(slot)
                continue
            if not batch_done:  # each victim of this class frees one slot of it
                batch_done = True
                victims = self.eviction.dram_victims(self.dram, slot_bytes, count - len(slots),
                                                     owner)
                if victims:
                    self.drop_dram_many(victims, now)
                    continue
            victim = self.eviction.dram_victim_other_class(self.dram, slot_bytes, owner)
            if victim is None:
                break
            self.drop_dram(victim, now)
        return slots

    def add_dram(self, key: NamespacedKey, block: DramBlock) -> None:
        """Index a block whose bytes are now in its slot (a commit) as the most recently used,
        unpinned. Emits nothing: the caller emits its ``BlockStored`` (a commit emits runs)."""
        assert key not in self.dram, f"{key.hex()}: stored in DRAM twice"
        self.dram.add(key, block)

    def free_slot(self, slot_bytes: int, slot_id: int) -> None:
        """Give back a slot no block was indexed in (an aborted, expired or failed write)."""
        self.alloc.free(slot_bytes, slot_id)
        self.classes.freed(slot_bytes)

    def free_slots(self, slot_bytes: int, slot_ids: Sequence[int]) -> None:
        """``free_slot`` of each of ``slot_ids`` (a write's unused slots), in one call."""
        if slot_ids:
            self.alloc.free_many(slot_bytes, slot_ids)
            self.classes.freed(slot_bytes)

    def note_restore(self, key: NamespacedKey, now: float) -> None:
        """A key is about to be stored again: if it left the node recently (a ghost), observe
        the gap since its last access and forget it."""
        ghost = self.ghosts.forget(key)
        if ghost is not None:
            self.metrics.reuse_gap.observe(max(0.0, now - ghost.last_access))

    def land(self, key: NamespacedKey, source: SsdBlock, slot_bytes: int, slot_id: int,
             pins: int) -> None:
        """An SSD block read into DRAM slot ``slot_id`` becomes a DRAM block (most recently
        used, its SSD copy touched too) with ``pins`` pins: a promotion, ``BlockStored``
        "dram"."""
        self.add_dram(key, DramBlock(source.namespace, source.block_hash, slot_bytes, slot_id,
                                     source.checksum, source.created, source.last_access,
                                     source.hits, promoted=True))
        self._promoted += 1
        self.pin(key, pins)
        if key in self.disk:
            self.disk.touch(key)
        self.counts.promotions += 1
        self.emit(BlockStored((source.block_hash,), None, "dram"), source.namespace)

    def unreadable(self, key: NamespacedKey, source: SsdBlock, failure: BaseException | None,
                   now: float) -> None:
        """An SSD record did not verify (``failure`` None) or could not be read: counted as a
        checksum failure, its entry dropped if still indexed (and its record, on a read error;
        the store already dropped a corrupt one), the SSD's health rechecked."""
        if failure is not None:
            log.warning("SSD read of %s failed: %r", key.hex(), failure)
        self.counts.checksum_failures["ssd"] += 1
        if self.disk.get(key) is source:
            self.drop_ssd(key, now, "corrupt")
        self.check_ssd()

    def pin(self, key: NamespacedKey, count: int = 1) -> DramBlock:
        """Take ``count`` pins on the DRAM block under ``key`` (it must be there): a pinned
        block is neither evicted, demoted nor moved until as many ``unpin``s."""
        block = self.dram.get(key)
        assert block is not None, f"{key.hex()}: pinning a block that is not in DRAM"
        block.pins += count
        return block

    def unpin(self, keys: Iterable[NamespacedKey]) -> None:
        """Drop one pin from each key's DRAM block (a key twice: two pins); each must hold it.
        A block found corrupt goes with its last pin (``condemn``)."""
        get = self.dram.get
        for key in keys:  # a lease may hold thousands of blocks
            block = get(key)
            assert block is not None and block.pins > 0, f"{key.hex()}: unpin without a pin"
            block.pins -= 1
            if block.corrupt and not block.pins:
                self._drop_condemned(key, block)

    def dram_run(self, keys: Iterable[NamespacedKey]) -> list[DramBlock]:
        """The DRAM blocks of the longest leading run of ``keys`` held, in order, ending before
        any block found corrupt (what a lookup may count and a lease may pin)."""
        run = self.dram.prefix(keys)
        if self._condemned:
            for i, block in enumerate(run):
                if block.corrupt:
                    return run[:i]
        return run

    def condemn(self, key: NamespacedKey) -> bool:
        """A reader reported the DRAM copy under ``key`` corrupt: re-check its bytes against its
        checksum. If they no longer match, it is corrupt: dropped now if free, else marked
        ``corrupt`` (no lookup counts it, no lease pins it, no SSD write takes it) and dropped
        when its last pin ends or its SSD write returns. Returns whether it was corrupt (False
        for a false report or a block already gone)."""
        block = self.dram.get(key)
        if block is None:
            return False
        if block.corrupt:
            return True
        if block_checksum(self.arena.view(self.offset(block), block.slot_bytes)) == \
                block.checksum:
            return False
        block.corrupt = True
        self._condemned += 1
        self._drop_condemned(key, block)
        return True

    def _drop_condemned(self, key: NamespacedKey, block: DramBlock) -> None:
        """Drop a block found corrupt once nothing holds it (no pin, no SSD write)."""
        if block.pins or block.demoting:
            return
        log.warning("DRAM block %s failed its checksum: dropped", key.hex())
        self.drop_dram(key, self._clock(), "corrupt")

    def count_hits(self, keys: Sequence[NamespacedKey], blocks: Sequence[DramBlock], now: float,
                   *, pin: bool, served: bool = True) -> int:
        """DRAM blocks an acquire returns (``blocks[i]`` indexed under ``keys[i]``, in chain
        order): each counts a hit and its reuse gap (since its last access; negative as 0: a
        later acquire may have touched it first), is accessed ``now`` and becomes the most
        recently used, the chain's last block newest. ``pin``: also take a pin on each (for
        the caller's lease to hold). ``served``: tell ``served`` of them (the savings hook; not
        for an acquire that only holds blocks for a later one: ``serve`` tells it then).
        Returns how many of them had just come from SSD."""
        gaps: list[float] = []
        pins = 1 if pin else 0
        for block in blocks:
            block.hits += 1
            gaps.append(now - block.last_access)
            block.last_access = now
            block.pins += pins
        from_ssd = 0
        if self._promoted:
            for block in blocks:
                if block.promoted:
                    from_ssd += 1
                    block.promoted = False
            self._promoted -= from_ssd
        self.metrics.reuse_gap.observe_many(gaps)
        self.dram.touch_all(keys)
        if served and blocks:
            self.serve(blocks[0].namespace, len(blocks), from_ssd)
        return from_ssd

    def serve(self, namespace: Namespace, blocks: int, from_ssd: int) -> None:
        """Tell the savings hook (``served``, if set) that ``blocks`` blocks of ``namespace``
        were loaded by an engine, ``from_ssd`` of them just read from SSD."""
        if self.served is not None and blocks:
            self.served(namespace, blocks - from_ssd, from_ssd)

    def drop_dram(self, key: NamespacedKey, now: float, reason: DropReason = "evicted",
                  pressure: Pressure = "room") -> None:
        """Remove an unpinned DRAM copy and free its slot: "evicted" is a demotion if an SSD
        copy remains, else an eviction (the listener may keep its bytes; the ghost list keeps
        ``pressure``); "corrupt" (its bytes no longer match its checksum) is counted as a
        checksum failure and never handed on."""
        block = self.dram.pop(key)
        assert block.pins == 0 and not block.demoting, f"{key.hex()}: dropping a pinned block"
        self._promoted -= block.promoted
        self._condemned -= block.corrupt
        if reason == "corrupt":
            self.alloc.free(block.slot_bytes, block.slot_id)
            self.classes.freed(block.slot_bytes)
            self.emit(BlockRemoved((block.block_hash,), "dram"), block.namespace)
            self.counts.checksum_failures["dram"] += 1
            if key not in self.disk:
                self.ghosts.remember(key, Ghost(block.last_access, now, "dram", "corrupt"))
            return
        self._evict_dram(key, block, now, pressure)
        self.emit(BlockRemoved((block.block_hash,), "dram"), block.namespace)

    def drop_dram_many(self, keys: Sequence[NamespacedKey], now: float) -> None:
        """``drop_dram`` of each of ``keys`` ("evicted", in order), with one ``BlockRemoved``
        per run of keys of one namespace rather than one per block."""
        run: list[BlockHash] = []
        namespace: Namespace | None = None
        for key in keys:
            block = self.dram.pop(key)
            assert block.pins == 0 and not block.demoting, f"{key.hex()}: dropping a pinned block"
            self._promoted -= block.promoted
            self._evict_dram(key, block, now, "room")
            if run and block.namespace != namespace:
                self.emit(BlockRemoved(tuple(run), "dram"), namespace)
                run = []
            namespace = block.namespace
            run.append(block.block_hash)
        if run:
            self.emit(BlockRemoved(tuple(run), "dram"), namespace)

    def _evict_dram(self, key: NamespacedKey, block: DramBlock, now: float,
                    pressure: Pressure) -> None:
        """A DRAM copy popped from the index leaves (all but its event): the listener may keep
        its bytes if it was the node's last copy, its slot is freed, and it is counted."""
        last = not (self.ssd_up and key in self.disk)
        if last and self.listener is not None:
            view = self.arena.view(self.offset(block), block.slot_bytes)
            self.listener.evicted(key, block.checksum, block.slot_bytes, lambda: _ready(view))
        self.alloc.free(block.slot_bytes, block.slot_id)
        self.classes.freed(block.slot_bytes)
        if not last:
            self.counts.demotions += 1
        else:
            self.counts.evictions["dram"] += 1
            self._left_node(key, block.created, block.last_access, now, "dram", pressure)

    def drop_ssd(self, key: NamespacedKey, now: float, reason: DropReason = "evicted") -> None:
        """Remove an SSD copy and its record (a no-op for the store if it already dropped a
        corrupt one). "evicted": counted, and the listener may keep its bytes if it was the
        last copy; "corrupt": neither (the caller counts the checksum failure), and a promotion
        may still pin it."""
        entry = self.disk.pop(key)
        evicted = reason == "evicted"
        assert entry.pins == 0 or not evicted, f"{key.hex()}: dropping a pinned SSD block"
        if evicted and key not in self.dram and self.listener is not None:
            self.listener.evicted(key, entry.checksum, entry.payload_len,
                                  lambda: self._read_later(entry))
        if self.ssd is not None:
            self.ssd.remove(entry.namespace, entry.block_hash)
        self.emit(BlockRemoved((entry.block_hash,), "ssd"), entry.namespace)
        if evicted:
            self.counts.evictions["ssd"] += 1
        if key not in self.dram:
            self._left_node(key, entry.created, entry.last_access, now, "ssd",
                            "ssd_room" if evicted else "corrupt")

    async def demote(self, low_bytes: float, min_hits: int, probe: bool, now: float) -> None:
        """Move LRU unpinned DRAM blocks down until DRAM holds at most ``low_bytes``: each is
        written to SSD (``write_to_ssd``) unless it already has an SSD copy or fewer than
        ``min_hits`` hits, then its DRAM copy is dropped (a demotion, or an eviction if it has
        no SSD copy). ``probe`` (SSD unhealthy): one write is tried and nothing dropped unless
        it brings the SSD back. A block pinned meanwhile stays."""
        excess = self.dram_used_bytes() - low_bytes
        victims: list[tuple[NamespacedKey, DramBlock]] = []
        for key, block in self.eviction.demotion_order(self.dram):
            if excess <= 0 or (probe and victims):
                break
            if self.eviction.evictable(block) and not (probe and key in self.disk):
                victims.append((key, block))
                excess -= block.slot_bytes
        await self.write_to_ssd(victims, min_hits, now)
        if probe and not self.ssd_up:
            return
        now = self._clock()
        for key, block in victims:
            if self.dram.get(key) is block and block.pins == 0:
                self.drop_dram(key, now, pressure="admission" if block.hits < min_hits
                               else "watermark")

    async def write_to_ssd(self, blocks: Sequence[tuple[NamespacedKey, DramBlock]],
                           min_hits: int, now: float) -> int:
        """Give DRAM blocks an SSD copy (the SSD's admission: not those that have one, are
        being written, or have fewer than ``min_hits`` hits; room made by dropping LRU
        unpinned SSD blocks, a prefix of ``blocks`` if not all fit). Their DRAM copies stay
        (``demoting`` keeps their slots in place until the write returns, even if cancelled).
        Awaits one ``SsdStore.write_many``; returns the blocks written."""
        assert self.ssd is not None
        writes = [(k, b) for k, b in blocks if k not in self.disk and b.hits >= min_hits
                  and not b.demoting and not b.corrupt]
        writes = writes[:self.make_ssd_room([b.slot_bytes for _, b in writes], now,
                                            [b.namespace for _, b in writes])]
        for _, block in writes:
            block.demoting = True
        try:
            results = await self.ssd.write_many([(
                b.namespace, b.block_hash, self.arena.view(self.offset(b), b.slot_bytes),
                b.checksum) for _, b in writes])
        finally:
            for key, block in writes:
                block.demoting = False
                if block.corrupt and self.dram.get(key) is block:
                    self._drop_condemned(key, block)
        written = 0
        for (key, block), entry in zip(writes, results):
            if entry is not None and key not in self.disk:
                self.disk.add(key, SsdBlock(block.namespace, block.block_hash, entry.payload_len,
                                            entry.stored_bytes, entry.checksum, block.created,
                                            block.last_access, block.hits))
                self.emit(BlockStored((block.block_hash,), None, "ssd"), block.namespace)
                written += 1
        self.check_ssd()
        return written

    def make_ssd_room(self, sizes: list[int], now: float,
                      writers: Sequence[Namespace] = ()) -> int:
        """Drop LRU unpinned SSD blocks until records of ``sizes`` (payload bytes) fit; returns
        how many of them (a prefix) fit. ``writers``: each record's namespace (the policy may
        spare other tenants' blocks for them)."""
        assert self.ssd is not None
        bounds = [self.ssd.record_bytes(s) for s in sizes]
        fit = len(bounds)
        while fit and sum(bounds[:fit]) > self.ssd.capacity_bytes:
            fit -= 1
        need = sum(bounds[:fit])
        free = self.ssd.capacity_bytes - self.ssd.used_bytes
        for key in self.eviction.ssd_victims(self.disk, need - free, writers[:fit]):
            self.drop_ssd(key, now)
        free = self.ssd.capacity_bytes - self.ssd.used_bytes
        while fit and free < need:
            fit -= 1
            need -= bounds[fit]
        return fit

    def check_ssd(self) -> None:
        """Emit the events of an SSD health change: down, ``AllBlocksCleared(tier="ssd")`` and a
        warning (the index is kept; lookups skip it); up again, one ``BlockStored`` of them all."""
        up = self.ssd_up
        if up == self._was_up:
            return
        self._was_up = up
        self.metrics.ssd_healthy.set(1.0 if up else 0.0)
        if not up:
            log.warning("SSD tier unhealthy: serving DRAM only (%d SSD blocks hidden)",
                        len(self.disk))
            self.emit(AllBlocksCleared("ssd"))
        elif len(self.disk):
            log.warning("SSD tier healthy again: %d SSD blocks served", len(self.disk))
            hashes = tuple(e.block_hash for _, e in self.disk.oldest_first())
            self.events.append(BlockStored(hashes, None, "ssd"))
            if self.listener is not None:
                self.listener.stored([k for k, _ in self.disk.oldest_first()], "ssd")

    def stats(self, reserved: int) -> dict[str, TierStats]:
        """DRAM and SSD ``TierStats``; ``reserved``: slots held by write leases and promotions
        (counted as used and pinned). DRAM capacity in blocks: the slots of slabs each class
        holds plus the free slabs cut for the largest class (exact with one layout)."""
        n = self.counts
        free_slabs = self.alloc.free_slabs()
        taken = largest = 0
        for c in self.classes:
            taken += self.alloc.capacity_slots(c) - free_slabs * self._slots_per_slab(c)
            largest = max(largest, c)
        capacity = taken + (free_slabs * self._slots_per_slab(largest) if largest else 0)
        used = sum(self.alloc.used_slots(c) for c in self.classes)
        if largest:  # within the per-block overhead charge (``SlabAllocator``)
            capacity = min(capacity, used + self.alloc.room_slots(largest))
        pinned = sum(1 for _, b in self.dram.oldest_first() if b.pins) + reserved
        tiers = {"dram": TierStats(
            used, capacity, self.dram_used_bytes(),
            self.arena.size, pinned, n.hits["dram"], n.queries, n.evictions["dram"],
            n.demotions, 0)}
        used = self.ssd.used_bytes if self.ssd is not None else 0
        bound = self.ssd.capacity_bytes if self.ssd is not None else 0
        per_block = self.ssd.record_bytes(largest) if self.ssd is not None and largest else 0
        room = max(0, bound - used) // per_block if per_block else 0
        tiers["ssd"] = TierStats(
            len(self.disk), len(self.disk) + room, used, bound,
            sum(1 for _, e in self.disk.oldest_first() if e.pins), n.hits["ssd"], n.queries,
            n.evictions["ssd"], 0, n.promotions)
        return tiers

    def check_integrity(self) -> None:
        """Assert entries sit under their own keys and inside the arena, the SSD index matches
        the store's records and byte accounting, and the ghost table is bounded."""
        self.alloc.check_integrity()
        assert self._promoted == sum(b.promoted for _, b in self.dram.oldest_first()), \
            "promoted blocks miscounted"
        assert self._condemned == sum(b.corrupt for _, b in self.dram.oldest_first()), \
            "corrupt blocks miscounted"
        assert all(b.pins or b.demoting for _, b in self.dram.oldest_first() if b.corrupt), \
            "a corrupt block outlived its last reader"
        for key, b in self.dram.oldest_first():
            assert key == make_key(b.namespace, b.block_hash), "DRAM entry under a wrong key"
            end = self.offset(b) + b.slot_bytes
            assert end <= self.arena.size, f"slot {b.slot_id} ends past the arena ({end})"
        if self.ssd is not None:
            self.ssd.check_integrity()
            total = 0
            for key, e in self.disk.oldest_first():
                assert key == make_key(e.namespace, e.block_hash), "SSD entry under a wrong key"
                assert self.ssd.contains(e.namespace, e.block_hash), "SSD entry with no record"
                total += e.stored_bytes
            assert total == self.ssd.used_bytes, (
                f"SSD index holds {total} bytes, the store accounts {self.ssd.used_bytes}")
        self.ghosts.check_integrity()

    def _read_later(self, entry: SsdBlock) -> asyncio.Future[bytes | None]:
        """Start reading and verifying the block's record on an I/O thread (the remote tier's
        copy of an evicted block): its segment stays open until the read ends, so the record
        may be deleted at once. The future holds the bytes, or None if they do not verify."""
        assert self.ssd is not None
        into = bytearray(entry.payload_len)
        read = self.ssd.read_many([(entry.namespace, entry.block_hash, memoryview(into))])[0]
        got: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        read.add_done_callback(lambda done: got.set_result(
            bytes(into) if not done.cancelled() and done.exception() is None and done.result()
            else None))
        return got

    def offset(self, block: DramBlock) -> int:
        """Byte offset of ``block``'s slot in the arena."""
        return self.alloc.geometry(block.slot_bytes).offset(block.slot_id)

    def _slots_per_slab(self, slot_bytes: int) -> int:
        return self.alloc.geometry(slot_bytes).slots_per_slab

    def _left_node(self, key: NamespacedKey, created: float, last_access: float, now: float,
                   tier: Tier, pressure: Pressure) -> None:
        self.metrics.block_lifetime.observe(max(0.0, now - created))
        self.metrics.idle_before_evict.observe(max(0.0, now - last_access))
        self.ghosts.remember(key, Ghost(last_access, now, tier, pressure))


def _ready(view: memoryview) -> asyncio.Future[bytes | None]:
    """A copy of ``view``'s bytes, as a future already done."""
    done: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
    done.set_result(bytes(view))
    return done
