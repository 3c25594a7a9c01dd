"""``Lease``: blocks the daemon pinned for one engine (an Acquire), and its Release.

A lease keeps its blocks' DRAM slots from being evicted or reused until it is released or its
time runs out. ``deadline`` is on the engine's clock and conservative: the time the Acquire was
*sent* plus the lifetime the daemon granted, so while ``clock() < deadline`` the daemon surely
still holds the lease (``core.load`` checks it after every copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from tierd.types import BlockHash
from tierd.wire.client import AcquiredBlocks, TierdClient

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Lease:
    """A pinned prefix of a chain: ``slot_ids[i]`` holds block ``i``, whose bytes must hash to
    ``checksums[i]`` (``tierd.checksum.block_checksum``)."""

    engine_id: str
    lease_id: str
    slot_ids: list[int]
    checksums: list[int]
    deadline: float

    @classmethod
    def of(cls, engine_id: str, got: AcquiredBlocks, asked: float) -> Lease:
        """The lease of an Acquire answer ``got`` whose request was sent at ``asked``."""
        return cls(engine_id, got.lease_id, list(got.slot_ids), list(got.checksums),
                   asked + got.seconds_left)

    @property
    def num_blocks(self) -> int:
        """Blocks pinned (0: a miss; nothing to release)."""
        return len(self.slot_ids)


def acquire(client: TierdClient, engine_id: str, hashes: Sequence[BlockHash], *,
            clock: Clock) -> Lease:
    """One Acquire round trip: the leading blocks of ``hashes`` the daemon holds, pinned (SSD
    blocks are staged into DRAM first, so this may wait for a disk). Raises ``grpc.RpcError``
    (classify it with ``DaemonLink.failed``)."""
    asked = clock()
    return Lease.of(engine_id, client.acquire(engine_id, hashes), asked)


def probe_acquire(client: TierdClient, engine_id: str, hashes: Sequence[BlockHash], *,
                  clock: Clock) -> Lease:
    """``acquire`` for a front end that does not Lookup first: a Probe (the daemon counts the
    chain as a Lookup, pins its leading DRAM run and starts reading the SSD blocks after it);
    where held blocks follow that run, an Acquire of the whole held prefix (which finds those
    reads done or in flight), then the Probe's lease released without waiting. One round trip
    for a DRAM hit or a miss, two for an SSD hit. Raises ``grpc.RpcError`` like ``acquire``."""
    asked = clock()
    probed = client.probe(engine_id, hashes)
    lease = Lease.of(engine_id, probed, asked)
    if not probed.held_after:
        return lease
    try:
        return acquire(client, engine_id, hashes[:lease.num_blocks + len(probed.held_after)],
                       clock=clock)
    finally:
        if lease.num_blocks:  # a failed Release only leaves the run pinned until its deadline
            release_async(client, lease)


@dataclass(frozen=True, slots=True)
class PendingLease:
    """An Acquire or a Probe sent without waiting (``acquire_async``, ``probe_async``): ``wait``
    for its ``Lease``."""

    engine_id: str
    asked: float
    reply: Future[AcquiredBlocks]

    def wait(self) -> Lease:
        """Block for the answer; raises ``grpc.RpcError`` like ``acquire``."""
        return Lease.of(self.engine_id, self.reply.result(), self.asked)


def acquire_async(client: TierdClient, engine_id: str, hashes: Sequence[BlockHash], *,
                  clock: Clock) -> PendingLease:
    """Send an Acquire and return at once (the daemon stages SSD blocks meanwhile)."""
    return PendingLease(engine_id, clock(), client.acquire_async(engine_id, hashes))


def probe_async(client: TierdClient, engine_id: str, hashes: Sequence[BlockHash], *,
                clock: Clock) -> PendingLease:
    """Send a Probe and return at once: its lease pins the leading DRAM run of ``hashes``, the
    reply's ``held_after`` names the tiers of the held blocks after it, and the daemon counts
    the chain as a Lookup (``TierdClient.probe``)."""
    return PendingLease(engine_id, clock(), client.probe_async(engine_id, hashes))


def release(client: TierdClient, lease: Lease, corrupt_from: int | None = None) -> int:
    """One Release round trip; ``corrupt_from``: index of the first block that failed its
    check, so the daemon re-checks it and drops a bad copy (returns how many it dropped).
    Raises ``grpc.RpcError``: NOT_FOUND / FAILED_PRECONDITION mean the lease had ended."""
    if not lease.num_blocks:
        return 0
    return client.release(lease.engine_id, lease.lease_id, corrupt_from=corrupt_from)


def release_async(client: TierdClient, lease: Lease,
                  corrupt_from: int | None = None) -> Future[bool]:
    """``release`` without waiting: a future of whether
    the daemon dropped a bad copy, or of the ``grpc.RpcError``. The load that used the lease
    relies on its deadline alone (``core.load``)."""
    return client.release_async(lease.engine_id, lease.lease_id, corrupt_from=corrupt_from)


Release = Callable[[Lease, "int | None"], "bool | None"]
"""How a front end ends a lease after its copy: ``release(lease, corrupt_from)`` returns True
once the daemon confirmed it still held the lease, False if it had ended (or the call failed),
None if the Release was deferred (queued to a worker thread: the deadline alone decides)."""


def releaser(client: TierdClient, on_error: Callable[[grpc.RpcError], object]) -> Release:
    """A ``Release`` that calls the daemon now over ``client``; a failed call goes to
    ``on_error`` (e.g. ``lambda exc: link.failed(exc, names_lease=True)``) and counts as the
    lease having ended."""
    def now(lease: Lease, corrupt_from: int | None) -> bool:
        try:
            release(client, lease, corrupt_from)
        except grpc.RpcError as exc:
            on_error(exc)
            return False
        return True
    return now
