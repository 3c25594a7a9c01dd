"""``Runner``: jobs run by kind in priority order, their futures are their completion events, a
limited kind refuses past its limit, a failing job fails its future only, drain and stop wait."""

from __future__ import annotations

import threading
import time

import pytest

from tierd.connector.core.runner import Runner


def test_queued_jobs_run_by_kind_in_priority_order_each_first_in_first_out() -> None:
    """One thread held busy: jobs queued meanwhile run high-priority kind first, then in order."""
    runner = Runner(1, "t", ("high", "low"))
    gate, ran = threading.Event(), []
    runner.submit("low", gate.wait)
    time.sleep(0.05)  # the thread holds the gate job
    for name, kind in [("l1", "low"), ("h1", "high"), ("l2", "low"), ("h2", "high")]:
        runner.submit(kind, lambda name=name: ran.append(name))
    assert runner.queued("low") == 2 and runner.queued("high") == 2 and runner.busy()
    gate.set()
    assert runner.drain(5.0)
    assert ran == ["h1", "h2", "l1", "l2"] and not runner.busy()
    assert runner.stop(5.0)


def test_a_limited_kind_refuses_past_its_limit_and_others_do_not() -> None:
    """Limit 2 on "lookup": the third queued lookup is refused (None); releases are not limited."""
    runner = Runner(1, "t", ("lookup", "release"), limits={"lookup": 2})
    gate = threading.Event()
    runner.submit("release", gate.wait)
    time.sleep(0.05)
    assert runner.submit("lookup", lambda: 1) is not None
    assert runner.submit("lookup", lambda: 2) is not None
    assert runner.submit("lookup", lambda: 3) is None
    assert all(runner.submit("release", lambda: 0) is not None for _ in range(5))
    gate.set()
    assert runner.drain(5.0) and runner.submit("lookup", lambda: 4) is not None
    assert runner.stop(5.0)


def test_a_raising_job_fails_its_future_and_the_thread_runs_the_next() -> None:
    """A bug in one job is logged and held by its future; the next job still runs."""
    runner = Runner(1, "t", ("a",))

    def broken() -> None:
        raise RuntimeError("bug")

    bad = runner.submit("a", broken)
    good = runner.submit("a", lambda: "ok")
    assert bad is not None and good is not None
    with pytest.raises(RuntimeError, match="bug"):
        bad.result(5.0)
    assert good.result(5.0) == "ok"
    assert runner.stop(5.0)


def test_drain_of_some_kinds_and_its_timeout() -> None:
    """drain of one kind ignores another's running job; a job outlasting the timeout -> False."""
    runner = Runner(2, "t", ("a", "b"))
    gate = threading.Event()
    runner.submit("b", gate.wait)
    runner.submit("a", lambda: None)
    assert runner.drain(5.0, ("a",))
    assert not runner.drain(0.05)
    gate.set()
    assert runner.drain(5.0)


def test_stop_runs_the_queued_jobs_then_ends_the_threads() -> None:
    """Jobs queued before stop still run; submit after stop is a bug."""
    runner = Runner(1, "t", ("a",))
    ran: list[int] = []
    for i in range(3):
        runner.submit("a", lambda i=i: (time.sleep(0.01), ran.append(i)))
    assert runner.stop(5.0) and ran == [0, 1, 2]
    with pytest.raises(AssertionError):
        runner.submit("a", lambda: None)


def test_drain_down_to_keep_jobs() -> None:
    """drain(keep=1) returns with one job still running, drain() only once it ends."""
    runner = Runner(2, "t", ("a",))
    gate = threading.Event()
    runner.submit("a", gate.wait)
    runner.submit("a", lambda: time.sleep(0.05))
    assert runner.drain(5.0, keep=1) and runner.busy()
    assert not runner.drain(0.05)
    gate.set()
    assert runner.drain(5.0) and runner.stop(5.0)
