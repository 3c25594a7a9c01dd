"""``InFlight``: calls sent without waiting are settled oldest first, down to a bound, and each
failure reaches ``on_error`` once, on the settling thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import grpc

from tierd.connector.core.inflight import InFlight


class Failed(grpc.RpcError):  # type: ignore[misc]  # grpc has no type stubs
    pass


def test_settle_waits_oldest_first_down_to_the_bound() -> None:
    errors: list[tuple[Any, grpc.RpcError]] = []
    calls = InFlight(lambda session, exc: errors.append((session, exc)))
    replies: list[Future[int]] = [Future() for _ in range(3)]
    for i, reply in enumerate(replies):
        calls.add(f"s{i}", reply)  # type: ignore[arg-type]  # any session object
    replies[0].set_result(1)
    failure = Failed()
    replies[1].set_exception(failure)
    calls.settle(1)  # the two oldest are done: settled without blocking
    assert len(calls) == 1 and errors == [("s1", failure)]
    threading.Timer(0.05, lambda: replies[2].set_result(3)).start()
    calls.settle(0)  # blocks until the last one answers
    assert len(calls) == 0 and errors == [("s1", failure)]


def test_a_failure_is_reported_once_when_two_threads_settle() -> None:
    errors: list[grpc.RpcError] = []
    calls = InFlight(lambda session, exc: errors.append(exc))
    reply: Future[int] = Future()
    calls.add("s", reply)  # type: ignore[arg-type]
    threads = [threading.Thread(target=calls.settle) for _ in range(2)]
    for t in threads:
        t.start()
    reply.set_exception(Failed())
    for t in threads:
        t.join(timeout=10)
    assert len(errors) == 1 and len(calls) == 0
