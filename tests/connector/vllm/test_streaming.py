"""Streamed loads (vllm/connector/streaming.py) against a real daemon whose blocks sit on SSD:
chunked Acquires, copies in order, failures, aborts, leases."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
import torch

from tierd.connector.core.arena_slots import ArenaSlots
from tierd.connector.native.verified_copy import BlockRows
from tierd.connector.vllm.connector import streaming
from tierd.connector.vllm.connector.metadata import LoadSpec
from tierd.connector.vllm.connector.streaming import StreamedLoad, Streams
from tierd.types import BlockHash
from tierd.wire.arena import ShmArena
from tierd.wire.client import EngineHandle, TierdClient
from tierd.wire.layout import Layout

LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_size=16,
                model_id="test-model@0")
BLOCK_BYTES = LAYOUT.block_bytes  # 16 KiB
BLOCKS = 10


class Rig:
    """Ten blocks stored through the daemon and demoted to its SSD, an engine pool to load them
    into, and the engine's view of the arena."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.client = TierdClient(socket_path=daemon.config.socket_path, timeout=10)
        self.engine: EngineHandle = self.client.register_engine(LAYOUT, "stream-test")
        arena = ShmArena.attach(self.engine.arena_name, directory=self.engine.arena_directory)
        self.arena = arena.as_tensor()
        arena.close()
        self.slots = ArenaSlots(self.arena, self.engine.geometry)
        self.data = torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
        self.hashes = [BlockHash(os.urandom(32)) for _ in range(BLOCKS)]
        reserved = self.client.reserve(self.engine.engine_id, self.hashes)
        slot_ids = [s for s in reserved.slot_ids if s is not None]
        self.slots.write(slot_ids, self.data)
        self.client.commit(self.engine.engine_id, reserved.lease_id, [True] * BLOCKS)
        daemon.maintain()
        assert self.client.lookup(self.engine.engine_id, self.hashes) == ["ssd"] * BLOCKS
        self.pool = torch.zeros(BLOCKS + 2, BLOCK_BYTES, dtype=torch.uint8)
        self.rows = BlockRows.of(self.pool)

    def copy_in(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
                block_ids: Sequence[int]) -> int:
        good = slots.load_verified(slot_ids, checksums, self.rows, block_ids, threads=1)
        assert good is not None, "the native helper is built on these hosts"
        return good

    def spec(self) -> LoadSpec:
        """All ten blocks into pool rows 2..11."""
        return LoadSpec("r", list(range(2, BLOCKS + 2)), [bytes(h) for h in self.hashes],
                        stream=True)

    def pinned(self) -> int:
        return sum(t.pinned_blocks for t in self.client.stats().tiers)

    def close(self) -> None:
        try:
            self.client.unregister_engine(self.engine.engine_id)
        except grpc.RpcError:  # the daemon was stopped by the test
            pass
        self.client.close()


@pytest.fixture
def rig(make_daemon: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 3 * BLOCK_BYTES)  # chunks of 3, 3, 3, 1
    made = Rig(make_daemon())
    yield made
    made.close()


class FnSink:
    """A synchronous load sink (``core.load.Sink``) that copies with ``place``."""

    def __init__(self, place: Callable[..., int]) -> None:
        self.place = place

    def settle(self) -> None:
        pass


def _run(rig: Rig, copy_in: Callable[..., int], before_wait: Callable[[Streams], None]
         = lambda s: None) -> StreamedLoad:
    streams = Streams(TierdClient(socket_path=rig.daemon.config.socket_path, timeout=10),
                      FnSink(copy_in), BLOCK_BYTES)
    try:
        streams.start(rig.spec(), rig.engine.engine_id, rig.slots)
        before_wait(streams)
        for _ in range(2000):  # readiness wait: the disk reads and copies finish
            ended = streams.take_finished()
            if ended:
                assert len(ended) == 1 and not streams.busy
                return ended[0]
            time.sleep(0.005)
        raise AssertionError("the streamed load never ended")
    finally:
        streams.close()


def test_every_chunk_is_read_copied_and_released(rig: Rig) -> None:
    """Four chunks (3, 3, 3, 1 blocks) of SSD blocks land bit-exact in pool rows 2-11, in chunk
    order; no lease is left and the rows outside the load stay untouched."""
    order: list[list[int]] = []

    def copy_in(*args: Any) -> int:
        order.append(list(args[3]))
        return rig.copy_in(*args)

    load = _run(rig, copy_in)
    assert load.placed == BLOCKS and not load.cancelled
    assert order == [[2, 3, 4], [5, 6, 7], [8, 9, 10], [11]]
    assert torch.equal(rig.pool[2:], rig.data)
    assert int(rig.pool[:2].sum()) == 0
    assert rig.pinned() == 0


def test_a_block_that_does_not_verify_ends_the_load_there(rig: Rig) -> None:
    """Block 4's checksum is wrong: blocks 0-3 are placed, the chunks after block 4's are released
    uncopied, the daemon re-checks block 4 (a false report: it keeps it), no lease is left."""
    def copy_in(slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
                block_ids: Sequence[int]) -> int:
        if block_ids[0] == 5:  # the second chunk: blocks 3-5, block 4 is its second
            checksums = [checksums[0], checksums[1] ^ 1, *checksums[2:]]
        return rig.copy_in(slots, slot_ids, checksums, block_ids)

    load = _run(rig, copy_in)
    assert load.placed == 4
    assert torch.equal(rig.pool[2:6], rig.data[:4])
    assert int(rig.pool[8:].sum()) == 0  # chunks 3 and 4: never copied
    assert rig.pinned() == 0
    assert rig.client.lookup(rig.engine.engine_id, rig.hashes) == ["dram"] * BLOCKS


def test_cancel_stops_copying_and_releases_the_rest(rig: Rig) -> None:
    """vLLM aborts the request while the first chunk is being copied: the load ends after it
    (cancelled, 3 blocks placed), the other chunks' leases are released uncopied."""
    copying, resume = threading.Event(), threading.Event()

    def copy_in(*args: Any) -> int:
        copying.set()
        assert resume.wait(30)
        return rig.copy_in(*args)

    def cancel(streams: Streams) -> None:
        assert copying.wait(30)
        streams.cancel(["r"])
        resume.set()

    load = _run(rig, copy_in, cancel)
    assert load.cancelled and load.placed == 3
    assert int(rig.pool[5:].sum()) == 0
    for _ in range(200):  # readiness wait: the last Releases land
        if rig.pinned() == 0:
            break
        time.sleep(0.01)
    assert rig.pinned() == 0


def test_a_copy_that_raises_ends_the_load_and_releases_everything(rig: Rig) -> None:
    """The second chunk's copy raises (a bug): the load still ends (3 blocks placed, the error
    logged), and every chunk's lease is released, the failed one's too."""
    def copy_in(*args: Any) -> int:
        if args[3][0] == 5:
            raise RuntimeError("copy bug")
        return rig.copy_in(*args)

    load = _run(rig, copy_in)
    assert load.placed == 3
    assert rig.pinned() == 0


def test_a_daemon_that_went_away_fails_the_load(rig: Rig) -> None:
    """The Acquires fail (the daemon stopped): nothing placed, the load still ends (vLLM must
    hear of it to free the blocks)."""
    streams = Streams(TierdClient(socket_path=rig.daemon.config.socket_path, timeout=2),
                      FnSink(rig.copy_in), BLOCK_BYTES)
    rig.daemon.stop()
    try:
        streams.start(rig.spec(), rig.engine.engine_id, rig.slots)
        for _ in range(1000):
            ended = streams.take_finished()
            if ended:
                break
            time.sleep(0.005)
        assert [load.placed for load in ended] == [0]
        assert int(rig.pool.sum()) == 0
    finally:
        streams.close()
