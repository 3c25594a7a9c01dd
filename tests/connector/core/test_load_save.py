"""The core's one load and one save against a real daemon: Reserve, write, Commit with written
flags (the daemon checksums); ``load_leased`` into a host pool through ``PoolRows``: exact bytes,
the first bad block reported (``corrupt_from``) and dropped by the daemon, and the
lease-outlives-copy rule (the engine's deadline, the daemon's answer to the Release)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from tierd.checksum import block_checksum
from tierd.connector.core.lease import Lease, acquire, releaser
from tierd.connector.core.link import DaemonLink
from tierd.connector.core.load import load_leased
from tierd.connector.core.save import abort, commit, reserve, write_rows
from tierd.connector.core.settings import ClientSettings
from tierd.connector.core.sinks import PoolRows
from tierd.types import BlockHash
from tierd.wire.layout import Layout

LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_size=16,
                model_id="core-test@0")
BLOCK = LAYOUT.block_bytes


class Rig:
    """A daemon, a link with the arena attached, four blocks of random bytes stored through the
    core's save, and a host pool of 8 rows to load into."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.link = DaemonLink(ClientSettings(socket_path=daemon.config.socket_path,
                                              timeout_seconds=10), LAYOUT, "core", attach=True)
        assert self.link.connect()
        self.data = torch.randint(0, 256, (4, BLOCK), dtype=torch.uint8)
        self.hashes = [BlockHash(os.urandom(32)) for _ in range(4)]
        reservation = reserve(self.link.client, self.link.engine.engine_id, self.hashes)
        write_rows(self.link.slots, reservation.slot_ids, self.data)
        assert commit(self.link.client, reservation, reservation.all_written()) == 4
        self.pool = torch.zeros(8, BLOCK, dtype=torch.uint8)
        self.sink = PoolRows(self.pool, staging_rows=2)
        self.released: list[int | None] = []

    def lease(self, clock: Any = time.monotonic) -> Lease:
        return acquire(self.link.client, self.link.engine.engine_id, self.hashes, clock=clock)

    def release(self, lease: Lease, corrupt_from: int | None) -> bool | None:
        self.released.append(corrupt_from)
        return releaser(self.link.client, lambda exc: self.link.failed(exc, names_lease=True))(
            lease, corrupt_from)

    def pinned(self) -> int:
        return sum(t.pinned_blocks for t in self.link.client.stats().tiers)


@pytest.fixture
def rig(make_daemon: Any) -> Iterator[Rig]:
    made = Rig(make_daemon())
    yield made
    made.link.close()


def test_saved_blocks_load_bit_exact_under_daemon_checksums(rig: Rig) -> None:
    """The four saved blocks carry the checksums of their bytes (computed by the daemon) and
    land in pool rows 5, 1, 2, 7; the other rows stay zero, no lease is left."""
    lease = rig.lease()
    assert lease.checksums == [block_checksum(r.numpy().tobytes()) for r in rig.data]
    done = load_leased(lease, [5, 1, 2, 7], rig.link.slots, rig.sink, rig.release,
                       time.monotonic)
    assert (done.placed, done.verified, done.acquired, done.lease_lost) == (4, 4, 4, False)
    assert torch.equal(rig.pool[[5, 1, 2, 7]], rig.data) and rig.released == [None]
    assert int(rig.pool[[0, 3, 4, 6]].sum()) == 0 and rig.pinned() == 0


def test_a_bad_block_ends_the_load_and_the_daemon_drops_it(rig: Rig) -> None:
    """Block 2's slot is damaged after its Commit: blocks 0-1 are placed, the Release names
    block 2, the daemon re-checks and drops it (a later lookup stops before it)."""
    lease = rig.lease()
    offset = rig.link.engine.geometry.offset(lease.slot_ids[2])
    rig.link.arena_tensor[offset] ^= 0xFF
    done = load_leased(lease, [0, 1, 2, 3], rig.link.slots, rig.sink, rig.release,
                       time.monotonic)
    assert (done.placed, done.corrupt, rig.released) == (2, True, [2])
    assert torch.equal(rig.pool[:2], rig.data[:2])
    assert rig.link.client.lookup(rig.link.engine.engine_id, rig.hashes) == ["dram", "dram"]


def test_a_copy_done_past_the_deadline_counts_for_nothing(rig: Rig) -> None:
    """The engine's clock passes the lease's deadline during the copy: nothing is placed
    (lease_lost), the lease is still released; with the Release deferred (None) too."""
    ticks = itertools.chain([time.monotonic()], itertools.repeat(time.monotonic() + 1e6))
    clock = lambda: next(ticks)  # noqa: E731 - the Acquire's time, then far later
    done = load_leased(rig.lease(clock), [0, 1, 2, 3], rig.link.slots, rig.sink, rig.release,
                       clock)
    assert (done.placed, done.verified, done.lease_lost) == (0, 4, True)
    assert rig.released == [None] and rig.pinned() == 0
    lease = rig.lease()
    deferred = load_leased(lease, [0, 1], rig.link.slots, rig.sink, lambda lease, bad: None,
                           lambda: lease.deadline)
    assert (deferred.placed, deferred.lease_lost) == (0, True)
    rig.release(lease, None)


def test_a_sink_that_raises_still_releases_the_lease(rig: Rig) -> None:
    """A copy that fails with an unexpected error (not the ValueError of bad slot ids): its
    reads are settled, the lease released, and the error reaches the caller."""
    settled: list[bool] = []

    class Broken:
        def place(self, *args: object) -> int:
            raise RuntimeError("copy failed")

        def settle(self) -> None:
            settled.append(True)

    with pytest.raises(RuntimeError, match="copy failed"):
        load_leased(rig.lease(), [0, 1, 2, 3], rig.link.slots, Broken(), rig.release,
                    time.monotonic)
    assert settled == [True] and rig.released == [None] and rig.pinned() == 0


def test_a_lease_the_daemon_ended_fails_the_load(rig: Rig) -> None:
    """The daemon's clock jumps past the lease before the Release: the Release answers that the
    lease ended, so the verified copy counts for nothing; the link stays up."""
    store = rig.daemon.daemon.store
    real = store._clock
    lease = rig.lease()
    store._clock = lambda: real() + 1e6
    try:
        done = load_leased(lease, [0, 1, 2, 3], rig.link.slots, rig.sink, rig.release,
                           time.monotonic)
    finally:
        store._clock = real
    assert (done.placed, done.verified, done.lease_lost) == (0, 4, True) and rig.link.up


def test_unwritten_blocks_are_not_stored_and_abort_frees_the_slots(rig: Rig) -> None:
    """A Commit flagging only block 1 of 3 stores block 1 alone; an aborted reservation frees
    its slots (the same blocks can be reserved again)."""
    client, engine_id = rig.link.client, rig.link.engine.engine_id
    fresh = [BlockHash(os.urandom(32)) for _ in range(3)]
    reservation = reserve(client, engine_id, fresh)
    write_rows(rig.link.slots, reservation.slot_ids, rig.data[:3])
    assert commit(client, reservation, [False, True, False]) == 1
    assert client.lookup(engine_id, fresh[1:2]) == ["dram"]
    other = [BlockHash(os.urandom(32)) for _ in range(2)]
    aborted = reserve(client, engine_id, other)
    abort(client, aborted)
    with pytest.raises(grpc.RpcError) as info:
        commit(client, aborted, aborted.all_written())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    again = reserve(client, engine_id, other)
    assert all(s is not None for s in again.slot_ids)
    abort(client, again)
