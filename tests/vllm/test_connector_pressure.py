"""TierdConnector inside real vLLM 0.33 under pressure: requests that wait for KV space, and
forward steps slower than the daemon's leases."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")

from harness import BLOCK, Daemon, Engine, engine_layout, make_request, vllm_config  # noqa: E402

from tierd.wire.client import TierdClient  # noqa: E402
from tierd.wire.sent import FutureSent, Sent  # noqa: E402

pytestmark = pytest.mark.vllm

LEASE = 2.0
"""The write lease of the ``short_lease`` daemon, seconds; a slow step outlasts it."""


@pytest.fixture
def short_lease() -> Iterator[Daemon]:
    """A daemon (DRAM only) whose leases and reservations last ``LEASE`` seconds."""
    workdir = tempfile.mkdtemp(prefix="tierd-v")
    running = Daemon(workdir, ssd=False)
    running.start("--lease-seconds", str(LEASE))
    yield running
    running.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def prompt(seed: int, blocks: int = 6) -> list[int]:
    """``blocks`` full blocks and a 5-token tail, distinct per ``seed``."""
    return [(i * 37 + seed * 101 + 11) % 997 for i in range(blocks * BLOCK + 5)]


def daemon_counts(daemon: Daemon) -> tuple[int, int]:
    """The daemon's (query tokens, hit tokens) so far."""
    with daemon.client() as client:
        stats = client.stats()
    return stats.query_tokens, stats.hit_tokens


def test_waiting_requests_are_looked_up_once(model_dir: str, daemon: Daemon,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """B's KV cache holds two requests at a time: a long miss runs first, four prompts A
    stored and four misses wait behind it, and vLLM asks for the first waiting one at every
    step. The daemon is asked (and counts) each request once, in one Probe (the scheduler's, or
    the worker's for a hit answered from the presence filter) and no Lookup, or not at all
    where the filter rules the chain out (the tokens then reported within half a second, or
    when the run drains the scheduler side): its query tokens stay within
    vLLM's own connector queries, and its hit ratio is vLLM's external hit rate within 5
    percentage points; the requests still load their hits."""
    a = Engine.start(vllm_config(model_dir, daemon.socket_path))
    b = Engine.start(vllm_config(model_dir, daemon.socket_path), num_blocks=17)
    stored = [prompt(seed) for seed in range(4)]
    try:
        a.run([make_request(f"a{i}", p) for i, p in enumerate(stored)])
        counted_asks: list[int] = []
        for name in ("probe", "probe_sent"):  # the scheduler's Probe, and a worker's
            def counted(client: TierdClient, engine_id: str, hashes: list[bytes], *,
                        real: Any = getattr(TierdClient, name), **flags: Any) -> Any:
                counted_asks.append(len(hashes))
                return real(client, engine_id, hashes, **flags)

            monkeypatch.setattr(TierdClient, name, counted)
        lookups: list[int] = []
        real_lookup = TierdClient.lookup
        monkeypatch.setattr(TierdClient, "lookup", lambda client, engine_id, hashes: (
            lookups.append(len(hashes)), real_lookup(client, engine_id, hashes))[1])
        queries, hits = daemon_counts(daemon)
        requests = [make_request("long", prompt(100, blocks=8), max_tokens=40)]
        requests += [make_request(f"hit{i}", p) for i, p in enumerate(stored)]
        requests += [make_request(f"miss{i}", prompt(200 + i)) for i in range(4)]
        b.run(requests)
        after = daemon_counts(daemon)
        queried, hit = after[0] - queries, after[1] - hits
        vllm_queries, vllm_hits = b.external
        assert 0 < queried <= vllm_queries, (queried, hit, vllm_queries, vllm_hits)
        assert abs(hit / queried - vllm_hits / vllm_queries) <= 0.05, (
            queried, hit, vllm_queries, vllm_hits)
        # each request asked at most once; the misses mostly answered by the presence filter
        assert len(stored) <= len(counted_asks) <= len(requests) and not lookups
        # the four hits load in full (a request preempted and resumed may load back what it
        # saved itself, at steps that depend on when each lookup job ended)
        assert b.worker.worker_counters.data["loaded_blocks"] >= 4 * 6
        assert daemon.pinned_blocks() == 0
    finally:
        a.close()
        b.close()


def test_a_step_slower_than_the_write_lease_still_saves(model_dir: str,
                                                        short_lease: Daemon) -> None:
    """A's prefill step outlasts the write lease between its first layer's Reserve and
    wait_for_save (a forward pass on an overloaded host): its 6 blocks are re-offered under a
    fresh reservation and stored, none dropped, and B loads all 6."""
    a = Engine.start(vllm_config(model_dir, short_lease.socket_path))
    b = Engine.start(vllm_config(model_dir, short_lease.socket_path))
    real_wait = a.worker.wait_for_save
    slowed: list[bool] = []

    def slow_step() -> None:
        meta = a.worker._step_meta()
        if not slowed and meta is not None and meta.saves:  # the prefill step, not a wait
            slowed.append(True)
            time.sleep(LEASE + 0.5)
        real_wait()

    a.worker.wait_for_save = slow_step
    try:
        a.run([make_request("a", prompt(1))])
        counters = a.worker.worker_counters.data
        assert (counters["saved_blocks"], counters["dropped_blocks"]) == (6, 0)
        assert counters["reoffered_blocks"] == 6 and counters["lapsed_blocks"] == 0
        b.run([make_request("b", prompt(1))])
        assert b.worker.worker_counters.data["loaded_blocks"] == 6
    finally:
        a.close()
        b.close()


def test_a_commit_that_lands_after_its_lease_is_a_warning(
        model_dir: str, short_lease: Daemon, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The Commit goes out after the write lease ended (the step itself was fast; whichever
    thread sends it is held up): the daemon refuses it, and the 6 lost blocks are a WARNING and
    counted as dropped and lapsed, never lost silently."""
    import tierd.connector.vllm.connector.commits as commits

    def late(real: Any) -> Any:
        def call(*args: Any) -> Any:
            time.sleep(LEASE + 0.5)
            return real(*args)
        return call

    monkeypatch.setattr(commits, "_landed", late(commits._landed))
    monkeypatch.setattr(commits.Committer, "_send_now", late(commits.Committer._send_now))
    a = Engine.start(vllm_config(model_dir, short_lease.socket_path))
    try:
        with caplog.at_level(logging.WARNING, logger="tierd.connector.vllm.connector.commits"):
            a.run([make_request("a", prompt(2))])
            counters = a.worker.worker_counters.data
        assert counters["saved_blocks"] == 0
        assert counters["dropped_blocks"] == counters["lapsed_blocks"] == 6
        assert any("6 saved blocks were not stored" in r.getMessage() and "lease" in
                   r.getMessage() for r in caplog.records)
    finally:
        a.close()


def answered_on_a_thread(call: Callable[[], Any]) -> Sent[Any]:
    """A call sent without waiting whose answer is ``call()``, made on a thread of its own."""
    reply: Future[Any] = Future()

    def answer() -> None:
        try:
            reply.set_result(call())
        except Exception as exc:  # noqa: BLE001  # handed to the waiter
            reply.set_exception(exc)

    threading.Thread(target=answer, daemon=True).start()
    return FutureSent(reply)


def answered_after(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[Sent[Any]]:
    """Every Reserve a worker sends is answered ``seconds`` late (a daemon busy elsewhere): the
    real call made on a thread of its own after that wait. The list of those sent, in order."""
    real = TierdClient.reserve
    sent: list[Sent[Any]] = []

    def reserve_sent(client: TierdClient, engine_id: str, hashes: list[bytes]) -> Sent[Any]:
        def late() -> Any:
            time.sleep(seconds)
            return real(client, engine_id, hashes)

        sent.append(answered_on_a_thread(late))
        return sent[-1]

    monkeypatch.setattr(TierdClient, "reserve_sent", reserve_sent)
    return sent


def run_alone(engine: Engine, request: Any) -> list[int]:
    """Step ``engine`` until ``request`` (added now) finished; the vLLM blocks it held."""
    engine.scheduler.add_request(request)
    held: list[int] = []
    for _ in range(500):
        out = engine.scheduler.schedule()
        if request.request_id in out.num_scheduled_tokens:
            held = list(engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])
        engine._absorb(engine.scheduler.update_from_output(out, engine._forward(out)))
        if request.request_id in engine.finish:
            return held
        time.sleep(0.002)
    raise AssertionError(f"{request.request_id} did not finish")


def assert_loads_what_a_computed(b: Engine, a: Engine, seed: int) -> None:
    """B, given A's one-token request "a1" (``prompt(seed)``), loads all 6 of its blocks and
    generates what A did."""
    got = b.run([make_request("b", prompt(seed), max_tokens=1)])["b"]
    assert b.worker.worker_counters.data["loaded_blocks"] == 6
    assert got == a.tokens["a1"]


def two_requests_over_the_same_blocks(a: Engine, b: Engine, between: Callable[[], None]) -> None:
    """A (8 blocks: room for one request) runs the one-token request "a1" (``prompt(4)``),
    then ``between``, then "a2", which takes over the vLLM blocks a1 held: A stored all 12
    blocks and dropped none (its Commits waited for), and B loads a1's 6 and generates what
    A did."""
    first = run_alone(a, make_request("a1", prompt(4), max_tokens=1))
    between()
    second = run_alone(a, make_request("a2", prompt(5), max_tokens=1))
    assert set(first) & set(second)  # a2 wrote into blocks a1's save was taken from
    counters = a.worker.worker_counters.data  # waits for the Commits
    assert (counters["saved_blocks"], counters["dropped_blocks"]) == (12, 0)
    assert_loads_what_a_computed(b, a, 4)


def test_a_save_answered_after_its_step_is_copied_before_the_next_step_writes(
        model_dir: str, daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Reserve of A's one-token request is answered after its only step ended:
    wait_for_save returns without waiting for it, and the next step, whose request takes over
    the vLLM blocks it held (8 blocks: room for one request), copies its 6 blocks before that
    step's forward pass overwrites them. B loads all 6 and generates what A did."""
    sent = answered_after(monkeypatch, 0.3)
    a = Engine.start(vllm_config(model_dir, daemon.socket_path), num_blocks=8)
    b = Engine.start(vllm_config(model_dir, daemon.socket_path))

    def unanswered() -> None:
        assert len(sent) == 1 and not sent[0].done()  # the step ended before its answer

    try:
        two_requests_over_the_same_blocks(a, b, unanswered)
    finally:
        a.close()
        b.close()


def test_a_steps_copy_is_made_after_wait_for_save_returns(
        model_dir: str, daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy of a step's blocks into the arena takes 0.3 s: ``wait_for_save`` returns
    without it (the step's tokens are sampled meanwhile; the committer thread, or else the
    next step's first hook, makes it). The next step, whose request takes over the vLLM blocks
    the copy reads (8 blocks: room for one request), has it made before its forward pass: B
    loads all 6 and generates what A did."""
    from tierd.connector.vllm.connector.sinks import LayerViews

    real_store = LayerViews.store
    copies: list[float] = []

    def slow_store(views: LayerViews, *args: Any) -> None:
        time.sleep(0.3)
        copies.append(time.monotonic())
        real_store(views, *args)

    monkeypatch.setattr(LayerViews, "store", slow_store)
    a = Engine.start(vllm_config(model_dir, daemon.socket_path), num_blocks=8)
    b = Engine.start(vllm_config(model_dir, daemon.socket_path))
    real_wait = a.worker.wait_for_save
    waits: list[float] = []

    def timed_wait() -> None:
        started = time.monotonic()
        real_wait()
        waits.append(time.monotonic() - started)

    a.worker.wait_for_save = timed_wait
    try:
        two_requests_over_the_same_blocks(a, b, lambda: None)
        assert len(copies) == 2 and max(waits) < 0.15, (copies, waits)
    finally:
        a.close()
        b.close()


def test_a_save_answered_after_the_last_step_lands_while_the_engine_idles(
        model_dir: str, daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """No step follows the one whose Reserve is answered late (the engine goes idle): the
    committer thread copies and commits its 6 blocks, which the daemon holds within a second
    with no further step or flush of A's; B loads them all."""
    sent = answered_after(monkeypatch, 0.2)
    a = Engine.start(vllm_config(model_dir, daemon.socket_path))
    b = Engine.start(vllm_config(model_dir, daemon.socket_path))
    try:
        request = make_request("a1", prompt(6), max_tokens=1)
        hashes = list(request.block_hashes[:6])
        run_alone(a, request)
        assert len(sent) == 1 and not sent[0].done()
        deadline = time.monotonic() + 5.0
        held: list[str] = []
        with daemon.client() as client:
            looker = client.register_engine(engine_layout(a.config), engine_name="looker")
            while len(held) < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
                held = client.lookup(looker.engine_id, hashes)
            client.unregister_engine(looker.engine_id)
        assert held == ["dram"] * 6
        assert_loads_what_a_computed(b, a, 6)
    finally:
        a.close()
        b.close()


SLOW = 1.0
"""Seconds every Acquire of the slow daemon takes."""


@pytest.mark.parametrize("from_filter", [False, True], ids=["pinned", "from-filter"])
def test_a_slow_daemon_never_blocks_the_scheduler(model_dir: str, daemon: Daemon,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  from_filter: bool) -> None:
    """Every Probe takes ``SLOW`` seconds (a daemon under load); no lookup and no
    ``schedule()`` waits for the daemon, the daemon is asked (and counts) the request once
    however many steps asked, and the request samples A's tokens. A hit pinned by a lookup:
    vLLM's lookup answers None within ``lookup_wait_seconds`` at every step while the job
    waits, then the hit (6 blocks), which loads. A hit answered from the presence filter: the
    first ask answers it at once; the worker's Probe is not answered within
    ``probed.PROBE_WAIT_SECONDS``, so the forward pass waits no longer and vLLM recomputes
    the blocks; the late Probe's lease is released when it comes. One such failure changes
    nothing (the next hit is answered from the filter, and fails too); after the second, a new
    hit is pinned by a lookup first for a while (answered None while that lookup waits), and
    loads."""
    a = Engine.start(vllm_config(model_dir, daemon.socket_path))
    b = Engine.start(vllm_config(model_dir, daemon.socket_path,
                                 extra={"answer_from_filter": from_filter}))
    stored = prompt(7)
    try:
        want = a.run([make_request("a", stored)])["a"]
        later = a.run([make_request("a2", prompt(8))])["a2"]
        again = a.run([make_request("a3", prompt(9))])["a3"]
        real_probe = TierdClient.probe
        counted_asks: list[int] = []

        def slow(client: TierdClient, engine_id: str, hashes: list[bytes], **flags: Any) -> Any:
            counted_asks.append(len(hashes))
            time.sleep(SLOW)
            return real_probe(client, engine_id, hashes, **flags)

        def slow_sent(client: TierdClient, *args: Any) -> Sent[Any]:
            return answered_on_a_thread(lambda: slow(client, *args))

        monkeypatch.setattr(TierdClient, "probe", slow)
        monkeypatch.setattr(TierdClient, "probe_sent", slow_sent)
        answers: list[tuple[Any, float]] = []
        lookup = b.connector.get_num_new_matched_tokens

        def timed(request: Any, num_computed: int) -> Any:
            start = time.perf_counter()
            answer = lookup(request, num_computed)
            answers.append((answer, time.perf_counter() - start))
            return answer

        b.connector.get_num_new_matched_tokens = timed
        steps: list[float] = []
        schedule = b.scheduler.schedule

        def timed_schedule() -> Any:
            start = time.perf_counter()
            out = schedule()
            steps.append(time.perf_counter() - start)
            return out

        b.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
        assert b.run([make_request("b", stored)], max_steps=50_000)["b"] == want
        said = [answer for answer, _ in answers]
        assert max(seconds for _, seconds in answers) < SLOW / 4
        assert max(steps) < SLOW / 2
        if not from_filter:
            assert said[0] == (None, False) and said[-1] == (6 * BLOCK, False)
            assert said[:-1] == [(None, False)] * (len(said) - 1) and len(said) > 10
            assert b.worker.worker_counters.data["loaded_blocks"] == 6
            assert counted_asks == [6]
        else:  # one failed load changes nothing; a second of the last 20 backs off
            assert said[0] == (6 * BLOCK, False) and b.invalid_reported
            assert b.worker.worker_counters.data["loaded_blocks"] == 0 and counted_asks == [6]
            answers.clear()
            assert b.run([make_request("b1", prompt(9))], max_steps=50_000)["b1"] == again
            assert answers[0][0] == (6 * BLOCK, False) and counted_asks == [6, 6]
            assert b.worker.worker_counters.data["loaded_blocks"] == 0
            answers.clear()
            assert b.run([make_request("b2", prompt(8))], max_steps=50_000)["b2"] == later
            assert answers[0][0] == (None, False) and answers[-1][0] == (6 * BLOCK, False)
            assert b.worker.worker_counters.data["loaded_blocks"] == 6
            assert counted_asks == [6, 6, 6]
        deadline = time.monotonic() + SLOW + 10.0  # a late Probe's lease is released later
        while daemon.pinned_blocks() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.pinned_blocks() == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("daemon", ["demote-all"], indirect=True)
def test_an_ssd_hit_is_staged_by_the_job_when_not_streamed(model_dir: str, daemon: Daemon,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """CUDA KV's path (no streamed loads) for a prefix held only on SSD: the lookup job's counted
    Acquire finds no DRAM run and names 6 SSD blocks, then stages them into DRAM and pins them;
    vLLM is told None until then, then 6 blocks as a synchronous load (hit source: disk), which
    loads A's bytes: B samples A's tokens, the daemon counted one lookup, nothing stays pinned."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from tierd.types import BlockHash

    a = Engine.start(vllm_config(model_dir, daemon.socket_path))
    b = Engine.start(vllm_config(model_dir, daemon.socket_path,  # "not yet" while it stages
                                 extra={"lookup_wait_seconds": 0}))
    b.connector._scheduler._stream = False  # as with CUDA KV
    stored = prompt(9)
    try:
        request = make_request("a", stored)
        want = a.run([request])["a"]
        hashes = [BlockHash(h) for h in request.block_hashes[:6]]
        with daemon.client() as client:
            probe = client.register_engine(b.connector._scheduler._links[0].layout, "probe")
            for _ in range(600):
                if client.lookup(probe.engine_id, hashes) == ["ssd"] * 6:
                    break
                time.sleep(0.05)
            client.unregister_engine(probe.engine_id)
        queries, _ = daemon_counts(daemon)
        answers: list[Any] = []
        lookup = b.connector.get_num_new_matched_tokens
        b.connector.get_num_new_matched_tokens = (  # type: ignore[method-assign]
            lambda r, n: answers.append(lookup(r, n)) or answers[-1])
        sources: list[Any] = []
        hit_sources = b.connector.get_external_cache_hit_sources
        b.connector.get_external_cache_hit_sources = (  # type: ignore[method-assign]
            lambda r, n: sources.append(hit_sources(r, n)) or sources[-1])
        assert b.run([make_request("b", stored)], max_steps=50_000)["b"] == want
        assert answers[0] == (None, False) and answers[-1] == (6 * BLOCK, False)
        assert sources == [{CacheHitSource.DISK: 6 * BLOCK}]
        assert daemon_counts(daemon)[0] - queries == 6 * BLOCK
        assert b.worker.worker_counters.data["loaded_blocks"] == 6
        assert daemon.pinned_blocks() == 0
    finally:
        a.close()
        b.close()
