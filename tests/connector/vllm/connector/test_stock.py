"""The worker's stock of blank slots (``step_stock``): later saves copy into it with no Reserve
of their own and land in one Commit; a stock whose hold passed is committed while the engine
idles; a save that does not fit saves by hash. CUDA workers keep no stock."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from fake_vllm import FakeRequest, prompt, usage

from tierd.wire.client import TierdClient


def _count_reserves(monkeypatch: Any) -> dict[str, int]:
    """Reserves by hash and blank Reserves sent by workers (counted as they go out)."""
    calls = {"hash": 0, "blank": 0}
    by_hash, blank = TierdClient.reserve_sent, TierdClient.reserve_blank_sent

    def on_hash(self: Any, engine_id: str, hashes: Any) -> Any:
        calls["hash"] += 1
        return by_hash(self, engine_id, hashes)

    def on_blank(self: Any, engine_id: str, count: int) -> Any:
        calls["blank"] += 1
        return blank(self, engine_id, count)

    monkeypatch.setattr(TierdClient, "reserve_sent", on_hash)
    monkeypatch.setattr(TierdClient, "reserve_blank_sent", on_blank)
    return calls


def _stock_answered(engine: Any) -> None:
    """Wait until the worker's stock has its answer (the next save takes it)."""
    stock = engine.workers[0]._worker._stock
    deadline = time.monotonic() + 10.0
    while not stock._stock.reply.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert stock._stock.reply.done(), "the blank Reserve was never answered"


def _second_save_into_the_stock(engine: Any) -> FakeRequest:
    """Two saving steps of 6 blocks each: the first Reserves by hash and asks for a stock, the
    second copies into the stock once it is answered; the second step's request."""
    first, second = FakeRequest("a0", prompt(100, salt=0)), FakeRequest("a1", prompt(100, salt=1))
    engine.admit(first)
    engine.step([first])
    _stock_answered(engine)
    engine.admit(second)
    engine.step([second])
    return second


def test_later_saves_share_the_stock_and_one_commit(sock: str, engines: Any, monkeypatch: Any,
                                                    copy_path: str) -> None:
    """The first save Reserves by hash and asks for a stock; the next four copy into the stock
    with no Reserve of their own. One Commit names all 24 of their blocks; every block is
    stored once and loads bit-exact in another engine. On CUDA no stock is kept."""
    import tierd.connector.vllm.connector.commits as commits

    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    monkeypatch.setattr(commits, "IDLE_SECONDS", 60.0)  # a slow test step is no idle engine
    calls = _count_reserves(monkeypatch)
    a, b = engines(0), engines(0)
    reqs = [FakeRequest(f"a{i}", prompt(100, salt=i)) for i in range(5)]
    for i, req in enumerate(reqs):
        a.admit(req)
        a.step([req])
        if i == 0 and copy_path == "host":
            _stock_answered(a)
    if copy_path == "device":
        assert calls == {"hash": 5, "blank": 0}
    else:
        assert calls == {"hash": 1, "blank": 1}
    assert a.counters() == (0, 0, 30, 0, 0) and usage(sock) == (30, 0)
    for i, req in enumerate(reqs):
        got = FakeRequest(f"b{i}", prompt(100, salt=i))
        assert b.prefill(got) == (96, set())
        for block_a, block_b in zip(a.tables[req.request_id][:6], b.tables[got.request_id]):
            assert torch.equal(a.block(block_a), b.block(block_b))
        b.finish(got)


def test_the_next_stock_is_twice_what_the_last_one_handed_out(
        sock: str, engines: Any, monkeypatch: Any, copy_path: str) -> None:
    """The first stock is four times the largest save (at least 32 slots); the next one, asked
    for when the first is committed, twice the slots the first handed out: three 6-block saves
    took 18 of 32, so 36 (a stock sized for the saves of one hold, not its largest save)."""
    import tierd.connector.vllm.connector.commits as commits

    if copy_path == "device":
        return  # no stock on CUDA
    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    monkeypatch.setattr(commits, "IDLE_SECONDS", 60.0)  # a slow test step is no idle engine
    asked: list[int] = []
    blank = TierdClient.reserve_blank_sent

    def on_blank(self: Any, engine_id: str, count: int) -> Any:
        asked.append(count)
        return blank(self, engine_id, count)

    monkeypatch.setattr(TierdClient, "reserve_blank_sent", on_blank)
    a = engines(0)
    reqs = [FakeRequest(f"a{i}", prompt(100, salt=i)) for i in range(5)]
    for i, req in enumerate(reqs[:4]):
        a.admit(req)
        a.step([req])
        if i == 0:
            _stock_answered(a)
    assert asked == [32]
    monkeypatch.setattr(commits, "HOLD_SECONDS", 0.0)  # the stock is due at the next step
    a.admit(reqs[4])
    a.step([reqs[4]])
    assert asked == [32, 36]
    assert a.workers[0].worker_counters is not None  # every Commit landed
    assert usage(sock) == (30, 0)


def test_a_stock_lands_once_the_engine_idles(
        sock: str, engines: Any, monkeypatch: Any, copy_path: str) -> None:
    """A save in the stock, then no step: the committer thread commits the stock once no step
    has begun for ``IDLE_SECONDS``, long before its hold (a minute) has passed, with nothing of
    A's flushing it; another engine then loads the blocks."""
    import tierd.connector.vllm.connector.commits as commits

    if copy_path == "device":
        return  # no stock on CUDA (the test above)
    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    a, b = engines(0), engines(0)
    second = _second_save_into_the_stock(a)
    held: list[str] = []
    with TierdClient(socket_path=sock, timeout=10.0) as client:
        looker = client.register_engine(a.workers[0]._worker.link.layout, "looker")
        stock = a.workers[0]._worker._stock
        assert stock._stock is not None
        deadline = stock._stock.renew_at - 1.0  # before half its lease (which would commit it)
        while len(held) < 6 and time.monotonic() < deadline:  # nothing of A's flushes it
            time.sleep(0.02)
            held = client.lookup(looker.engine_id, second.block_hashes[:6])
        client.unregister_engine(looker.engine_id)
    assert held == ["dram"] * 6
    assert not stock.holding
    got = FakeRequest("b1", prompt(100, salt=1))
    assert b.prefill(got) == (96, set())
    b.finish(got)
    assert a.counters() == (0, 0, 12, 0, 0)


def test_the_committer_thread_sleeps_while_steps_begin_and_parks_once_nothing_is_held(
        sock: str, engines: Any, monkeypatch: Any, copy_path: str) -> None:
    """A save in the stock, then steps that save nothing, each begun well within
    ``IDLE_SECONDS`` of the last: the committer thread makes no look meanwhile (every wake of
    it costs CPU on the forward pass's core; each step's own send lands what is due). Once the
    steps stop it commits the stock, and then, holding nothing, it makes no look at all."""
    import tierd.connector.vllm.connector.commits as commits

    if copy_path == "device":
        return  # no stock on CUDA
    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    monkeypatch.setattr(commits, "IDLE_SECONDS", 0.3)
    looks: list[float] = []
    take_stock = commits.Committer._take_stock

    def counted(self: Any, force: bool = False, idle: bool = False) -> None:
        if threading.current_thread() is self._thread:
            looks.append(time.monotonic())
        take_stock(self, force, idle)

    monkeypatch.setattr(commits.Committer, "_take_stock", counted)
    a = engines(0)
    _second_save_into_the_stock(a)
    stock = a.workers[0]._worker._stock
    assert stock.holding
    looks.clear()
    until = time.monotonic() + 1.0
    while time.monotonic() < until:  # steps begin every few ms: the engine does not idle
        a.step([])
        time.sleep(0.01)
    assert looks == [] and stock.holding
    deadline = time.monotonic() + 10.0
    while stock.holding and time.monotonic() < deadline:  # the steps stopped: it idles
        time.sleep(0.01)
    assert not stock.holding
    time.sleep(0.1)
    parked = len(looks)
    time.sleep(0.5)
    assert len(looks) == parked
    assert a.counters() == (0, 0, 12, 0, 0)


def test_a_save_the_stock_has_no_room_for_saves_by_hash(
        sock: str, engines: Any, monkeypatch: Any, copy_path: str) -> None:
    """The stock holds 32 slots; a 6-block save takes 6 of them, then a 40-block save does
    not fit in the rest: it Reserves by hash, and the stock is given up (committed at the next
    step's first hook) and a larger one asked for. Every block is stored."""
    import tierd.connector.vllm.connector.commits as commits

    if copy_path == "device":
        return  # no stock on CUDA
    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    monkeypatch.setattr(commits, "IDLE_SECONDS", 60.0)  # a slow test step is no idle engine
    calls = _count_reserves(monkeypatch)
    a = engines(0)
    small = [FakeRequest(f"s{i}", prompt(100, salt=i)) for i in range(2)]
    big = FakeRequest("big", prompt(644, salt=9))
    a.admit(small[0])
    a.step([small[0]])
    _stock_answered(a)
    a.admit(small[1])
    a.step([small[1]])
    assert calls == {"hash": 1, "blank": 1}
    a.admit(big)
    a.step([big])
    assert calls == {"hash": 2, "blank": 2}
    assert a.counters() == (0, 0, 52, 0, 0) and usage(sock) == (52, 0)


def test_a_stock_of_a_forgotten_registration_drops_no_later_session(
        sock: str, engines: Any, monkeypatch: Any, copy_path: str) -> None:
    """The daemon forgets A's registration while A's stock holds a save: A registers anew; the
    old stock's Commit fails and its blocks count as dropped (every block of every save is
    counted saved or dropped, none as a lapsed lease), the new registration stays, and A's saves
    go on and land."""
    import tierd.connector.vllm.connector.commits as commits

    if copy_path == "device":
        return  # no stock on CUDA
    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    monkeypatch.setattr(commits, "IDLE_SECONDS", 60.0)  # a slow test step is no idle engine
    a = engines(0)
    worker = a.workers[0]._worker
    first, second = FakeRequest("a0", prompt(100, salt=0)), FakeRequest("a1", prompt(100, salt=1))
    a.admit(first)
    a.step([first])
    _stock_answered(a)
    a.admit(second)
    a.step([second])  # into the stock, which stays open (the hold is long)
    old = worker.link.session
    with TierdClient(socket_path=sock, timeout=10.0) as client:
        client.unregister_engine(old.engine_id)
    deadline = time.monotonic() + 30.0
    step = 2
    while (worker.link.session is None or worker.link.session is old) \
            and time.monotonic() < deadline:  # a call finds it gone; the next registers anew
        req = FakeRequest(f"a{step}", prompt(100, salt=step))
        a.admit(req)
        a.step([req])
        step += 1
    new = worker.link.session
    assert new is not None and new is not old
    req = FakeRequest(f"a{step}", prompt(100, salt=step))
    a.admit(req)
    a.step([req])
    saved, dropped = a.counters()[2], a.counters()[4]
    assert worker.link.session is new, "the old stock's failed Commit dropped the new session"
    assert saved >= 6 and saved + dropped == 6 * (step + 1), "a saved block went uncounted"
    assert a.settle().data["lapsed_blocks"] == 0  # a forgotten engine's loss is no lapsed lease
