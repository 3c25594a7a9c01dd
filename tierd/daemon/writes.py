"""Writes: the arena slots an engine reserves to store blocks in, and their commit or abort.

``Reservations.reserve`` gives each block not yet on the node a fresh DRAM slot (evicting LRU
unpinned DRAM blocks when none is free, never waiting on a write) and holds the slots under one
write lease; the node records which lease is writing each key (``writing``), so no second lease
and no SSD promotion lands on it meanwhile. The engine copies its bytes into the slots, then
``commit`` publishes every slot it wrote as a DRAM block (one ``BlockStored(tier="dram")`` per
consecutive run) and frees the others; for an engine that leaves the checksums to the daemon,
``written_spans`` names where its written slots lie, to be hashed (off the event loop), then
committed. ``abort``, expiry and unregistering free the slots (``free``).

``reserve_blank`` reserves slots ahead of the blocks they will hold (a store's copy then needs no
round trip first): the lease's hashes are None until ``commit`` names them; a name the node
already holds, or that another lease is writing, frees its slot instead (stored once). Blank
slots of every engine together stay within ``blank_fraction`` of the arena (``blank_bytes``);
a blank lease keeps only the slots it was granted.

A reservation that holds no slot (no hashes, or no blank slot granted) is the empty lease
(``EMPTY_LEASE``): nothing is stored for it, and its commit or abort does nothing. Every write
lease is checked against the lease table's caps before a slot is allocated for it.

The node store resolves the engine, scopes its hashes and expires overdue leases; this module
owns what a write lease holds, from its reservation to its end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierd.daemon.errors import FailedPrecondition
from tierd.daemon.leases import EMPTY_LEASE, LeaseTable, WriteLease, new_lease_id
from tierd.daemon.lru import DramBlock
from tierd.daemon.node_types import EngineInfo, Reservation
from tierd.daemon.tier_index import TierIndex
from tierd.events import BlockStored
from tierd.types import BlockHash, NamespacedKey, make_key
from tierd.wire.clip import clip

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

MAX_FILTERED_QUERY_TOKENS = 1 << 40
"""Most ``filtered_query_tokens`` one Reserve may report (about 10^12: hours of lookups of a
fast engine); more is INVALID_ARGUMENT, so no caller can overflow the node's counters."""


class Reservations:
    """The node's write leases and the keys they are writing. Not thread-safe: one event loop.

    ``leases`` is the node store's lease table and ``expire(now)`` its way of ending overdue
    leases (read and write), shared; ``writing`` (reserved key -> its write lease id) is shared
    with the promoter. The node store's ``reserve``, ``commit``, ``written_spans`` and
    ``abort`` say what each call does and raises."""

    def __init__(self, tiers: TierIndex, leases: LeaseTable, lease_seconds: float,
                 expire: Callable[[float], None], clock: Callable[[], float],
                 blank_budget: int,
                 ended: Callable[[WriteLease], None] = lambda lease: None) -> None:
        self._tiers, self._leases, self._lease_seconds = tiers, leases, lease_seconds
        self._expire, self._clock = expire, clock
        self._ended = ended  # told of every write lease that ends (commit, abort, expiry...)
        self.writing: dict[NamespacedKey, str] = {}
        self._blank_budget = blank_budget
        self.blank_bytes = 0  # in the slots of live blank leases (at most blank_budget)

    def reserve(self, info: EngineInfo, hashes: Sequence[BlockHash],
                keys: Sequence[NamespacedKey], filtered_query_tokens: int,
                limit: int | None = None) -> Reservation:
        """``NodeStore.reserve`` for a known engine; ``keys[i]`` is ``hashes[i]`` scoped;
        at most ``limit`` slots (None: no limit)."""
        if not 0 <= filtered_query_tokens <= MAX_FILTERED_QUERY_TOKENS:
            raise ValueError(f"filtered_query_tokens {filtered_query_tokens} is over 2^40, the "
                             "most one Reserve may report: send the count since the last Reserve")
        t = self._tiers
        if filtered_query_tokens:
            t.counts.queries += filtered_query_tokens
        now = self._clock()
        self._expire(now)
        if not keys:
            return self._empty(0, now)
        self._leases.check_room(info.engine_id, len(keys))
        lease_id = new_lease_id()
        slot_bytes = info.geometry.slot_bytes
        slots: list[int | None] = [None] * len(keys)
        room = True
        while room:  # again if making room evicted one of these keys: it needs a slot now
            wanted: dict[NamespacedKey, int] = {}  # key -> its first index, in chain order
            for i, key in enumerate(keys):
                if key not in self.writing and key not in wanted and not (
                        key in t.dram or (t.ssd_up and key in t.disk)):
                    wanted[key] = i
            take = len(wanted) if limit is None else min(len(wanted), limit)
            got = t.allocate_many(slot_bytes, take, now, info.namespace)
            room = bool(wanted) and len(got) == len(wanted)
            if limit is not None:
                limit -= len(got)
            for (key, i), slot in zip(wanted.items(), got):
                t.note_restore(key, now)
                slots[i] = slot
                self.writing[key] = lease_id
        stored = [key in t.dram or (t.ssd_up and key in t.disk) for key in keys]
        return self._lease(info, lease_id, list(hashes), slots, stored, now)

    def reserve_blank(self, info: EngineInfo, count: int,
                      limit: int | None = None) -> Reservation:
        """``NodeStore.reserve_blank`` for a known engine: ``count`` slots, fewer (None) where
        no room could be made (or past ``limit``), named at ``commit``."""
        now = self._clock()
        self._expire(now)
        size = info.geometry.slot_bytes
        room = max(0, self._blank_budget - self.blank_bytes) // size
        want = min(count, room if limit is None else min(room, limit))
        if want:
            self._leases.check_room(info.engine_id, want)
        got: list[int | None] = [*self._tiers.allocate_many(size, want, now, info.namespace)]
        if not got:  # nothing granted: no lease, nothing kept per slot asked for
            return self._empty(count, now)
        self.blank_bytes += len(got) * size
        lease = WriteLease(new_lease_id(), info.engine_id, now + self._lease_seconds,
                           info.namespace, info.layout.block_size, size, [None] * len(got), got,
                           blank=True, asked=count)
        self._leases.add(lease)
        return Reservation(lease.lease_id, lease.deadline, [*got, *[None] * (count - len(got))],
                           [False] * count, self._lease_seconds)

    def _lease(self, info: EngineInfo, lease_id: str, hashes: list[BlockHash | None],
               slots: list[int | None], stored: list[bool], now: float) -> Reservation:
        deadline = now + self._lease_seconds
        self._leases.add(WriteLease(lease_id, info.engine_id, deadline, info.namespace,
                                    info.layout.block_size, info.geometry.slot_bytes, hashes,
                                    slots))
        return Reservation(lease_id, deadline, slots, stored, self._lease_seconds)

    def _empty(self, count: int, now: float) -> Reservation:
        """The reservation of ``count`` entries without a slot: the empty lease, not stored."""
        return Reservation(EMPTY_LEASE, now + self._lease_seconds, [None] * count,
                           [False] * count, self._lease_seconds)

    def commit(self, lease_id: str, checksums: Sequence[int | None], engine_id: str | None,
               names: Sequence[BlockHash] = ()) -> int:
        """``NodeStore.commit``: publish the checksummed slots, free the others."""
        now = self._clock()
        written = [c is not None for c in checksums]
        if lease_id == EMPTY_LEASE:
            _no_slot(written, [])
            return 0
        lease = self._write_lease(lease_id, engine_id, len(checksums), "checksum (or None)")
        for i, c in enumerate(checksums):
            if c is not None and not (isinstance(c, int) and 0 <= c < 1 << 64):
                raise ValueError(f"checksum #{i} must be an unsigned 64-bit int, got {c!r}")
        hashes = _named(lease, names, written)
        self._leases.finish(lease_id, "committed")
        self._unblank(lease)
        self._ended(lease)
        t, blank = self._tiers, lease.blank
        run: list[BlockHash] = []
        parent: BlockHash | None = None
        count, ns = 0, lease.namespace
        for i, (block_hash, slot, checksum) in enumerate(zip(hashes, lease.slots, checksums)):
            if slot is not None:
                key = make_key(ns, block_hash) if block_hash is not None else None
                if not blank:
                    del self.writing[key]  # type: ignore[arg-type]  # named at Reserve
                elif key is not None and (key in self.writing or key in t.dram or (
                        t.ssd_up and key in t.disk)):
                    key = None  # stored already (or being written): stored once
                if key is None or checksum is None:
                    t.free_slot(lease.slot_bytes, slot)
                else:
                    assert block_hash is not None
                    if blank:
                        t.note_restore(key, now)
                    t.add_dram(key, DramBlock(ns, block_hash, lease.slot_bytes, slot, checksum,
                                              created=now, last_access=now))
                    if not run:
                        parent = hashes[i - 1] if i > 0 else None
                    run.append(block_hash)
                    count += 1
                    continue
            if run:
                t.emit(BlockStored(tuple(run), parent, "dram", lease.block_size), ns)
                run = []
        if run:
            t.emit(BlockStored(tuple(run), parent, "dram", lease.block_size), ns)
        return count

    def written_spans(self, lease_id: str, written: Sequence[bool], engine_id: str | None,
                      names: Sequence[BlockHash] = ()) -> list[tuple[int, int] | None]:
        """``NodeStore.written_spans``: (address, length) in the arena of each written slot."""
        if lease_id == EMPTY_LEASE:
            _no_slot(written, [])
            return [None] * len(written)
        lease = self._write_lease(lease_id, engine_id, len(written), "written flag")
        _named(lease, names, written)
        geometry = self._tiers.alloc.geometry(lease.slot_bytes)
        arena, size = self._tiers.arena, lease.slot_bytes
        spans: list[tuple[int, int] | None] = [None] * len(written)  # a blank lease keeps
        for i, (wrote, slot) in enumerate(zip(written, lease.slots)):  # only granted slots
            if wrote and slot is not None:
                spans[i] = (arena.address(geometry.offset(slot), size), size)
        return spans

    def abort(self, lease_id: str, engine_id: str | None) -> None:
        """``NodeStore.abort``: free the reservation's slots (idempotent after its end)."""
        if lease_id == EMPTY_LEASE:
            return
        self._expire(self._clock())
        if self._leases.ending(lease_id) in ("aborted", "expired", "unregistered"):
            return
        lease = self._leases.get(lease_id, engine_id)
        if not isinstance(lease, WriteLease):
            raise FailedPrecondition(f"lease {clip(lease_id)} is a read lease: release it")
        self._leases.finish(lease_id, "aborted")
        self.free(lease)

    def free(self, lease: WriteLease) -> None:
        """Free the slots of an already finished write lease (aborted, expired, unregistered)."""
        self._unblank(lease)
        for block_hash, slot in zip(lease.hashes, lease.slots):
            if slot is not None:
                if block_hash is not None:
                    del self.writing[make_key(lease.namespace, block_hash)]
                self._tiers.free_slot(lease.slot_bytes, slot)
        self._ended(lease)

    def _unblank(self, lease: WriteLease) -> None:
        """A blank lease ended: its slots no longer count against the budget."""
        if lease.blank:
            self.blank_bytes -= lease.slot_bytes * sum(s is not None for s in lease.slots)

    def _write_lease(self, lease_id: str, engine_id: str | None, entries: int,
                     what: str) -> WriteLease:
        """The live reservation a Commit names, after expiring overdue leases; ``entries``
        (each a ``what``) must match its hashes (ValueError), a read lease is
        FailedPrecondition."""
        self._expire(self._clock())
        lease = self._leases.get(lease_id, engine_id)
        if not isinstance(lease, WriteLease):
            raise FailedPrecondition(f"lease {clip(lease_id)} is a read lease: release it")
        if entries != lease.flags:
            raise ValueError(f"commit needs one {what} per reserved "
                             f"{'slot' if lease.blank else 'hash'}: {entries} given, "
                             f"{lease.flags} reserved")
        return lease


def _named(lease: WriteLease, names: Sequence[BlockHash], written: Sequence[bool]
           ) -> list[BlockHash | None]:
    """The hash of each of ``lease``'s slots at its Commit: the Reserve's, or for blank slots
    ``names`` (ValueError: names for a named reservation, more names than slots, or a written
    slot left unnamed, or a slot written that was never granted)."""
    _no_slot(written, lease.slots)
    if not lease.blank:
        if names:
            raise ValueError("block_hashes name blank slots only: this reservation named its "
                             "blocks at Reserve")
        return list(lease.hashes)
    if len(names) > lease.asked:
        raise ValueError(f"{len(names)} block hashes for {lease.asked} blank slots: at "
                         "most one per slot")
    unnamed = next((i for i in range(len(names), len(written)) if written[i]), None)
    if unnamed is not None:
        raise ValueError(f"blank slot #{unnamed} is written but has no block hash: name every "
                         "written slot (CommitRequest.block_hashes, in slot order)")
    granted = len(lease.slots)
    return [*names[:granted], *[None] * (granted - len(names))]


def _no_slot(written: Sequence[bool], slots: Sequence[int | None]) -> None:
    """ValueError if a slot is flagged written that the Reserve never granted (past the
    granted ones, or None)."""
    wrong = next((i for i, w in enumerate(written)
                  if w and (i >= len(slots) or slots[i] is None)), None)
    if wrong is not None:
        raise ValueError(f"slot #{wrong} is flagged written but the Reserve granted it no slot: "
                         "flag only the slots with a slot_id")
