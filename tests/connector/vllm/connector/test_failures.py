"""Failed loads through the fake vLLM: corrupt slots reported and recomputed, saves that depend on a
failed load dropped until the recompute, an expired lease, a daemon down and back, and an
asynchronous local hit on a failed load."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import torch
from fake_vllm import BS, FakeRequest, FakeVllm, ask, corrupt, lose_blocks, prompt, usage

from tierd.connector.vllm.connector import TierdWorkerMetadata
from tierd.connector.vllm.connector.metadata import SaveSpec
from tierd.hashing import block_hashes


def test_corrupt_slot_is_reported_and_recomputed(sock: str, engines: Any) -> None:
    """Block 3 of 6 is corrupt: B keeps 0-2, reports 3-5, and after the recompute equals A."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    corrupt(sock, a.config, block_hashes(prompt(100), BS), 3)
    req = FakeRequest("b", prompt(100))
    external, errors = b.prefill(req)
    ids_a, ids_b = a.tables["a"], b.tables["b"]
    assert external == 96 and errors == set(ids_b[3:6])
    assert b.counters() == (3, 3, 0, 0, 0) and usage(sock)[1] == 0
    for i in range(3):
        assert torch.equal(a.block(ids_a[i]), b.block(ids_b[i]))
    req.num_computed_tokens = 3 * BS  # vLLM (recompute policy) rewinds to the failed block
    assert b.step([req]).invalid_block_ids == set()
    assert b.metas[-1].recomputing == ["b"] and b.computed_tokens == 4 + 52
    assert b.counters() == (3, 3, 1, 2, 0)  # block 3 dropped by the daemon, stored again
    for block_a, block_b in zip(ids_a, ids_b):
        assert torch.equal(a.block(block_a), b.block(block_b))


def test_corrupt_block_is_dropped_and_stored_again_by_the_recompute(sock: str,
                                                                    engines: Any) -> None:
    """B finds block 3 corrupt: the daemon drops it, B's recompute stores it, C loads all 6."""
    a, b, c = engines(0), engines(20), engines(40)
    a.prefill(FakeRequest("a", prompt(100)))
    corrupt(sock, a.config, block_hashes(prompt(100), BS), 3)
    req = FakeRequest("b", prompt(100))
    assert b.prefill(req) == (96, set(b.tables["b"][3:6]))
    assert usage(sock) == (5, 0)
    req.num_computed_tokens = 3 * BS
    b.step([req])
    assert b.counters() == (3, 3, 1, 2, 0)
    assert c.prefill(FakeRequest("c", prompt(100))) == (96, set())
    assert c.counters() == (6, 0, 0, 0, 0)


def test_failed_load_drops_dependent_saves_until_recomputing(sock: str, engines: Any,
                                                             monkeypatch: Any) -> None:
    """X's load misses from block 3: saves on top of it (X's, Y's) are dropped until recomputing."""
    a, b = engines(0), engines(20)
    prefix = prompt(96)
    a.prefill(FakeRequest("a", prefix + [1]))
    x = FakeRequest("x", prefix + prompt(67, salt=1))  # 10 full blocks, prefilled in 2 chunks
    y = FakeRequest("y", prefix + prompt(35, salt=2))  # shares X's loading blocks (local hit)
    z = FakeRequest("z", prompt(40, salt=3))           # unrelated
    assert b.admit(x) == 96
    ids = b.tables["x"]
    assert b.admit(y, local_hit=96, shared=ids[:6]) == 0 and b.admit(z) == 0
    lose_blocks(b, 0, 3, monkeypatch)
    first = b.step([x, y, z], budget={"x": 32}, deliver=False)
    monkeypatch.undo()
    assert first.invalid_block_ids == set(ids[3:6])
    assert first.kv_connector_worker_meta == TierdWorkerMetadata({"x": 1}, set(ids[3:6]), step=1)
    saves = {s.req_id: s for s in b.metas[-1].saves}
    assert (saves["x"].block_ids, saves["x"].depends_on) == (ids[6:8], ids[:6])
    assert (saves["y"].block_ids[-2:], saves["y"].depends_on) == (b.tables["y"][6:8], ids[:6])
    assert (saves["z"].block_ids, saves["z"].depends_on) == (b.tables["z"][:2], [])
    second = b.step([x], deliver=False)  # async scheduling: planned before the failure is known
    assert b.metas[-1].recomputing == [] and b.metas[-1].saves == [  # X's load is unreported
        SaveSpec("x", ids[8:10], [bytes(h) for h in x.block_hashes[8:10]], ids[:6])]
    dropped = len(saves["x"].block_ids) + len(saves["y"].block_ids) + 2
    assert b.counters() == (3, 3, 2, 0, dropped)
    assert usage(sock) == (6 + 2, 6)  # A's prefix and Z's blocks; X's hit still pinned
    b.deliver(first)
    b.deliver(second)
    assert usage(sock) == (8, 0)
    x.num_computed_tokens, y.num_computed_tokens = 3 * BS, 96  # vLLM's rewind (recompute)
    assert b.step([x, y]).invalid_block_ids == set()
    assert b.metas[-1].recomputing == ["x", "y"]
    assert [(s.req_id, s.block_ids) for s in b.metas[-1].saves] == [
        ("x", ids[3:10]), ("y", b.tables["y"][3:8])]
    assert b.counters() == (3, 3, 2 + 6, 3 + 3, dropped)  # 3-5 were stored already
    assert usage(sock) == (14, 0)


def test_expired_lease_fails_the_whole_load(daemon: Any, sock: str, engines: Any,
                                            monkeypatch: Any) -> None:
    """B loads under the scheduler's pin, and the copy ends past the pin's deadline (B's clock
    100 s later): all 6 verified blocks are reported for recompute."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    worker = b.workers[0]._worker
    later = time.monotonic() + 100.0

    def jump() -> None:  # the worker's clock, 100 s on from now
        monkeypatch.setattr(worker, "_clock", lambda: later)

    external, errors = b.prefill(FakeRequest("b", prompt(100)), before_forward=jump)
    ids_b = b.tables["b"]
    assert external == 96 and errors == set(ids_b[:6])
    assert b.counters() == (0, 6, 0, 0, 0) and usage(sock) == (6, 0)


def test_own_acquire_ended_before_its_release_fails_the_whole_load(daemon: Any, sock: str,
                                                                   engines: Any,
                                                                   monkeypatch: Any) -> None:
    """B cannot load under the pin (another arena) and acquires the blocks itself; the daemon
    has ended that lease when B releases it: all 6 verified blocks are reported for
    recompute."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    lose_blocks(b, 0, 6, monkeypatch)
    store = daemon.daemon.store
    real_clock, jumps = store._clock, itertools.count(time.monotonic() + 100.0, 100.0)

    def jump() -> None:  # the daemon's clock, 100 s later at every reading
        store._clock = lambda: next(jumps)

    try:
        external, errors = b.prefill(FakeRequest("b", prompt(100)), before_forward=jump)
    finally:
        store._clock = real_clock
    ids_b = b.tables["b"]
    assert external == 96 and errors == set(ids_b[:6])
    assert b.counters() == (0, 6, 0, 0, 0) and usage(sock) == (6, 0)


def test_daemon_down_means_no_match_no_save_then_reconnects(workdir: str,
                                                            make_daemon: Any) -> None:
    """No daemon: 0 matches, 6 saves dropped; once one listens, saves and matches resume."""
    socket_path = os.path.join(workdir, "tierd.sock")
    a = FakeVllm(socket_path, 0, retry_seconds=0.0, timeout_seconds=30.0)  # a loaded host
    try:
        assert a.prefill(FakeRequest("a", prompt(100))) == (0, set())
        assert a.counters() == (0, 0, 0, 0, 6)
        make_daemon()
        assert a.prefill(FakeRequest("b", prompt(100, salt=1))) == (0, set())
        assert a.counters() == (0, 0, 6, 0, 6)
        probe = FakeRequest("c", prompt(100, salt=1))
        assert ask(a.scheduler, probe, 0) == (96, False)
        assert usage(socket_path) == (6, 6)
        a.scheduler.request_finished(probe, [])
        assert usage(socket_path) == (6, 0)
    finally:
        a.close()


def test_async_local_hit_on_a_failed_load_is_not_stored(sock: str, engines: Any,
                                                        monkeypatch: Any) -> None:
    """Y, admitted on X's blocks before X's failed load is reported (async), stores nothing."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(96) + [1]))
    x = FakeRequest("x", prompt(96) + [1])
    assert b.admit(x) == 96
    lose_blocks(b, 0, 3, monkeypatch)
    first = b.step([x], deliver=False)
    monkeypatch.undo()
    y = FakeRequest("y", prompt(96) + prompt(35, salt=2))
    assert b.admit(y, local_hit=96, shared=b.tables["x"][:6]) == 0
    second = b.step([y], deliver=False)
    b.deliver(first)
    b.deliver(second)
    b.settle()
    assert usage(sock) == (6, 0)

