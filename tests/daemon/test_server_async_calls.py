"""A ``TierdClient``'s calls sent without waiting, against a real daemon: no thread started per
call, every call answered past the thread limit, and calls after ``close`` fail as RpcErrors."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from tierd.wire import client as client_module
from tierd.wire.client import ChannelClosed


def _count_thread_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads started from now on (gRPC's own included)."""
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    return started


def test_a_reserve_per_step_starts_one_thread_in_all(daemon: Any, kit: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty Reserves sent without waiting, each answered (and aborted) before the next, as a
    vLLM worker sends one per step: one thread is started for all of them, not one per call."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        started = _count_thread_starts(monkeypatch)
        for i in range(20):
            got = client.reserve_async(engine.engine_id, kit.chain(2, seed=i)).result(timeout=10)
            assert got.slot_ids and all(slot is not None for slot in got.slot_ids)
            client.abort_async(engine.engine_id, got.lease_id).result(timeout=10)
        assert len(started) == 1, f"threads started: {started}"


def test_more_calls_at_once_than_threads_are_all_answered(daemon: Any, kit: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice ``CALL_THREADS`` Lookups-by-Acquire sent at once: every one is answered (the excess
    queue for a free thread) and no more threads than the limit are started."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        started = _count_thread_starts(monkeypatch)
        futures = [client.acquire_async(engine.engine_id, kit.chain(1, seed=i))
                   for i in range(2 * client_module.CALL_THREADS)]
        assert [f.result(timeout=30).num_blocks for f in futures] == [0] * len(futures)
        assert len(started) <= client_module.CALL_THREADS


def test_calls_after_close_fail_as_rpc_errors(daemon: Any, kit: Any) -> None:
    """Calls sent without waiting then closed under: each ends, answered or with an RpcError;
    one sent after ``close`` raises ``ChannelClosed`` (an RpcError) at once."""
    client = daemon.client()
    engine = client.register_engine(kit.layout)
    futures = [client.acquire_async(engine.engine_id, kit.chain(1, seed=i)) for i in range(8)]
    client.close()
    for future in futures:
        try:
            future.result(timeout=10)
        except grpc.RpcError:
            pass
    with pytest.raises(ChannelClosed):
        client.reserve_async(engine.engine_id, kit.chain(1))
