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
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from tierd.daemon.errors import FailedPrecondition, NotFound, clip
from tierd.types import BlockHash, Namespace, NamespacedKey

Ending = Literal["released", "committed", "aborted", "expired", "unregistered"]


@dataclass(slots=True)
class ReadLease:
    """Pins one DRAM block per key (one ``pins`` count each) until released or expired."""

    lease_id: str
    engine_id: str
    deadline: float
    keys: list[NamespacedKey]


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

    @property
    def blank(self) -> bool:
        """Reserved ahead of its blocks (``NodeStore.reserve_blank``): named at commit."""
        return bool(self.hashes) and self.hashes[0] is None


Lease = ReadLease | WriteLease


def new_lease_id() -> str:
    """An unguessable id: holding it is the right to release or commit."""
    return secrets.token_hex(16)


class LeaseTable:
    """Live leases in deadline order, and how recently finished ones ended.

    Pure bookkeeping: the node store frees or publishes what a lease held.
    """

    def __init__(self, remember_seconds: float = 30.0, max_finished: int = 65_536) -> None:
        self._live: OrderedDict[str, Lease] = OrderedDict()
        self._finished: OrderedDict[str, tuple[Ending, float]] = OrderedDict()  # -> forget at
        self._remember, self._max_finished = remember_seconds, max_finished

    def __len__(self) -> int:
        return len(self._live)

    def add(self, lease: Lease) -> None:
        """Track a new lease; its deadline must not precede any live one's."""
        if self._live:
            last = next(reversed(self._live.values()))
            assert lease.deadline >= last.deadline, (
                f"lease deadlines must be issued in order ({lease.deadline} < {last.deadline}): "
                "one duration per node and a monotonic clock")
        self._live[lease.lease_id] = lease

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
