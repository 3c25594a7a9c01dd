"""``CallThreads``: calls run on kept threads, started only when every one is busy."""

from __future__ import annotations

import threading

import pytest

from tierd.wire.call_threads import CallThreads


def test_calls_taken_one_after_another_run_on_one_thread() -> None:
    """Ten calls, each answered before the next is sent: one thread runs them all."""
    calls = CallThreads(4, "t")
    names = [calls.submit(lambda: threading.current_thread().name).result(timeout=5)
             for _ in range(10)]
    assert set(names) == {"t-1"} and calls.started == 1
    calls.stop()


def test_overlapping_calls_start_threads_up_to_the_limit_then_queue() -> None:
    """Six calls that all block at once on a limit of 3: three threads start and run three
    calls; the other three wait in the queue until the first are released, then all answer."""
    calls = CallThreads(3, "o")
    gate = threading.Event()
    entered = threading.Semaphore(0)

    def call(i: int) -> int:
        entered.release()
        gate.wait(5)
        return i

    futures = [calls.submit(lambda i=i: call(i)) for i in range(6)]
    for _ in range(3):
        assert entered.acquire(timeout=5)
    assert not entered.acquire(timeout=0.2), "a fourth call ran with every thread busy"
    assert calls.started == 3 and not any(f.done() for f in futures)
    gate.set()
    assert [f.result(timeout=5) for f in futures] == list(range(6)) and calls.started == 3
    calls.stop()


def test_a_call_that_raises_ends_its_future_and_the_thread_runs_the_next() -> None:
    """A raised error is the future's; the same thread then runs the next call."""
    calls = CallThreads(1, "t")

    def fail() -> None:
        raise ValueError("bad call")

    with pytest.raises(ValueError, match="bad call"):
        calls.submit(fail).result(timeout=5)
    assert calls.submit(lambda: 7).result(timeout=5) == 7 and calls.started == 1
    calls.stop()


def test_stop_runs_the_queued_calls_then_ends_the_threads() -> None:
    """Calls queued before ``stop`` still run; the threads then end; a submit after is a bug."""
    calls = CallThreads(2, "s")
    gate = threading.Event()
    futures = [calls.submit(lambda i=i: gate.wait(5) and i) for i in range(4)]
    threads = [t for t in threading.enumerate() if t.name in ("s-1", "s-2")]
    assert len(threads) == 2
    calls.stop()
    gate.set()
    assert [f.result(timeout=5) for f in futures] == [0, 1, 2, 3]
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="after stop"):
        calls.submit(lambda: None)
