"""Leases: what an engine holds on the node, and until when.

A *read* lease (from ``acquire``) pins DRAM blocks so the engine can copy them out; a *write*
lease (from ``reserve``) owns arena slots the engine copies into, invisible to lookups until
``commit``. Every lease has a deadline (the node's clock + ``lease_seconds``); past it the node
frees what it held, so a crashed engine cannot pin memory forever.

All leases of one node share one duration and the clock is monotonic, so creation order is
deadline order: expiry pops from the front of one ordered dict, O(expired). Finished leases are
remembered so a late commit or release can be told *how* its lease ended, until
``remember_seconds`` past their deadline (and at most ``max_finished`` of them): memory follows
the lease rate over one lease time, not the daemon's uptime. Later, the id is simply unknown.

Live leases are capped (``LeaseCaps``): per engine, in total, and in the blocks they name all
together (a read lease's keys, a write lease's slots), so abandoned leases cannot grow the
daemon's memory past a stated bound before they expire. ``over_cap`` says which cap a new lease
would pass; the node store asks before it pins or allocates anything.
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Literal

from tierd.daemon.errors import FailedPrecondition, NotFound, ResourceExhausted
from tierd.types import BlockHash, Namespace, NamespacedKey
from tierd.wire.clip import clip

Ending = Literal["released", "committed", "aborted", "expired", "unregistered"]

EMPTY_LEASE = ""
"""The lease id of an acquire that pinned nothing or a reservation that holds no slot: never
stored (no pile of empty leases); releasing, committing or aborting it does nothing."""


@dataclass(frozen=True, slots=True)
class LeaseCaps:
    """Bounds of the live leases (each a config key of `tierd serve`)."""

    per_engine: int  # max_leases_per_engine
    total: int       # max_leases: all engines together
    blocks: int      # max_lease_keys: blocks named by live leases, all together


@dataclass(slots=True)
class ReadLease:
    """Pins one DRAM block per key (one ``pins`` count each) until released or expired.
    ``held``: a hold (its blocks not counted as served when acquired): the namespace they are
    served in and how many came from SSD, for a release that reports them loaded."""

    lease_id: str
    engine_id: str
    deadline: float
    keys: list[NamespacedKey]
    held: tuple[Namespace, int] | None = None


@dataclass(slots=True)
class WriteLease:
    """Owns ``slots[i]`` (an allocated, not yet visible arena slot) for ``hashes[i]``, or None
    where nothing is to be written. Freed by abort or expiry; published by commit."""

    lease_id: str
    engine_id: str
    deadline: float
    namespace: Namespace
    block_size: int
    slot_bytes: int
    hashes: list[BlockHash | None]  # all None: blank slots, named at commit
    slots: list[int | None]
    blank: bool = False  # reserved ahead of its blocks (``NodeStore.reserve_blank``)
    asked: int = 0       # blank: slots the Reserve asked for; only the granted ones are kept

    @property
    def flags(self) -> int:
        """Entries a Commit sends (one per hash of a named Reserve, per slot asked if blank)."""
        return self.asked if self.blank else len(self.hashes)


Lease = ReadLease | WriteLease


def _blocks(lease: Lease) -> int:
    """The blocks a lease names: what it costs the ``max_lease_keys`` cap."""
    return len(lease.keys) if isinstance(lease, ReadLease) else len(lease.slots)


def new_lease_id() -> str:
    """An unguessable id: holding it is the right to release or commit."""
    return secrets.token_hex(16)


class LeaseTable:
    """Live leases in deadline order, and how recently finished ones ended.

    Pure bookkeeping: the node store frees or publishes what a lease held.
    """

    def __init__(self, remember_seconds: float = 30.0, max_finished: int = 65_536, *,
                 per_engine: int = 1024, total: int = 16_384, blocks: int = 1 << 18) -> None:
        self._live: OrderedDict[str, Lease] = OrderedDict()
        self._finished: OrderedDict[str, tuple[Ending, float]] = OrderedDict()  # -> forget at
        self._remember, self._max_finished = remember_seconds, max_finished
        self.caps = LeaseCaps(per_engine, total, blocks)
        self._per_engine: Counter[str] = Counter()  # engine id -> live leases (no zero entries)
        self.blocks = 0  # blocks named by live leases (``_blocks``)

    def __len__(self) -> int:
        return len(self._live)

    def over_cap(self, engine_id: str, blocks: int) -> str | None:
        """Why a new lease of ``engine_id`` naming ``blocks`` blocks would pass a cap (a
        message naming the cap and its option), or None if it fits."""
        caps = self.caps
        if self._per_engine[engine_id] >= caps.per_engine:
            return (f"engine {clip(engine_id)} holds {self._per_engine[engine_id]} live leases, "
                    f"the cap (max_leases_per_engine = {caps.per_engine}): release, commit or "
                    "abort leases it is done with, or raise TIERD_MAX_LEASES_PER_ENGINE")
        if len(self._live) >= caps.total:
            return (f"{len(self._live)} live leases on this node, the cap (max_leases = "
                    f"{caps.total}): release, commit or abort leases, or raise TIERD_MAX_LEASES")
        if self.blocks + blocks > caps.blocks:
            return (f"live leases name {self.blocks} blocks and this one {blocks}, past the cap "
                    f"(max_lease_keys = {caps.blocks}): release, commit or abort leases, or "
                    "raise TIERD_MAX_LEASE_KEYS")
        return None

    def check_room(self, engine_id: str, blocks: int) -> None:
        """ResourceExhausted (``over_cap``'s message) unless the new lease fits every cap."""
        refused = self.over_cap(engine_id, blocks)
        if refused is not None:
            raise ResourceExhausted(refused)

    def add(self, lease: Lease) -> None:
        """Track a new lease; its deadline must not precede any live one's, and it must fit
        the caps (the caller checked ``over_cap`` before taking anything for it)."""
        assert self.over_cap(lease.engine_id, _blocks(lease)) is None, "a lease past its caps"
        if self._live:
            last = next(reversed(self._live.values()))
            assert lease.deadline >= last.deadline, (
                f"lease deadlines must be issued in order ({lease.deadline} < {last.deadline}): "
                "one duration per node and a monotonic clock")
        self._live[lease.lease_id] = lease
        self._per_engine[lease.engine_id] += 1
        self.blocks += _blocks(lease)

    def get(self, lease_id: str, owner: str | None = None) -> Lease:
        """The live lease. Raises FailedPrecondition if it already ended (saying how),
        NotFound if it never existed (or ended too long ago to remember) or, with ``owner``,
        belongs to another engine (the same answer, so lease ids leak nothing across tenants)."""
        lease = self._live.get(lease_id)
        if lease is not None and owner is not None and lease.engine_id != owner:
            raise NotFound(f"unknown lease {clip(lease_id)}")
        if lease is not None:
            return lease
        ending = self.ending(lease_id)
        if ending is not None:
            raise FailedPrecondition(f"lease {clip(lease_id)} already {ending}")
        raise NotFound(f"unknown lease {clip(lease_id)}")

    def ending(self, lease_id: str) -> Ending | None:
        """How a recently finished lease ended, or None (live or unknown)."""
        found = self._finished.get(lease_id)
        return None if found is None else found[0]

    def finish(self, lease_id: str, ending: Ending) -> Lease:
        """Stop tracking a live lease and remember how it ended; returns it."""
        lease = self._live.pop(lease_id)
        self._per_engine[lease.engine_id] -= 1
        if not self._per_engine[lease.engine_id]:
            del self._per_engine[lease.engine_id]
        self.blocks -= _blocks(lease)
        self._finished[lease_id] = (ending, lease.deadline + self._remember)
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)
        return lease

    def pop_expired(self, now: float) -> list[Lease]:
        """Finish (as "expired") and return every lease whose deadline is <= ``now``; forget
        finished leases ``remember_seconds`` past their deadline (oldest finished first)."""
        finished = self._finished
        while finished and next(iter(finished.values()))[1] <= now:
            finished.popitem(last=False)
        expired: list[Lease] = []
        while self._live:
            lease = next(iter(self._live.values()))
            if lease.deadline > now:
                break
            expired.append(self.finish(lease.lease_id, "expired"))
        return expired

    def of_engine(self, engine_id: str) -> list[Lease]:
        """Live leases held by one engine, oldest first."""
        return [lease for lease in self._live.values() if lease.engine_id == engine_id]

    def live(self) -> list[Lease]:
        """Every live lease, oldest first."""
        return list(self._live.values())

    def check_integrity(self) -> None:
        """Assert the per-engine and block counts match the live leases and every cap holds
        (``max_leases_per_engine``, ``max_leases``, ``max_lease_keys``), and the memory of
        finished leases is within ``max_finished``."""
        per_engine = Counter(lease.engine_id for lease in self._live.values())
        assert per_engine == self._per_engine, "per-engine lease counts disagree"
        assert self.blocks == sum(_blocks(lease) for lease in self._live.values()), (
            "lease block count disagrees with the live leases")
        assert all(n <= self.caps.per_engine for n in per_engine.values()), (
            "an engine holds more leases than max_leases_per_engine")
        assert len(self._live) <= self.caps.total, "more live leases than max_leases"
        assert self.blocks <= self.caps.blocks, "live leases name more than max_lease_keys"
        assert len(self._finished) <= self._max_finished, "finished-lease memory over its bound"
