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

A named ``reserve`` and a ``commit`` run in steps of ``chunks.STEP_BLOCKS`` blocks
(``reserve_steps``, ``commit_steps``), so other calls are served between them. Meanwhile the
lease is live and holds exactly the slots not yet handed out or published; a Commit or Abort of
a lease being reserved or committed is FailedPrecondition, and a lease that ends meanwhile
(expired, engine unregistered) stops the steps, its remaining slots freed.

The node store resolves the engine, scopes its hashes and expires overdue leases; this module
owns what a write lease holds, from its reservation to its end.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tierd.daemon.chunks import STEP_BLOCKS, Steps, step_starts
from tierd.daemon.errors import FailedPrecondition, NotFound
from tierd.daemon.leases import EMPTY_LEASE, LeaseTable, WriteLease, new_lease_id
from tierd.daemon.lru import DramBlock
from tierd.daemon.node_types import EngineInfo, Reservation
from tierd.daemon.tier_index import TierIndex
from tierd.events import BlockStored
from tierd.types import BlockHash, NamespacedKey, make_key
from tierd.wire.clip import clip

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from tierd.daemon.quotas import HoldKind

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
                 ended: Callable[[WriteLease], None] = lambda lease: None,
                 held: Callable[[EngineInfo, HoldKind, int], None] = lambda info, kind, n: None
                 ) -> None:
        self._tiers, self._leases, self._lease_seconds = tiers, leases, lease_seconds
        self._expire, self._clock = expire, clock
        self._ended = ended  # told of every write lease that ends (commit, abort, expiry...)
        self._held = held  # told of the slots each step of a reserve took, and of which kind
        self.writing: dict[NamespacedKey, str] = {}
        self._stepping: set[str] = set()  # live leases being reserved or committed in steps
        self._blank_budget = blank_budget
        self.blank_bytes = 0  # in the slots of live blank leases (at most blank_budget)

    def reserve_steps(self, info: EngineInfo, hashes: Sequence[BlockHash],
                      keys: Sequence[NamespacedKey], filtered_query_tokens: int,
                      limit: int | None = None) -> Steps[Reservation]:
        """``NodeStore.reserve`` for a known engine, in steps; ``keys[i]`` is ``hashes[i]``
        scoped; at most ``limit`` slots (None: no limit). The lease is live from the first
        step, holding the slots given so far; NotFound if it ends meanwhile (its engine was
        unregistered)."""
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
        deadline = now + self._lease_seconds
        self._leases.add(WriteLease(lease_id, info.engine_id, deadline, info.namespace,
                                    info.layout.block_size, slot_bytes, list(hashes), slots))
        self._stepping.add(lease_id)
        full = False  # a key found no room: no key after it gets a slot
        for start in step_starts(len(keys)):
            if start:
                yield
                if lease_id not in self._stepping:
                    raise NotFound(f"engine {clip(info.engine_id)} was unregistered during "
                                   "the reserve")
            end, room = min(len(keys), start + STEP_BLOCKS), True
            while room and not full:  # again if making room evicted one of these keys
                wanted: dict[NamespacedKey, int] = {}  # key -> its first index, in chain order
                for i in range(start, end):
                    key = keys[i]
                    if key not in self.writing and key not in wanted and not (
                            key in t.dram or (t.ssd_up and key in t.disk)):
                        wanted[key] = i
                take = len(wanted) if limit is None else min(len(wanted), limit)
                got = t.allocate_many(slot_bytes, take, now, info.namespace)
                room, full = bool(wanted), len(got) < len(wanted)
                if limit is not None:
                    limit -= len(got)
                for (key, i), slot in zip(wanted.items(), got):
                    t.note_restore(key, now)
                    slots[i] = slot
                    self.writing[key] = lease_id
                self._held(info, "reserved", len(got))
        self._stepping.discard(lease_id)
        stored = [key in t.dram or (t.ssd_up and key in t.disk) for key in keys]
        return Reservation(lease_id, deadline, list(slots), stored, self._lease_seconds)

    def reserve_blank_steps(self, info: EngineInfo, count: int,
                            limit: int | None = None) -> Steps[Reservation]:
        """``NodeStore.reserve_blank`` for a known engine, in steps of ``STEP_BLOCKS`` slots:
        ``count`` slots, fewer (None) where no room could be made (or past ``limit``), named
        at ``commit``. The lease is live from the first step that got a slot, holding the slots
        given so far; NotFound if it ends meanwhile (its engine was unregistered)."""
        now = self._clock()
        self._expire(now)
        size = info.geometry.slot_bytes
        room = max(0, self._blank_budget - self.blank_bytes) // size
        want = min(count, room if limit is None else min(room, limit))
        if want:
            self._leases.check_room(info.engine_id, want)
        lease: WriteLease | None = None
        granted = 0
        for start in step_starts(want):
            if lease is not None:
                yield
                if lease.lease_id not in self._stepping:
                    raise NotFound(f"engine {clip(info.engine_id)} was unregistered during "
                                   "the reserve")
            step = min(STEP_BLOCKS, want - start)
            room = max(0, self._blank_budget - self.blank_bytes) // size  # others took some?
            got = self._tiers.allocate_many(size, min(step, room), now, info.namespace)
            if not got:
                break
            if lease is None:
                lease = WriteLease(new_lease_id(), info.engine_id, now + self._lease_seconds,
                                   info.namespace, info.layout.block_size, size,
                                   [None] * want, [None] * want, blank=True, asked=count)
                self._leases.add(lease)
                self._stepping.add(lease.lease_id)
            lease.slots[granted:granted + len(got)] = got
            granted += len(got)
            self.blank_bytes += len(got) * size
            self._held(info, "blank", len(got))
            if len(got) < step:
                break  # no more room
        if lease is None:  # nothing granted: no lease, nothing kept per slot asked for
            return self._empty(count, now)
        self._stepping.discard(lease.lease_id)
        return Reservation(lease.lease_id, lease.deadline,
                           [*lease.slots, *[None] * (count - want)], [False] * count,
                           self._lease_seconds)

    def _empty(self, count: int, now: float) -> Reservation:
        """The reservation of ``count`` entries without a slot: the empty lease, not stored."""
        return Reservation(EMPTY_LEASE, now + self._lease_seconds, [None] * count,
                           [False] * count, self._lease_seconds)

    def commit_steps(self, lease_id: str, checksums: Sequence[int | None],
                     engine_id: str | None, names: Sequence[BlockHash] = ()) -> Steps[int]:
        """``NodeStore.commit`` in steps: publish the checksummed slots, free the others. The
        lease stays live until the last step, holding the slots not yet handled; if it ends
        meanwhile (expiry, unregistering) what was published stays and the rest is freed."""
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
        self._stepping.add(lease_id)
        count = 0
        for start in step_starts(len(lease.slots)):
            if start:
                yield
                if lease_id not in self._stepping:
                    break  # the lease ended meanwhile: ``free`` took the slots left
            count += self._publish(lease, hashes, checksums, start, now)
        else:
            self._stepping.discard(lease_id)
            self._leases.finish(lease_id, "committed")
            self._ended(lease)  # every slot was handed over: nothing is left to count
        return count

    def _publish(self, lease: WriteLease, hashes: Sequence[BlockHash | None],
                 checksums: Sequence[int | None], start: int, now: float) -> int:
        """One step of a commit: publish or free the lease's slots from ``start`` (at most
        ``STEP_BLOCKS``), taking each out of the lease; one ``BlockStored`` per consecutive run
        (listeners count each step's before the next). Returns the blocks stored."""
        t, blank, ns = self._tiers, lease.blank, lease.namespace
        run, count = _Run(), 0
        taken: list[int | None] = []
        unused: list[int] = []  # freed at the step's end, in one call
        for i in range(start, min(len(lease.slots), start + STEP_BLOCKS)):
            block_hash, slot, checksum = hashes[i], lease.slots[i], checksums[i]
            if slot is not None:
                lease.slots[i] = None
                taken.append(slot)
                key = make_key(ns, block_hash) if block_hash is not None else None
                if not blank:
                    del self.writing[key]  # type: ignore[arg-type]  # named at Reserve
                elif key is not None and (key in self.writing or key in t.dram or (
                        t.ssd_up and key in t.disk)):
                    key = None  # stored already (or being written): stored once
                if key is None or checksum is None:
                    unused.append(slot)
                else:
                    assert block_hash is not None
                    if blank:
                        t.note_restore(key, now)
                    t.add_dram(key, DramBlock(ns, block_hash, lease.slot_bytes, slot, checksum,
                                              created=now, last_access=now))
                    run.add(block_hash, hashes[i - 1] if i > 0 else None)
                    count += 1
                    continue
            run.emit(t, lease)
        run.emit(t, lease)
        t.free_slots(lease.slot_bytes, unused)
        if taken:  # handed over: no longer held by the lease, nor counted against its tenant
            handed = dataclasses.replace(lease, slots=taken)
            self._unblank(handed)
            self._ended(handed)
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
        self._check_idle(lease_id)
        self._leases.finish(lease_id, "aborted")
        self.free(lease)

    def free(self, lease: WriteLease) -> None:
        """Free the slots of an already finished write lease (aborted, expired, unregistered)."""
        self._stepping.discard(lease.lease_id)  # a reserve or commit in steps stops there
        self._unblank(lease)
        for block_hash, slot in zip(lease.hashes, lease.slots):
            if slot is not None and block_hash is not None:
                del self.writing[make_key(lease.namespace, block_hash)]
        self._tiers.free_slots(lease.slot_bytes, [s for s in lease.slots if s is not None])
        self._ended(lease)

    def _unblank(self, lease: WriteLease) -> None:
        """A blank lease ended: its slots no longer count against the budget."""
        if lease.blank:
            self.blank_bytes -= lease.slot_bytes * (len(lease.slots) - lease.slots.count(None))

    def _check_idle(self, lease_id: str) -> None:
        """FailedPrecondition if the lease is being reserved or committed in steps."""
        if lease_id in self._stepping:
            raise FailedPrecondition(f"lease {clip(lease_id)} is being committed: wait for that "
                                     "Commit's answer")

    def _write_lease(self, lease_id: str, engine_id: str | None, entries: int,
                     what: str) -> WriteLease:
        """The live reservation a Commit names, after expiring overdue leases; ``entries``
        (each a ``what``) must match its hashes (ValueError), a read lease is
        FailedPrecondition."""
        self._expire(self._clock())
        lease = self._leases.get(lease_id, engine_id)
        if not isinstance(lease, WriteLease):
            raise FailedPrecondition(f"lease {clip(lease_id)} is a read lease: release it")
        self._check_idle(lease_id)
        if entries != lease.flags:
            raise ValueError(f"commit needs one {what} per reserved "
                             f"{'slot' if lease.blank else 'hash'}: {entries} given, "
                             f"{lease.flags} reserved")
        return lease


class _Run:
    """The consecutive blocks a commit stored last, announced as one ``BlockStored``."""

    def __init__(self) -> None:
        self.hashes: list[BlockHash] = []
        self.parent: BlockHash | None = None

    def add(self, block_hash: BlockHash, before: BlockHash | None) -> None:
        if not self.hashes:
            self.parent = before
        self.hashes.append(block_hash)

    def emit(self, tiers: TierIndex, lease: WriteLease) -> None:
        """Announce the run, if any, and start a new one."""
        if self.hashes:
            tiers.emit(BlockStored(tuple(self.hashes), self.parent, "dram", lease.block_size),
                       lease.namespace)
            self.hashes = []


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
