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


def acquire(client: TierdClient, engine_id: str, hashes: Sequence[BlockHash], *, clock: Clock,
            count_lookup: bool = False) -> Lease:
    """One Acquire round trip: the leading blocks of ``hashes`` the daemon holds, pinned (SSD
    blocks are staged into DRAM first, so this may wait for a disk). ``count_lookup``: the
    daemon counts the call as a Lookup too. Raises ``grpc.RpcError`` (classify it with
    ``DaemonLink.failed``)."""
    asked = clock()
    return Lease.of(engine_id, client.acquire(engine_id, hashes, count_lookup=count_lookup),
                    asked)


@dataclass(frozen=True, slots=True)
class PendingLease:
    """An Acquire sent without waiting (``acquire_async``): ``wait`` for its ``Lease``."""

    engine_id: str
    asked: float
    reply: Future[AcquiredBlocks]

    def wait(self) -> Lease:
        """Block for the answer; raises ``grpc.RpcError`` like ``acquire``."""
        return Lease.of(self.engine_id, self.reply.result(), self.asked)


def acquire_async(client: TierdClient, engine_id: str, hashes: Sequence[BlockHash], *,
                  clock: Clock, count_lookup: bool = False,
                  dram_run_only: bool = False) -> PendingLease:
    """Send an Acquire and return at once (the daemon stages SSD blocks meanwhile);
    ``count_lookup`` as for ``acquire``; ``dram_run_only``: the leading DRAM run alone, the
    tiers of the held rest in the reply's ``held_after`` (``TierdClient.acquire_async``)."""
    return PendingLease(engine_id, clock(),
                        client.acquire_async(engine_id, hashes, count_lookup=count_lookup,
                                             dram_run_only=dram_run_only))


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
