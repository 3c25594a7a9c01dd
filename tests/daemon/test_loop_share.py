"""Each tenant's share of the event loop: loop seconds counted per step of a call, a tenant over
its share waits for the calls of a tenant within its share, a lone tenant never waits, and the
metrics name tenants only."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from typing import Any

from prometheus_client import generate_latest

from tierd.daemon.loop_share import LoopShare, LoopShareCollector
from tierd.wire.client import TierdClient


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_loop_seconds_count_the_steps_of_a_call_not_its_awaits() -> None:
    """A call that runs 2 s, awaits while the clock moves 50 s, then runs 3 s more is counted
    5 s for its tenant: the time it awaited belongs to nobody."""
    clock = Clock()
    share = LoopShare(0.01, clock)
    resume = asyncio.Event()

    async def call() -> str:
        clock.now += 2
        await resume.wait()
        clock.now += 3
        return "answer"

    task = asyncio.ensure_future(share.timed("team-a", call()))
    await asyncio.sleep(0)
    clock.now += 50
    resume.set()
    assert await task == "answer"
    assert share.loop_seconds == {"team-a": 5.0}
    share.check_integrity()


async def test_a_tenant_over_its_share_waits_for_the_calls_within_theirs() -> None:
    """Team A used 9 s of the loop, team B 1 s: A is over its share (5 s each), B is not. A call
    of A waits while B's call is in flight and goes once it is done; the wait is counted as A's
    throttled seconds, and B's next call is not held."""
    clock = Clock()
    share = LoopShare(10.0, clock)
    share.spent("team-a", 9.0)
    share.spent("team-b", 1.0)
    assert share.over_share("team-a") and not share.over_share("team-b")

    await share.admit("team-b")  # B's call in flight
    waiting = asyncio.ensure_future(share.admit("team-a"))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not waiting.done()
    clock.now += 0.002  # B's call ran 2 ms
    share.finished("team-b")
    await asyncio.wait_for(waiting, 5)
    assert 0.001 < share.throttled_seconds["team-a"] <= 0.003

    await share.admit("team-b")  # within its share: no wait at all
    assert share.throttled_seconds["team-b"] == 0
    share.finished("team-b")
    share.finished("team-a")
    share.check_integrity()


async def test_a_tenant_over_its_share_waits_at_most_max_wait() -> None:
    """With B's call in flight for good, A's call goes after ``max_wait`` (5 ms here) anyway."""
    share = LoopShare(0.005)
    share.spent("team-a", 9.0)
    share.spent("team-b", 1.0)
    await share.admit("team-b")
    await asyncio.wait_for(share.admit("team-a"), 5)
    assert share.throttled_seconds["team-a"] >= 0.005


async def test_a_lone_tenant_is_never_over_its_share() -> None:
    """Only team A is active, however much of the loop it uses: it never waits; once team B is
    active too, A is over its share again."""
    clock = Clock()
    share = LoopShare(10.0, clock)
    share.spent("team-a", 100.0)
    assert not share.over_share("team-a")
    await asyncio.wait_for(share.admit("team-a"), 5)
    assert share.throttled_seconds["team-a"] == 0
    share.finished("team-a")
    share.spent("team-b", 0.001)
    assert share.over_share("team-a")
    clock.now += 60  # a minute later both faded out: nobody is active, nobody is over
    assert not share.over_share("team-a") and not share.over_share("team-b")


async def test_no_wait_without_max_wait() -> None:
    """``max_wait`` 0 (``loop_share_wait_seconds = 0``): loop seconds are still counted, but
    no call waits."""
    share = LoopShare(0.0)
    share.spent("team-a", 9.0)
    share.spent("team-b", 1.0)
    await share.admit("team-b")
    await asyncio.wait_for(share.admit("team-a"), 5)
    assert share.throttled_seconds == {} and share.loop_seconds["team-a"] == 9.0


def test_the_daemon_throttles_the_tenant_using_the_loop(make_daemon: Any, kit: Any,
                                                        workdir: str) -> None:
    """Over TCP, team A stores and commits 2,048-block chains in a loop while team B looks up
    8 blocks now and then: A is over its share and its calls waited; B's never did."""
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as f:
        f.write('"token-a" = "team-a"\n"token-b" = "team-b"\n')
    daemon = make_daemon(tcp_port=0, token_file=tokens, loop_share_wait_seconds=0.002)
    address = f"127.0.0.1:{daemon.daemon.tcp_port}"
    share = daemon.daemon.loop_share
    assert share is not None
    with TierdClient(address=address, token="token-a") as a, \
            TierdClient(address=address, token="token-b") as b:
        hog = a.register_engine(kit.layout, engine_name="a0")
        light = b.register_engine(kit.layout, engine_name="b0")
        done = threading.Event()

        def store_again_and_again() -> None:
            for seed in itertools.count():
                if done.is_set():
                    return
                res = a.reserve(hog.engine_id, kit.chain(2048, seed=seed % 256))
                a.commit(hog.engine_id, res.lease_id, [s is not None for s in res.slot_ids])

        thread = threading.Thread(target=store_again_and_again)
        thread.start()
        try:
            for _ in range(40):
                b.lookup(light.engine_id, kit.chain(8, seed=99))
                time.sleep(0.005)
                if share.throttled_seconds.get("team-a", 0.0) > 0:
                    break
        finally:
            done.set()
            thread.join()
    assert share.throttled_seconds.get("team-a", 0.0) > 0
    assert share.throttled_seconds.get("team-b", 0.0) == 0
    assert share.loop_seconds["team-a"] > share.loop_seconds["team-b"] > 0


def test_the_metrics_name_tenants_never_engine_ids(make_daemon: Any, kit: Any,
                                                   workdir: str) -> None:
    """Two tenants over TCP, each storing and loading: ``tierd_tenant_loop_seconds_total`` has
    one series per tenant name, labelled by ``tenant`` alone; neither metric names an engine id
    or a token. Team A, alone busy at first, was never throttled."""
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as f:
        f.write('"token-a" = "team-a"\n"token-b" = "team-b"\n')
    daemon = make_daemon(tcp_port=0, token_file=tokens)
    address = f"127.0.0.1:{daemon.daemon.tcp_port}"
    engine_ids = []
    with TierdClient(address=address, token="token-a") as a:
        engine = a.register_engine(kit.layout, engine_name="a0")
        engine_ids.append(engine.engine_id)
        arena = kit.attach(engine)
        kit.store_blocks(a, engine, arena, kit.chain(64))
        for _ in range(20):
            lease = a.acquire(engine.engine_id, kit.chain(64))
            a.release(engine.engine_id, lease.lease_id)
        arena.close()
    share = daemon.daemon.loop_share
    assert share is not None and share.throttled_seconds["team-a"] == 0
    with TierdClient(address=address, token="token-b") as b:
        engine_ids.append(b.register_engine(kit.layout, engine_name="b0").engine_id)
    text = generate_latest(daemon.daemon.store.metrics.registry).decode()
    lines = [line for line in text.splitlines()
             if line.startswith(("tierd_tenant_loop_seconds", "tierd_tenant_throttled_seconds"))]
    used = {line.split("{")[1].split("}")[0] for line in lines
            if line.startswith("tierd_tenant_loop_seconds_total")}
    assert used == {'tenant="team-a"', 'tenant="team-b"'}
    assert not any(e in line for line in lines for e in engine_ids)
    assert not any("token-" in line or "engine" in line for line in lines)
    assert {m.name for m in LoopShareCollector(share).describe()} == {
        "tierd_tenant_loop_seconds", "tierd_tenant_throttled_seconds"}
