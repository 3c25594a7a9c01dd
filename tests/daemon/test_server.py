"""The daemon over a real Unix socket: store, look up, acquire and copy out bit-exact from DRAM
and from SSD; health, reflection and stats answer."""

from __future__ import annotations

import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tierd.checksum import block_checksum
from tierd.daemon import commit_edge
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.client import AsyncTierdClient, CommitRefused


def test_register_returns_arena_and_geometry(daemon: Any, kit: Any) -> None:
    """Registering a 4 KiB-block layout returns the arena and a 64 KiB-slab geometry."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout, engine_name="tiny")
    assert engine.arena_name == daemon.daemon.arena.name
    assert engine.arena_directory == daemon.config.arena_directory
    assert engine.arena_bytes == 16 << 20
    assert (engine.geometry.slab_bytes, engine.geometry.slot_bytes,
            engine.geometry.slots_per_slab) == (64 << 10, 4096, 16)
    assert engine.lease_seconds == 30.0
    assert engine.max_blocks_per_request == 4096


def test_store_lookup_acquire_copy_out_from_dram(daemon: Any, kit: Any) -> None:
    """Eight stored blocks are a DRAM hit and copy out bit-exact; a longer chain hits its prefix
    (also as the DRAM run alone: nothing held after it)."""
    hashes = kit.chain(8)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes) == 8
        assert client.lookup(engine.engine_id, hashes + kit.chain(2, seed=9)) == ["dram"] * 8
        got = client.acquire(engine.engine_id, hashes)
        assert got.num_blocks == 8
        for key, slot, checksum in zip(hashes, got.slot_ids, got.checksums):
            data = bytes(arena.view(engine.geometry.offset(slot), engine.geometry.slot_bytes))
            assert data == kit.block_bytes(key, 4096)
            assert block_checksum(data) == checksum
        client.release(engine.engine_id, got.lease_id)
        run = client.probe(engine.engine_id, hashes + kit.chain(2, seed=9))
        assert (run.slot_ids, run.checksums, run.held_after) == (got.slot_ids, got.checksums, [])
        client.release(engine.engine_id, run.lease_id)
        arena.close()
    daemon.check_integrity()


def test_commit_with_written_flags_lets_the_daemon_checksum(daemon: Any, kit: Any) -> None:
    """A Commit naming written slots stores them under the checksum of their bytes, computed by
    the daemon; an unwritten slot is freed; blocks and flags together, or a short flag list,
    are INVALID_ARGUMENT and leave the reservation usable."""
    hashes = kit.chain(3)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        reserved = client.reserve(engine.engine_id, hashes)
        for key, slot in zip(hashes, reserved.slot_ids):
            assert slot is not None
            arena.view(engine.geometry.offset(slot), 4096)[:] = kit.block_bytes(key, 4096)
        for bad in ([True], None):
            with pytest.raises(grpc.RpcError) as err:
                if bad is None:  # the retired engine checksums
                    client._call("Commit", pb.CommitRequest(
                        engine_id=engine.engine_id, lease_id=reserved.lease_id,
                        blocks=[pb.CommittedBlock(checksum=1)] * 3))
                else:
                    client.commit(engine.engine_id, reserved.lease_id, bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.commit(engine.engine_id, reserved.lease_id, [True, True, False]) == 2
        assert client.lookup(engine.engine_id, hashes) == ["dram"] * 2
        got = client.acquire(engine.engine_id, hashes[:2])
        assert got.checksums == [block_checksum(kit.block_bytes(h, 4096)) for h in hashes[:2]]
        client.release(engine.engine_id, got.lease_id)
        arena.close()
    daemon.check_integrity()


@pytest.mark.parametrize("inline_bytes", [commit_edge.INLINE_HASH_BYTES, 0])
def test_small_and_large_commits_get_the_same_checksums(daemon: Any, kit: Any,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         inline_bytes: int) -> None:
    """Written slots are checksummed alike on the event loop (a small Commit) and on the
    hashing threads (``INLINE_HASH_BYTES`` 0: every Commit counts as large), by Commit and by
    CommitMany."""
    monkeypatch.setattr(commit_edge, "INLINE_HASH_BYTES", inline_bytes)
    hashes = kit.chain(5)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        reservations = [client.reserve(engine.engine_id, part)
                        for part in (hashes[:3], hashes[3:4], hashes[4:])]
        for reserved, part in zip(reservations, (hashes[:3], hashes[3:4], hashes[4:])):
            for key, slot in zip(part, reserved.slot_ids):
                assert slot is not None
                arena.view(engine.geometry.offset(slot), 4096)[:] = kit.block_bytes(key, 4096)
        first, *rest = reservations
        assert client.commit(engine.engine_id, first.lease_id, [True] * 3) == 3
        assert client.commit_many(engine.engine_id,
                                  [(r.lease_id, [True], ()) for r in rest]) == [1, 1]
        got = client.acquire(engine.engine_id, hashes)
        assert got.checksums == [block_checksum(kit.block_bytes(h, 4096)) for h in hashes]
        client.release(engine.engine_id, got.lease_id)
        arena.close()


def test_blank_slots_are_named_at_commit(daemon: Any, kit: Any) -> None:
    """Over the socket: Reserve of 4 blank slots, 3 written and named at the Commit (the daemon
    checksums them; one name already held is stored once, the spare slot freed); hashes with
    blank_slots, or names on a named reservation, are INVALID_ARGUMENT and change nothing."""
    held, new = kit.chain(1), kit.chain(2, seed=5)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, held) == 1
        with pytest.raises(grpc.RpcError) as err:
            client._call("Reserve", pb.ReserveRequest(engine_id=engine.engine_id,
                                                      block_hashes=new, blank_slots=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reserved = client.reserve_blank_async(engine.engine_id, 4).result()
        assert len(reserved.slot_ids) == 4 and None not in reserved.slot_ids
        names = [new[0], held[0], new[1]]
        for key, slot in zip(names, reserved.slot_ids):
            arena.view(engine.geometry.offset(slot), 4096)[:] = kit.block_bytes(key, 4096)
        named = client.reserve(engine.engine_id, kit.chain(1, seed=6))
        with pytest.raises(grpc.RpcError) as err:
            client.commit(engine.engine_id, named.lease_id, [True], names=new[:1])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        client.abort_async(engine.engine_id, named.lease_id).result()
        assert client.commit(engine.engine_id, reserved.lease_id, [True] * 3 + [False],
                             names=names) == 2
        assert client.lookup(engine.engine_id, new) == ["dram"] * 2
        got = client.acquire(engine.engine_id, new)
        assert got.checksums == [block_checksum(kit.block_bytes(h, 4096)) for h in new]
        client.release(engine.engine_id, got.lease_id)
        assert client.stats().tiers[1].used_blocks == 3
        arena.close()
    daemon.check_integrity()


def test_commit_many_lands_each_commit_on_its_own(daemon: Any, kit: Any) -> None:
    """One CommitMany of three Commits: the two live reservations store their written blocks
    (checksummed by the daemon) though the middle one names an aborted reservation (its own
    outcome, NOT_FOUND or FAILED_PRECONDITION, as a Commit alone) and a fourth names another
    engine (INVALID_ARGUMENT); more than 64 Commits is INVALID_ARGUMENT for the call."""
    first, second, gone = kit.chain(2), kit.chain(3, seed=7), kit.chain(1, seed=8)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        leases = []
        for hashes in (first, gone, second):
            reserved = client.reserve(engine.engine_id, hashes)
            for key, slot in zip(hashes, reserved.slot_ids):
                arena.view(engine.geometry.offset(slot), 4096)[:] = kit.block_bytes(key, 4096)
            leases.append(reserved.lease_id)
        client.abort(engine.engine_id, leases[1])
        outcomes = client.commit_many(engine.engine_id, [
            (leases[0], [True, True], ()), (leases[1], [True], ()),
            (leases[2], [True, False, True], ())])
        assert outcomes[0] == 2 and outcomes[2] == 2
        assert isinstance(outcomes[1], CommitRefused)
        assert outcomes[1].code() in (grpc.StatusCode.NOT_FOUND,
                                      grpc.StatusCode.FAILED_PRECONDITION)
        assert client.lookup(engine.engine_id, first) == ["dram"] * 2
        assert client.lookup(engine.engine_id, second) == ["dram"]
        got = client.acquire(engine.engine_id, first)
        assert got.checksums == [block_checksum(kit.block_bytes(h, 4096)) for h in first]
        client.release(engine.engine_id, got.lease_id)
        other = client._call("CommitMany", pb.CommitManyRequest(
            engine_id=engine.engine_id, commits=[pb.CommitRequest(engine_id="e-other",
                                                                  lease_id=leases[0])]))
        assert other.outcomes[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "leave it empty" in other.outcomes[0].message
        with pytest.raises(grpc.RpcError) as err:
            client.commit_many(engine.engine_id, [(leases[0], [], ())] * 65)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        arena.close()
    daemon.check_integrity()


def test_reserve_skips_already_stored(daemon: Any, kit: Any) -> None:
    """Reserving 3 blocks of which the first 2 are stored hands out one slot only."""
    hashes = kit.chain(3)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes[:2]) == 2
        reserved = client.reserve(engine.engine_id, hashes)
        assert reserved.already_stored == [True, True, False]
        assert reserved.slot_ids[:2] == [None, None] and reserved.slot_ids[2] is not None
        client.abort(engine.engine_id, reserved.lease_id)
        arena.close()


def test_demoted_blocks_copy_out_from_ssd(make_daemon: Any, kit: Any) -> None:
    """Blocks demoted to SSD by a maintain pass look up as "ssd", then acquire stages them into
    DRAM and they copy out bit-exact."""
    daemon = make_daemon(dram_high_watermark=1e-9, dram_low_watermark=1e-9)
    hashes = kit.chain(5)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes) == 5
        daemon.maintain()
        assert client.lookup(engine.engine_id, hashes) == ["ssd"] * 5
        got = client.acquire(engine.engine_id, hashes)
        assert got.num_blocks == 5
        for key, slot, checksum in zip(hashes, got.slot_ids, got.checksums):
            data = bytes(arena.view(engine.geometry.offset(slot), engine.geometry.slot_bytes))
            assert data == kit.block_bytes(key, 4096)
            assert block_checksum(data) == checksum
        assert client.lookup(engine.engine_id, hashes) == ["dram"] * 5
        client.release(engine.engine_id, got.lease_id)
        stats = client.stats()
        arena.close()
    dram, ssd = stats.tiers[1], stats.tiers[2]
    assert (dram.tier, dram.demotions, ssd.tier, ssd.promotions) == ("dram", 5, "ssd", 5)
    daemon.check_integrity()


def test_hot_blocks_reported_show_as_hbm(daemon: Any, kit: Any) -> None:
    """Blocks an engine reports in its GPU pool look up as "hbm" and count in its stats row."""
    hashes = kit.chain(4)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout, engine_name="gpu0")
        client.report_hot_blocks(engine.engine_id, stored=hashes[:3])
        assert client.lookup(engine.engine_id, hashes) == ["hbm"] * 3
        client.report_hot_blocks(engine.engine_id, removed=hashes[2:3])
        stats = client.stats()
    assert [(e.engine_id, e.engine_name, e.hbm_blocks) for e in stats.engines] == [
        (engine.engine_id, "gpu0", 2)]


def test_stats_counts_queries_and_hits(daemon: Any, kit: Any) -> None:
    """Looking up 4 blocks of which 2 are stored counts 64 queried and 32 hit tokens."""
    hashes = kit.chain(4)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        kit.store_blocks(client, engine, arena, hashes[:2])
        client.lookup(engine.engine_id, hashes)
        stats = client.stats()
        arena.close()
    assert (stats.query_tokens, stats.hit_tokens, stats.hit_ratio) == (64, 32, 0.5)
    assert [t.tier for t in stats.tiers] == ["hbm", "dram", "ssd"]
    dram = stats.tiers[1]
    assert (dram.used_blocks, dram.used_bytes, dram.pinned_blocks) == (2, 8192, 0)
    assert stats.ssd_healthy is True
    assert "0.50" in stats.reading


def test_prometheus_endpoint_serves_node_metrics(make_daemon: Any, kit: Any) -> None:
    """With a metrics port, /metrics on loopback shows the lookup's query tokens and its
    RPC latency sample."""
    daemon = make_daemon(metrics_port=0)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        client.lookup(engine.engine_id, kit.chain(3))
    url = f"http://127.0.0.1:{daemon.daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    assert "tierd_prefix_cache_queries_total 48.0" in text
    assert 'tierd_rpc_latency_seconds_count{method="Lookup"} 1.0' in text


def test_health_and_reflection_answer(daemon: Any) -> None:
    """Health says SERVING for the server and for tierd.v1.Tierd; reflection lists the services."""
    with grpc.insecure_channel(f"unix:{daemon.config.socket_path}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tierd.v1.Tierd"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=5)))
    names = sorted(s.name for s in reply.list_services_response.service)
    assert names == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                     "tierd.v1.Tierd"]


async def test_async_client_round_trip(daemon: Any, kit: Any) -> None:
    """AsyncTierdClient registers, stores through the arena, looks up and acquires 3 blocks."""
    hashes = kit.chain(3)
    async with AsyncTierdClient(socket_path=daemon.config.socket_path) as client:
        await client.wait_ready(timeout=10)
        engine = await client.register_engine(kit.layout)
        arena = kit.attach(engine)
        reserved = await client.reserve(engine.engine_id, hashes)
        checksums: list[int | None] = []
        for key, slot in zip(hashes, reserved.slot_ids):
            assert slot is not None
            data = kit.block_bytes(key, 4096)
            arena.view(engine.geometry.offset(slot), 4096)[:] = data
            checksums.append(block_checksum(data))
        assert await client.commit(engine.engine_id, reserved.lease_id, [True] * 3) == 3
        assert await client.lookup(engine.engine_id, hashes) == ["dram"] * 3
        got = await client.acquire(engine.engine_id, hashes)
        assert got.checksums == checksums
        await client.release(engine.engine_id, got.lease_id)
        assert (await client.stats()).tiers[1].used_blocks == 3
        await client.unregister_engine(engine.engine_id)
        arena.close()


def test_the_daemon_keeps_no_event_log(daemon: Any, kit: Any) -> None:
    """`tierd serve` never drains take_events, so its store keeps none: after storing and
    loading blocks the log is empty (it grew without bound before)."""
    hashes = kit.chain(8)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes) == 8
        client.release(engine.engine_id, client.acquire(engine.engine_id, hashes).lease_id)
        arena.close()

    async def take() -> list[Any]:
        return daemon.daemon.store.take_events()
    assert daemon.call(take()) == []
