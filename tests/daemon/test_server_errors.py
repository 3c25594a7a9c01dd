"""Every bad input gets its precise status code, and the daemon keeps serving afterwards."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from tierd.daemon.server import ErrorInterceptor
from tierd.types import BlockHash
from tierd.wire.layout import Layout


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def still_serving(daemon: Any, kit: Any) -> None:
    """A good store + lookup works after the bad call."""
    hashes = kit.chain(2, seed=200)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes) == 2
        assert client.lookup(engine.engine_id, hashes) == ["dram", "dram"]
        arena.close()
    daemon.check_integrity()


def test_malformed_request_is_invalid_argument(daemon: Any, kit: Any) -> None:
    """Bytes that are not a LookupRequest get INVALID_ARGUMENT naming the method."""
    with grpc.insecure_channel(f"unix:{daemon.config.socket_path}") as channel:
        lookup = channel.unary_unary("/tierd.v1.Tierd/Lookup")
        with pytest.raises(grpc.RpcError) as info:
            lookup(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed Lookup request" in info.value.details()
    still_serving(daemon, kit)


def test_bad_layout_is_invalid_argument(daemon: Any, kit: Any) -> None:
    """A layout with zero layers or an unknown dtype gets INVALID_ARGUMENT."""
    with daemon.client() as client:
        bad = Layout(num_layers=0, num_kv_heads=2, head_size=16, dtype="float16", block_size=16,
                     model_id="m@0")
        assert code_of(lambda: client.register_engine(bad)) == grpc.StatusCode.INVALID_ARGUMENT
        bad = Layout(num_layers=2, num_kv_heads=2, head_size=16, dtype="int4",  # type: ignore[arg-type]
                     block_size=16, model_id="m@0")
        assert code_of(lambda: client.register_engine(bad)) == grpc.StatusCode.INVALID_ARGUMENT
        # An engine that names no model (a connector from before model identity) is refused:
        # shape is not identity, so it could be handed another model's blocks.
        bad = Layout(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16", block_size=16)
        assert code_of(lambda: client.register_engine(bad)) == grpc.StatusCode.INVALID_ARGUMENT
        bad = Layout(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16", block_size=16,
                     model_id="no spaces|or bars")
        assert code_of(lambda: client.register_engine(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    still_serving(daemon, kit)


def test_block_larger_than_a_slab_is_resource_exhausted(daemon: Any, kit: Any) -> None:
    """A 128 KiB block cannot fit a 64 KiB slab: RESOURCE_EXHAUSTED at registration."""
    huge = Layout(num_layers=64, num_kv_heads=2, head_size=16, dtype="float16", block_size=16,
                  model_id="m@0")
    with daemon.client() as client:
        assert code_of(lambda: client.register_engine(huge)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_serving(daemon, kit)


def test_wrong_hash_length_is_invalid_argument(daemon: Any, kit: Any) -> None:
    """A 20-byte hash, or 32- and 16-byte hashes mixed in one chain, get INVALID_ARGUMENT."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        short = [BlockHash(bytes(20))]
        assert code_of(lambda: client.lookup(engine.engine_id, short)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        mixed = kit.chain(1) + kit.chain(1, size=16)
        assert code_of(lambda: client.reserve(engine.engine_id, mixed)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: client.report_hot_blocks(engine.engine_id, stored=short)) == \
            grpc.StatusCode.INVALID_ARGUMENT
    still_serving(daemon, kit)


def test_too_many_blocks_is_resource_exhausted(make_daemon: Any, kit: Any) -> None:
    """With max_blocks_per_request 8, a 9-block lookup gets RESOURCE_EXHAUSTED."""
    daemon = make_daemon(max_blocks_per_request=8)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        assert engine.max_blocks_per_request == 8
        assert client.lookup(engine.engine_id, kit.chain(8)) == []
        assert code_of(lambda: client.lookup(engine.engine_id, kit.chain(9))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
    still_serving(daemon, kit)


def test_oversized_message_is_resource_exhausted(make_daemon: Any, kit: Any) -> None:
    """With a 64 KiB message limit, a 4000-hash (~136 KiB) lookup gets RESOURCE_EXHAUSTED."""
    daemon = make_daemon(max_message_bytes=64 << 10)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        assert code_of(lambda: client.lookup(engine.engine_id, kit.chain(4000))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
    still_serving(daemon, kit)


def test_unknown_engine_and_lease_are_not_found(daemon: Any, kit: Any) -> None:
    """An unknown engine id, an unknown lease and an unregistered engine get NOT_FOUND."""
    with daemon.client() as client:
        assert code_of(lambda: client.lookup("no-such-engine", kit.chain(1))) == \
            grpc.StatusCode.NOT_FOUND
        engine = client.register_engine(kit.layout)
        for call in (lambda: client.release(engine.engine_id, "no-such-lease"),
                     lambda: client.commit(engine.engine_id, "no-such-lease", [True]),
                     lambda: client.abort(engine.engine_id, "no-such-lease")):
            assert code_of(call) == grpc.StatusCode.NOT_FOUND
        client.unregister_engine(engine.engine_id)
        assert code_of(lambda: client.lookup(engine.engine_id, kit.chain(1))) == \
            grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: client.unregister_engine(engine.engine_id)) == \
            grpc.StatusCode.NOT_FOUND
    still_serving(daemon, kit)


def test_double_commit_is_failed_precondition(daemon: Any, kit: Any) -> None:
    """Committing a reservation twice gets FAILED_PRECONDITION; the first commit stands."""
    hashes = kit.chain(2)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        reserved = client.reserve(engine.engine_id, hashes)
        assert client.commit(engine.engine_id, reserved.lease_id, [False, False]) == 0
        assert code_of(lambda: client.commit(engine.engine_id, reserved.lease_id,
                                             [False, False])) == grpc.StatusCode.FAILED_PRECONDITION
        assert kit.store_blocks(client, engine, arena, hashes) == 2
        arena.close()
    still_serving(daemon, kit)


def test_commit_with_wrong_count_is_invalid_argument(daemon: Any, kit: Any) -> None:
    """A commit with 1 written flag for a 2-block reservation gets INVALID_ARGUMENT."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        reserved = client.reserve(engine.engine_id, kit.chain(2))
        assert code_of(lambda: client.commit(engine.engine_id, reserved.lease_id, [False])) == \
            grpc.StatusCode.INVALID_ARGUMENT
        client.abort(engine.engine_id, reserved.lease_id)
    still_serving(daemon, kit)


def test_commit_after_lease_expiry_is_failed_precondition(make_daemon: Any, kit: Any) -> None:
    """A reservation committed after its 0.2 s lease expired (and a maintain pass freed it)
    gets FAILED_PRECONDITION, and its slots went back to the arena."""
    daemon = make_daemon(lease_seconds=0.2)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        reserved = client.reserve(engine.engine_id, kit.chain(3))
        assert 0.0 < reserved.seconds_left <= 0.2
        time.sleep(0.3)
        daemon.maintain()
        assert code_of(lambda: client.commit(engine.engine_id, reserved.lease_id,
                                             [True] * 3)) == grpc.StatusCode.FAILED_PRECONDITION
        stats = client.stats()
    assert stats.tiers[1].used_blocks == 0 and stats.lease_expiries == 1
    still_serving(daemon, kit)


def test_bad_token_is_unauthenticated(make_daemon: Any, kit: Any, workdir: str) -> None:
    """Over the Unix socket an unknown token, or a malformed authorization header, gets
    UNAUTHENTICATED; no token means the default tenant."""
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as f:
        f.write('"good-token" = "team-a"\n')
    daemon = make_daemon(token_file=tokens)
    with daemon.client(token="bad-token") as client:
        assert code_of(lambda: client.register_engine(kit.layout)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert code_of(client.stats) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(f"unix:{daemon.config.socket_path}") as channel:
        stats = channel.unary_unary("/tierd.v1.Tierd/Stats")
        with pytest.raises(grpc.RpcError) as info:
            stats(b"", metadata=(("authorization", "Basic abc"),), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with daemon.client(token="good-token") as client:
        client.register_engine(kit.layout)
    still_serving(daemon, kit)


def test_bug_in_a_handler_is_internal_and_server_keeps_serving(workdir: str) -> None:
    """A handler raising RuntimeError answers INTERNAL (traceback logged); the next call works;
    every call's latency is observed."""
    seen: list[str] = []

    async def boom(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"fail":
            raise RuntimeError("a bug")
        return request

    async def scenario() -> None:
        server = grpc.aio.server(interceptors=[ErrorInterceptor(lambda m, s: seen.append(m))])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Boom", {"Echo": grpc.unary_unary_rpc_method_handler(boom)})])
        path = os.path.join(workdir, "boom.sock")
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            echo = channel.unary_unary("/test.Boom/Echo")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await echo(b"fail", timeout=5)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "RuntimeError: a bug" in (info.value.details() or "")
            assert await echo(b"ok", timeout=5) == b"ok"
        await server.stop(None)

    asyncio.run(scenario())
    assert seen == ["Echo", "Echo"]


def test_huge_ids_are_not_found_with_a_short_message(daemon: Any, kit: Any) -> None:
    """A 16 KiB engine id (and lease id) is NOT_FOUND, not RESOURCE_EXHAUSTED: the message
    repeats at most a clipped prefix of it."""
    huge = "x" * (16 << 10)
    with daemon.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.lookup(huge, kit.chain(1))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(info.value.details()) < 200 and "16384 chars" in info.value.details()
        engine = client.register_engine(kit.layout)
        with pytest.raises(grpc.RpcError) as info:
            client.release(engine.engine_id, huge)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(info.value.details()) < 200
    still_serving(daemon, kit)


def test_release_of_an_expired_lease_is_not_found(make_daemon: Any, kit: Any) -> None:
    """A read lease past its deadline: Release answers NOT_FOUND (as the proto and docs say),
    a commit of an expired reservation stays FAILED_PRECONDITION."""
    daemon = make_daemon(lease_seconds=0.2)
    hashes = kit.chain(2)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        kit.store_blocks(client, engine, arena, hashes)
        got = client.acquire(engine.engine_id, hashes)
        reserved = client.reserve(engine.engine_id, kit.chain(1, seed=9))
        time.sleep(0.3)                                        # past both deadlines
        assert code_of(lambda: client.release(engine.engine_id, got.lease_id)) == \
            grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: client.commit(engine.engine_id, reserved.lease_id, [True])) == \
            grpc.StatusCode.FAILED_PRECONDITION
        arena.close()
    still_serving(daemon, kit)


def test_filtered_query_tokens_near_2_64_is_invalid_and_stats_keep_working(
        daemon: Any, kit: Any) -> None:
    """Reserve with filtered_query_tokens = 2^64 - 1 is INVALID_ARGUMENT naming the 2^40
    limit; Stats (for this tenant and any) keeps answering, counters unchanged."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        before = client.stats().query_tokens
        with pytest.raises(grpc.RpcError) as info:
            client.reserve(engine.engine_id, kit.chain(1), filtered_query_tokens=(1 << 64) - 1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2^40" in info.value.details()
        client.reserve(engine.engine_id, kit.chain(1), filtered_query_tokens=1 << 40)
        client.reserve(engine.engine_id, kit.chain(1), filtered_query_tokens=1 << 40)
        assert client.stats().query_tokens == before + (2 << 40)
    still_serving(daemon, kit)


def test_start_up_log_names_slab_sizes_with_units(make_daemon: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The start-up line says "slabs of 64 KiB" for 64 KiB slabs (it said "0 MiB")."""
    caplog.set_level("INFO", logger="tierd.daemon.server")
    make_daemon()
    line = next(r.getMessage() for r in caplog.records if "tierd serving" in r.getMessage())
    assert "(16 MiB, slabs of 64 KiB)" in line and "bound 4 MiB" in line


def test_engine_caps_answer_precise_codes(make_daemon: Any, kit: Any) -> None:
    """max_engines_per_tenant=2, max_name_bytes=16: a third engine is RESOURCE_EXHAUSTED
    naming the key and its variable, a 1 MiB name INVALID_ARGUMENT naming max_name_bytes;
    Stats keeps answering."""
    daemon = make_daemon(max_engines_per_tenant=2, max_name_bytes=16)
    with daemon.client() as client:
        client.register_engine(kit.layout, "a")
        client.register_engine(kit.layout, "b")
        with pytest.raises(grpc.RpcError) as info:
            client.register_engine(kit.layout, "c")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "TIERD_MAX_ENGINES_PER_TENANT" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.register_engine(kit.layout, "n" * (1 << 20))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_name_bytes" in info.value.details()
        assert [e.engine_name for e in client.stats().engines] == ["a", "b"]


def test_a_lapsed_engine_is_not_found_and_gone_from_stats(make_daemon: Any, kit: Any) -> None:
    """engine_idle_seconds=0.2: after a silent 0.3 s and a maintain pass the engine is
    NOT_FOUND and no longer in Stats; registering again works."""
    daemon = make_daemon(engine_idle_seconds=0.2, lease_seconds=0.2)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout, "quiet")
        client.report_hot_blocks(engine.engine_id, kit.chain(4))
        time.sleep(0.3)
        daemon.maintain()
        assert client.stats().engines == []
        assert code_of(lambda: client.lookup(engine.engine_id, kit.chain(1))) == \
            grpc.StatusCode.NOT_FOUND
        client.register_engine(kit.layout, "back")
    still_serving(daemon, kit)
