"""Bounds over gRPC: a request past a cap of the daemon's tables gets RESOURCE_EXHAUSTED (or a
bad layout INVALID_ARGUMENT) naming the limit and its option, and the daemon keeps serving."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from tierd.v1 import tierd_pb2 as pb
from tierd.wire.layout import Layout


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_abandoned_acquires_get_resource_exhausted_naming_the_cap(make_daemon: Any,
                                                                  kit: Any) -> None:
    """An engine that never releases gets RESOURCE_EXHAUSTED naming max_leases_per_engine at
    its third Acquire(dram_run_only); another engine still loads."""
    daemon = make_daemon(max_leases_per_engine=2)
    hashes = kit.chain(4)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes) == 4
        for _ in range(2):
            client.acquire(engine.engine_id, hashes, dram_run_only=True)
        code, details = status_of(lambda: client.acquire(engine.engine_id, hashes,
                                                          dram_run_only=True))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_leases_per_engine = 2" in details and "TIERD_MAX_LEASES_PER_ENGINE" in details
        other = client.register_engine(kit.layout)
        got = client.acquire(other.engine_id, hashes)
        assert len(got.slot_ids) == 4
        client.release(other.engine_id, got.lease_id)
        arena.close()
    daemon.check_integrity()


def test_filtered_query_tokens_with_blank_slots_is_invalid_argument(daemon: Any) -> None:
    """A Reserve of blank slots that also reports filtered query tokens (which only a named
    Reserve counts) is INVALID_ARGUMENT, not silently dropped; no slot is held."""
    with daemon.client() as client:
        engine = client.register_engine(Layout(2, 2, 16, "float16", 16, model_id="m@0"))
        code, details = status_of(lambda: client._call("Reserve", pb.ReserveRequest(
            engine_id=engine.engine_id, blank_slots=4, filtered_query_tokens=(1 << 64) - 1)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "filtered_query_tokens" in details
        assert client.stats().tiers[1].used_blocks == 0
    daemon.check_integrity()


def test_a_reserve_of_nothing_answers_the_empty_lease(daemon: Any, kit: Any) -> None:
    """A Reserve with neither block_hashes nor blank_slots (blank_slots = 0) reserves nothing:
    an empty lease id and no slots; its Commit stores 0 and its Abort is a no-op."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        got = client.reserve(engine.engine_id, [])
        assert (got.lease_id, got.slot_ids) == ("", [])
        assert client.commit(engine.engine_id, got.lease_id, []) == 0
        client.abort(engine.engine_id, got.lease_id)
    daemon.check_integrity()


def test_a_written_flag_for_a_slot_never_granted_is_invalid_argument(daemon: Any,
                                                                     kit: Any) -> None:
    """A Commit flagging written a block the Reserve gave no slot (already stored) is
    INVALID_ARGUMENT naming the slot; the right flags then commit."""
    hashes = kit.chain(2, seed=3)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes[1:]) == 1
        got = client.reserve(engine.engine_id, hashes)
        assert got.slot_ids[1] is None
        code, details = status_of(lambda: client.commit(engine.engine_id, got.lease_id,
                                                        [True, True]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "slot #1" in details
        client.abort(engine.engine_id, got.lease_id)
        arena.close()
    daemon.check_integrity()


def test_tiny_blocks_and_extra_sizes_are_refused_at_register(make_daemon: Any) -> None:
    """A 512-byte layout is INVALID_ARGUMENT naming min_block_bytes; past max_size_classes a
    new block size is RESOURCE_EXHAUSTED naming it; a size that leaves makes room."""
    daemon = make_daemon(max_size_classes=2)
    sizes = [Layout(2, 2, 16 * k, "float16", 16, model_id="m@0") for k in (1, 2, 4)]
    with daemon.client() as client:
        code, details = status_of(lambda: client.register_engine(
            Layout(1, 1, 8, "float16", 16, model_id="m@0")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "min_block_bytes" in details
        first = client.register_engine(sizes[0])
        client.register_engine(sizes[1])
        code, details = status_of(lambda: client.register_engine(sizes[2]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_size_classes = 2" in details and "TIERD_MAX_SIZE_CLASSES" in details
        client.unregister_engine(first.engine_id)
        client.register_engine(sizes[2])
    daemon.check_integrity()


def test_block_overhead_bounds_the_blocks_held(make_daemon: Any, kit: Any,
                                               workdir: str) -> None:
    """The default 512 bytes of overhead per 4 KiB block leave a 16 MiB arena 3640 blocks; with
    4 KiB of overhead it holds 2048, not 4096: Stats says so and a Reserve of 3000 gets 2048
    slots."""
    with make_daemon().client() as client:
        client.register_engine(kit.layout)
        assert client.stats().tiers[1].capacity_blocks == (16 << 20) // (4096 + 512) == 3640
    daemon = make_daemon(block_overhead_bytes=4096, ssd_dir="",
                         socket_path=os.path.join(workdir, "second.sock"))
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        assert client.stats().tiers[1].capacity_blocks == 2048
        got = client.reserve(engine.engine_id, kit.chain(3000))
        assert sum(s is not None for s in got.slot_ids) == 2048
        client.abort(engine.engine_id, got.lease_id)
    daemon.check_integrity()
