"""The lane (``tierd.wire.lane``) against a real daemon: the same answers, errors, tenants and
metrics as gRPC; bad frames end only their own connection; a full lane, a daemon without one
and a daemon gone behave as a demanding caller expects."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from tierd.connector.core.errors import classify
from tierd.daemon.config import TierdConfig
from tierd.daemon.server import Daemon
from tierd.wire import lane as lane_module
from tierd.wire.client import CommitRefused, TierdClient
from tierd.wire.lane import HELLO, LENGTH, lane_path
from tierd.wire.lane_client import LaneCall


def _frame(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


def _read(conn: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data
    return exactly(LENGTH.unpack(exactly(LENGTH.size))[0])


def _raw(daemon: Any, hello: bytes = HELLO) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(daemon.daemon.lane_path)
    conn.sendall(_frame(hello))
    return conn


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionError:
        return True


@contextlib.contextmanager
def _stoppable(workdir: str, name: str) -> Iterator[tuple[Daemon, TierdConfig, Callable[[], None]]]:
    """A daemon on an event loop of a thread of its own, its config, and a function that stops it
    (the daemon gone under its clients)."""
    config = TierdConfig(socket_path=os.path.join(workdir, f"{name}.sock"), dram_bytes=16 << 20,
                         slab_bytes=64 << 10, prefault=False, ssd_dir="")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        daemon = asyncio.run_coroutine_threadsafe(Daemon.start(config), loop).result(timeout=60)
        yield daemon, config, lambda: asyncio.run_coroutine_threadsafe(
            daemon.stop(grace=0.5), loop).result(timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _session(client: TierdClient, kit: Any) -> list[Any]:
    """What an engine does in a session (store, look up, pin, release, reserve blank, abort),
    as plain values."""
    engine = client.register_engine(kit.layout, engine_name="lane")
    arena = kit.attach(engine)
    hashes = kit.chain(3)
    stored = kit.store_blocks(client, engine, arena, hashes)
    arena.close()
    got = client.acquire(engine.engine_id, hashes + kit.chain(1, seed=9), hold=True)
    probe = client.probe(engine.engine_id, hashes)
    blank = client.reserve_blank_async(engine.engine_id, 2).result(timeout=10)
    client.abort(engine.engine_id, blank.lease_id)
    return [stored, client.lookup(engine.engine_id, hashes), got.num_blocks, got.checksums,
            client.release(engine.engine_id, got.lease_id, served=3), probe.num_blocks,
            client.release(engine.engine_id, probe.lease_id), len(blank.slot_ids),
            [(e.engine_name, e.hbm_blocks) for e in client.stats().engines]]


def test_calls_go_over_the_lane_with_the_answers_of_grpc(make_daemon: Any, kit: Any,
                                                        workdir: str) -> None:
    """The same session over the lane and over gRPC, each on a fresh daemon: the same answers;
    the lane's calls are counted in the daemon's latency metric as gRPC's are."""
    answers = {}
    for lane in (True, False):
        daemon = make_daemon(socket_path=os.path.join(workdir, f"{lane}.sock"),
                             ssd_dir=os.path.join(workdir, f"ssd-{lane}"))
        with TierdClient(socket_path=daemon.config.socket_path, timeout=10, lane=lane) as client:
            answers[lane] = _session(client, kit)
            assert client.on_lane is lane
        text = daemon.daemon.store.metrics.registry.get_sample_value(
            "tierd_rpc_latency_seconds_count", {"method": "Reserve"})
        assert text == 2  # store_blocks' Reserve and the blank one
    assert answers[True] == answers[False]
    assert answers[True][0] == 3 and answers[True][2] == 3


def test_errors_carry_the_codes_and_details_of_grpc(daemon: Any, kit: Any) -> None:
    """An unknown engine, a malformed request and a refused Reserve fail over the lane with
    the status code and details gRPC gives, and the connector classifies them alike."""
    with daemon.client() as lane, TierdClient(socket_path=daemon.config.socket_path, timeout=10,
                                              lane=False) as rpc:
        engine = lane.register_engine(kit.layout)
        calls = [lambda c: c.lookup("no-such-engine", kit.chain(1)),
                 lambda c: c.reserve(engine.engine_id, [b"short"]),
                 lambda c: c.commit(engine.engine_id, "no-such-lease", [True])]
        for call in calls:
            seen = []
            for client in (lane, rpc):
                with pytest.raises(grpc.RpcError) as info:
                    call(client)
                seen.append((info.value.code(), info.value.details(), classify(info.value)))
            assert seen[0] == seen[1]
        assert lane.on_lane and not rpc.on_lane


def test_tenants_over_the_lane_are_those_of_their_tokens(make_daemon: Any, kit: Any,
                                                        workdir: str) -> None:
    """A token in the hello makes the caller that tenant: another tenant's blocks are misses
    and its engine NOT_FOUND; an unknown token is UNAUTHENTICATED."""
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as f:
        f.write('"token-a" = "team-a"\n')
    daemon = make_daemon(token_file=tokens)
    hashes = kit.chain(2)
    with daemon.client(token="token-a") as a, daemon.client() as default, \
            daemon.client(token="wrong") as wrong:
        engine_a = kit.engine_storing(a, hashes)
        assert a.lookup(engine_a.engine_id, hashes) == ["dram"] * 2
        engine_d = default.register_engine(kit.layout)
        assert default.lookup(engine_d.engine_id, hashes) == []
        with pytest.raises(grpc.RpcError) as info:
            default.lookup(engine_a.engine_id, hashes)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            wrong.register_engine(kit.layout)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert a.on_lane and default.on_lane and wrong.on_lane
        assert {row.tenant for row in a.stats().tenants} >= {"team-a"}


def test_bad_frames_end_only_their_own_connection(daemon: Any, kit: Any) -> None:
    """A wrong hello or one over max_message_bytes (the connection closed), a call over it
    (RESOURCE_EXHAUSTED, as gRPC answers, the connection kept), a call of no method (answered
    INVALID_ARGUMENT, then closed) and a request that does not parse (INVALID_ARGUMENT, kept):
    each ends at most its own connection, and a client's calls go on being answered."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        wrong = _raw(daemon, hello=b"GET / HTTP/1.1")
        assert _closed(wrong)
        big = _raw(daemon)
        assert _read(big) == b"\0"
        big.sendall(_frame(b"\x06Lookup" + bytes(daemon.config.max_message_bytes)))
        reply = _read(big)
        assert reply[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert b"max_message_bytes" in reply
        big.sendall(_frame(b"\x05Stats"))  # the same connection still answers
        assert _read(big)[0] == 0
        huge = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        huge.settimeout(10)
        huge.connect(daemon.daemon.lane_path)
        huge.sendall(LENGTH.pack(daemon.config.max_message_bytes + 1) + HELLO)
        assert _closed(huge)
        nothing = _raw(daemon)
        assert _read(nothing) == b"\0"
        nothing.sendall(_frame(b"\x04Nope"))
        reply = _read(nothing)
        assert reply[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"no method 'Nope'" in reply
        assert _closed(nothing)
        garbled = _raw(daemon)
        assert _read(garbled) == b"\0"
        garbled.sendall(_frame(b"\x06Lookup" + b"\xff\xff\xff"))
        reply = _read(garbled)
        assert reply[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"malformed Lookup request" in reply
        garbled.sendall(_frame(b"\x05Stats"))  # the same connection still answers
        assert _read(garbled)[0] == 0
        for conn in (wrong, big, huge, nothing, garbled):
            conn.close()
        assert client.lookup(engine.engine_id, kit.chain(1)) == []
        assert client.on_lane


def test_a_full_lane_sends_new_callers_over_grpc(daemon: Any, kit: Any) -> None:
    """Past the lane's most connections a new connection's hello is refused
    (RESOURCE_EXHAUSTED): a client then calls over gRPC and is answered; once connections
    close, the next client is on the lane again."""
    daemon.daemon.lane._max_connections = 1
    holder = _raw(daemon)
    assert _read(holder) == b"\0"
    refused = _raw(daemon)
    reply = _read(refused)
    assert reply[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and _closed(refused)
    with daemon.client() as client:
        assert client.register_engine(kit.layout).engine_id
        assert not client.on_lane
    holder.close()
    refused.close()
    with daemon.client() as client:
        client.stats()
        assert client.on_lane


def test_a_call_sent_now_is_answered_when_its_reply_is_read(workdir: str, kit: Any) -> None:
    """``reserve_sent`` over the lane: other calls go on while its reply is unread, the reply
    read later is the reservation, and no call thread is started. Once the daemon is gone, one is
    UNAVAILABLE."""
    with _stoppable(workdir, "sent") as (_, config, stop), \
            TierdClient(socket_path=config.socket_path, timeout=10) as client:
        engine = client.register_engine(kit.layout)
        assert client.on_lane
        sent = client.reserve_sent(engine.engine_id, kit.chain(3))
        assert client.lookup(engine.engine_id, kit.chain(3)) == []  # beside it
        reserved = sent.result()
        assert len([s for s in reserved.slot_ids if s is not None]) == 3
        client.abort(engine.engine_id, reserved.lease_id)
        assert client._calls is None
        stop()
        with pytest.raises(grpc.RpcError) as info:
            client.reserve_sent(engine.engine_id, kit.chain(2, seed=5)).result()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_commits_sent_now_say_when_their_answer_is_in(daemon: Any, kit: Any) -> None:
    """``commit_many_sent`` over the lane: ``done()`` turns True once the daemon has answered
    (the Commits have landed: a lookup finds the blocks), and ``result()`` then reads each
    Commit's outcome without waiting; a lapsed lease fails its own Commit only. A call whose
    reply has not begun to arrive is not done."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        call = LaneCall(None, mine, "CommitMany")  # type: ignore[arg-type]  # result() unused
        assert not call.done()
        theirs.sendall(LENGTH.pack(1) + b"\0")
        assert call.done()
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        first = client.reserve(engine.engine_id, kit.chain(3))
        second = client.reserve(engine.engine_id, kit.chain(2, seed=7))
        client.abort(engine.engine_id, second.lease_id)
        sent = client.commit_many_sent(engine.engine_id, [
            (first.lease_id, [True] * 3, ()), (second.lease_id, [True] * 2, ())])
        deadline = time.monotonic() + 10
        while not sent.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sent.done() and client.on_lane
        stored, refused = sent.result()
        assert stored == 3 and isinstance(refused, CommitRefused)
        assert client.lookup(engine.engine_id, kit.chain(3)) == ["dram"] * 3


def test_a_probe_sent_now_pins_until_its_release_sent_now(daemon: Any, kit: Any) -> None:
    """``done(timeout)`` waits at most that long for an answer, and says so as soon as it
    comes; ``abandon`` closes the call's connection. Against a real daemon: ``probe_sent``
    pins the stored run, read by this thread with no call thread started; ``release_sent``
    ends that lease (a second Release of it is NOT_FOUND); a Probe abandoned unread still
    reaches the daemon, and the client's next calls go on over the lane."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        call = LaneCall(None, mine, "Probe")  # type: ignore[arg-type]  # result() unused
        start = time.monotonic()
        assert not call.done(0.05) and time.monotonic() - start >= 0.04
        answer = threading.Timer(0.05, lambda: theirs.sendall(LENGTH.pack(1) + b"\0"))
        answer.start()
        assert call.done(10.0) and time.monotonic() - start < 5.0
        answer.join()
        call.abandon()
        assert mine.fileno() == -1
    with daemon.client() as client:
        engine = kit.engine_storing(client, kit.chain(3))
        sent = client.probe_sent(engine.engine_id, kit.chain(3))
        assert sent.done(10.0)
        pinned = sent.result()
        assert pinned.num_blocks == 3 and client.on_lane and client._calls is None
        assert client.release_sent(engine.engine_id, pinned.lease_id).result() is False
        with pytest.raises(grpc.RpcError) as info:
            client.release(engine.engine_id, pinned.lease_id)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        client.probe_sent(engine.engine_id, kit.chain(3)).abandon()
        assert client.lookup(engine.engine_id, kit.chain(3)) == ["dram"] * 3
        assert client.on_lane and client._calls is None


def test_a_daemon_without_the_lane_is_called_over_grpc(make_daemon: Any, kit: Any) -> None:
    """``lane = false``: no lane socket, and clients call over gRPC."""
    daemon = make_daemon(lane=False)
    assert daemon.daemon.lane is None
    assert not os.path.exists(daemon.config.socket_path + ".lane")
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        assert client.lookup(engine.engine_id, kit.chain(1)) == []
        assert not client.on_lane


def test_a_daemon_gone_is_unavailable_and_its_lane_socket_removed(workdir: str,
                                                                  kit: Any) -> None:
    """A client on the lane of a daemon that stopped: its next call is UNAVAILABLE (the
    connector drops the session, as for gRPC), and the stopped daemon left no lane socket."""
    with _stoppable(workdir, "gone") as (daemon, config, stop):
        path = daemon.lane_path
        assert path == config.socket_path + ".lane" and os.path.exists(path)
        with TierdClient(socket_path=config.socket_path, timeout=10) as client:
            engine = client.register_engine(kit.layout)
            assert client.on_lane
            stop()
            assert not os.path.exists(path)
            with pytest.raises(grpc.RpcError) as info:
                client.lookup(engine.engine_id, kit.chain(1))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert classify(info.value) == "down"


@pytest.mark.parametrize("lane_again", [True, False], ids=["with-lane", "without-lane"])
def test_a_client_kept_across_a_daemon_restart_reaches_the_new_daemon(
        workdir: str, kit: Any, lane_again: bool) -> None:
    """A client whose idle lane connections belong to a daemon that stopped: once a new daemon
    serves the same socket, its next call reaches it (NOT_FOUND for the old engine, as gRPC's
    reconnected channel gives) on a new lane connection, or over gRPC where the new daemon has
    no lane, and it registers there."""
    config = TierdConfig(socket_path=os.path.join(workdir, "again.sock"), dram_bytes=16 << 20,
                         slab_bytes=64 << 10, prefault=False, ssd_dir="")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)

    try:
        first = run(Daemon.start(config))
        with TierdClient(socket_path=config.socket_path, timeout=10) as client:
            engine = client.register_engine(kit.layout)
            assert client.on_lane
            run(first.stop(grace=0.5))
            second = run(Daemon.start(dataclasses.replace(config, lane=lane_again)))
            try:
                with pytest.raises(grpc.RpcError) as info:
                    client.lookup(engine.engine_id, kit.chain(1))
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                again = client.register_engine(kit.layout)
                assert client.lookup(again.engine_id, kit.chain(1)) == []
                assert client.on_lane is lane_again
            finally:
                run(second.stop(grace=0.5))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_a_forked_child_never_reads_its_parents_replies(daemon: Any, kit: Any) -> None:
    """A client used, then the process forked: parent and child call at once, each on its own
    connections, and every answer is the caller's own (a shared connection would hand one the
    other's replies)."""
    with daemon.client() as client:
        engine = kit.engine_storing(client, kit.chain(3))
        assert client.lookup(engine.engine_id, kit.chain(3)) == ["dram"] * 3  # a kept connection
        child = os.fork()
        if child == 0:  # the child: its own chain length, 200 times; never back into pytest
            code = 2
            try:
                code = 0 if all(client.lookup(engine.engine_id, kit.chain(3)[:1]) == ["dram"]
                                for _ in range(200)) else 1
            finally:
                os._exit(code)
        answers = [client.lookup(engine.engine_id, kit.chain(3)) for _ in range(200)]
        _, status = os.waitpid(child, 0)
        assert answers == [["dram"] * 3] * 200
        assert os.waitstatus_to_exitcode(status) == 0


def test_a_socket_path_too_long_for_a_lane_has_none() -> None:
    """The lane's path must fit a Unix socket; where it would not, there is no lane."""
    short = "/tmp/t.sock"
    assert lane_path(short) == short + ".lane"
    long = "/tmp/" + "d" * (lane_module.MAX_PATH - len("/tmp/") - len(".sock") - 2) + ".sock"
    assert len(long) <= lane_module.MAX_PATH and lane_path(long) is None
