"""Loads and saves through the fake vLLM: a prefix saved in one KV order loads bit-exact in another,
matches stop before the last token, decode blocks saved as they fill, a preempted request resumes
from tierd, and what is never loaded or saved twice."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
import torch
from fake_vllm import FakeRequest, ask, prompt, usage

from tierd.connector.vllm.connector import TierdConnectorMetadata
from tierd.connector.vllm.connector.step_stock import StepStock


@pytest.mark.parametrize("saver, loader", [("LBHNC", "LBNHC"), ("LBNHC", "BLNHC"),
                                           ("BLNHC", "LBHNC"), ("LBNHC", "separate")])
def test_prefix_saved_in_one_order_loads_bit_exact_in_another(sock: str, engines: Any,
                                                              saver: str, loader: str) -> None:
    """A (KV buffer in ``saver`` order) saves 6 blocks; B (``loader``) loads them bit-exact."""
    a, b = engines(0, order=saver), engines(20, order=loader)
    assert a.kv[0]["model.layers.1.self_attn.attn"].stride() != \
        b.kv[0]["model.layers.1.self_attn.attn"].stride()
    req_a, req_b = FakeRequest("a", prompt(100)), FakeRequest("b", prompt(100))
    assert a.prefill(req_a) == (0, set())
    assert a.counters() == (0, 0, 6, 0, 0) and usage(sock) == (6, 0)
    assert b.prefill(req_b) == (96, set())
    assert b.counters() == (6, 0, 0, 0, 0) and b.computed_tokens == 4
    ids_a, ids_b = a.tables["a"], b.tables["b"]
    assert ids_a == list(range(0, 7)) and ids_b == list(range(20, 27))
    for block_a, block_b in zip(ids_a, ids_b):
        assert torch.equal(a.block(block_a), b.block(block_b))
    assert b.block(ids_b[0]).abs().sum() > 0
    a.finish(req_a)
    b.finish(req_b)
    assert usage(sock) == (6, 0)


def test_a_hit_loads_under_the_scheduler_pin_with_no_worker_call(sock: str, engines: Any,
                                                                  monkeypatch: Any) -> None:
    """B's worker loads A's 6 blocks bit-exact under the scheduler's pin: it makes no daemon
    call for the load (its Acquire and Release would raise), and the pin is released once the
    worker has reported the load."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    client = b.workers[0]._worker.link.client
    for name in ("acquire", "release"):
        monkeypatch.setattr(client, name, lambda *args, **kw: pytest.fail("a worker call"))
    assert b.prefill(FakeRequest("b", prompt(100))) == (96, set())
    assert b.counters() == (6, 0, 0, 0, 0) and usage(sock) == (6, 0)
    for block_a, block_b in zip(a.tables["a"], b.tables["b"][:6]):
        assert torch.equal(a.block(block_a), b.block(block_b))


def test_a_finished_request_keeps_its_pin_until_the_workers_report(sock: str,
                                                                    engines: Any) -> None:
    """X finishes after its load is planned and before the workers' report arrives (async
    scheduling): its 6 blocks stay pinned until that report, then nothing is pinned."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    x = FakeRequest("x", prompt(100))
    assert b.admit(x) == 96
    out = b.step([x], deliver=False)
    assert b.scheduler.request_finished(x, []) == (False, None)
    assert usage(sock) == (6, 6)
    b.deliver(out)
    assert usage(sock) == (6, 0)


def test_a_save_is_reserved_before_the_forward_pass(engines: Any, monkeypatch: Any,
                                                    copy_path: str) -> None:
    """A step that saves (and loads nothing: vLLM calls start_load_kv after the forward pass)
    sends its Reserve at bind_connector_metadata, before the forward pass, and waits
    for the answer only where it needs the slots: at wait_for_save for host KV, at the first
    layer on the CUDA path (its gathers)."""
    a = engines(0)
    connector = a.workers[0]
    client = connector._worker.link.client
    events: list[str] = []
    reserve_sent, save_kv_layer = client.reserve_sent, connector.save_kv_layer
    wait_for_save = connector.wait_for_save

    def reserve(*args: Any, **kwargs: Any) -> Any:
        events.append("reserve")
        reply = reserve_sent(*args, **kwargs)
        result = reply.result

        def waited(*args: Any, **kwargs: Any) -> Any:
            events.append("waited")
            return result(*args, **kwargs)
        reply.result = waited
        return reply

    monkeypatch.setattr(client, "reserve_sent", reserve)
    monkeypatch.setattr(connector, "save_kv_layer",
                        lambda *args: (events.append("layer"), save_kv_layer(*args))[1])
    monkeypatch.setattr(connector, "wait_for_save",
                        lambda: (events.append("finish"), wait_for_save())[1])
    a.prefill(FakeRequest("a", prompt(100)))
    assert a.counters() == (0, 0, 6, 0, 0)
    if copy_path == "host":
        assert events == ["reserve", "layer", "layer", "layer", "finish", "waited"]
    else:
        assert events == ["reserve", "layer", "waited", "layer", "layer", "finish"]


def test_a_saves_reserve_is_answered_to_the_worker_thread_itself(engines: Any) -> None:
    """Over the lane, a step's Reserve is sent from the worker's thread and its answer read
    there: the blocks are stored and the worker's client never started a call thread (one
    would have to run on the forward pass's core to send the call and to take its answer)."""
    a = engines(0)
    client = a.workers[0]._worker.link.client
    a.prefill(FakeRequest("a", prompt(100)))
    assert a.counters() == (0, 0, 6, 0, 0)
    assert client.on_lane and client._calls is None


def test_saving_steps_commits_share_a_round_trip_sent_by_the_workers_thread(
        sock: str, engines: Any, monkeypatch: Any) -> None:
    """Five steps each save a request's 6 blocks by hash (no stock): their Commits wait until
    ``SEND_AT`` (4) are
    queued, then go out in one CommitMany sent by the worker's own thread when the next step
    begins; the fifth goes when the counters are taken (waiting lands every Commit at once).
    The committer thread sends none, and every block is stored."""
    import tierd.connector.vllm.connector.commits as commits

    by_thread, by_worker = _count_commit_calls(monkeypatch)
    monkeypatch.setattr(commits, "WINDOW_SECONDS", 60.0)
    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    monkeypatch.setattr(commits, "IDLE_SECONDS", 60.0)  # a slow test step is no idle engine
    monkeypatch.setattr(StepStock, "take", lambda self, session, count: None)  # by hash
    a = engines(0)
    for i in range(5):
        req = FakeRequest(f"r{i}", prompt(96, salt=i))
        a.admit(req)
        a.step([req])
        assert by_worker == ([] if i < 4 else [4])
    began = time.monotonic()
    assert a.counters() == (0, 0, 30, 0, 0) and usage(sock) == (30, 0)
    assert time.monotonic() - began < 30.0
    assert by_worker == [4, 1] and by_thread == []


def test_a_commit_that_waited_its_hold_goes_out_with_the_next_step(
        sock: str, engines: Any, monkeypatch: Any) -> None:
    """With no hold, each saving step's Commit (by hash: no stock) goes out alone at the next
    step's start, from the worker's thread: a Commit waits for company at most
    ``HOLD_SECONDS``."""
    import tierd.connector.vllm.connector.commits as commits

    by_thread, by_worker = _count_commit_calls(monkeypatch)
    monkeypatch.setattr(commits, "WINDOW_SECONDS", 60.0)
    monkeypatch.setattr(commits, "HOLD_SECONDS", 0.0)
    monkeypatch.setattr(commits, "IDLE_SECONDS", 60.0)  # a slow test step is no idle engine
    monkeypatch.setattr(StepStock, "take", lambda self, session, count: None)  # by hash
    a = engines(0)
    for i in range(3):
        req = FakeRequest(f"r{i}", prompt(96, salt=i))
        a.admit(req)
        a.step([req])
        assert by_worker == [1] * i
    assert a.counters() == (0, 0, 18, 0, 0) and usage(sock) == (18, 0)
    assert by_worker == [1, 1, 1] and by_thread == []


def _count_commit_calls(monkeypatch: Any) -> tuple[list[int], list[int]]:
    """The Commits per CommitMany sent by the committer thread and by the worker's thread."""
    import tierd.connector.vllm.connector.commits as commits
    from tierd.wire.client import TierdClient

    by_thread: list[int] = []
    by_worker: list[int] = []
    commit_many, sent = commits.commit_many, TierdClient.commit_many_sent

    def on_thread(client: Any, batch: Any) -> Any:
        by_thread.append(len(batch))
        return commit_many(client, batch)

    def on_worker(self: Any, engine_id: str, batch: Any) -> Any:
        by_worker.append(len(batch))
        return sent(self, engine_id, batch)

    monkeypatch.setattr(commits, "commit_many", on_thread)
    monkeypatch.setattr(TierdClient, "commit_many_sent", on_worker)
    return by_thread, by_worker


def test_a_commit_no_step_sends_is_landed_by_the_committer_thread(
        sock: str, engines: Any, monkeypatch: Any) -> None:
    """The engine goes idle after a saving step: no step sends its Commit, so the committer
    thread lands it once no step has begun for ``IDLE_SECONDS``, long before its hold (a
    minute) has passed, with nothing asked of the worker meanwhile."""
    import tierd.connector.vllm.connector.commits as commits

    monkeypatch.setattr(commits, "WINDOW_SECONDS", 0.05)
    monkeypatch.setattr(commits, "HOLD_SECONDS", 60.0)
    by_thread: list[int] = []
    commit_many = commits.commit_many

    def on_thread(client: Any, batch: Any) -> Any:
        by_thread.append(len(batch))
        return commit_many(client, batch)

    monkeypatch.setattr(commits, "commit_many", on_thread)
    a = engines(0)
    req = FakeRequest("idle", prompt(96))
    a.admit(req)
    a.step([req])
    deadline = time.monotonic() + 30.0
    while not by_thread and time.monotonic() < deadline:  # nothing of A's flushes it
        time.sleep(0.01)
    assert by_thread == [1]
    assert a.counters() == (0, 0, 6, 0, 0) and usage(sock) == (6, 0)


def test_a_commit_the_daemon_never_answers_fails_after_the_timeout(engines: Any) -> None:
    """A Commit the worker sent whose answer never comes (a daemon that hangs) is not waited
    for: once the link's timeout has passed it fails (its blocks dropped) and is forgotten, so
    no unanswered call piles up."""
    from concurrent.futures import Future

    import tierd.connector.vllm.connector.commits as commits
    from tierd.connector.core.save import Reservation

    class Silent:
        def done(self) -> bool:
            return False

        def result(self) -> Any:
            raise AssertionError("a Commit that is not done is never waited for")

    a = engines(0)
    committer = a.workers[0]._worker._commits
    item = commits._Queued(Reservation("e", "lease", [1, 2], [False, False]), [True, True],
                           None, Future(), 0.0)
    committer._sent.append((Silent(), [item], time.monotonic()))
    committer._futures.append((None, item.outcome))
    committer.harvest()
    assert not item.outcome.done() and len(committer._sent) == 1
    committer._sent[0] = (Silent(), [item], time.monotonic() - a.workers[0]._worker.link
                          .timeout_seconds)
    committer.harvest()
    assert committer._sent == [] and item.outcome.done()
    stored, held, lost, exc = item.outcome.result()
    assert (stored, held, lost) == (0, 0, 2) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_window_naming_two_engines_commits_each_on_its_own(sock: str) -> None:
    """A window whose Commits name two engines (the daemon restarted within it: the old
    session's and the new one's) sends one CommitMany per engine, and every Commit lands."""
    from concurrent.futures import Future

    import tierd.connector.vllm.connector.commits as commits
    from tierd.connector.core.save import Reservation
    from tierd.types import BlockHash
    from tierd.wire.client import TierdClient
    from tierd.wire.layout import Layout

    layout = Layout(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16",
                    block_size=16, model_id="commit-window@test")
    batch = []
    with TierdClient(socket_path=sock) as client:
        for k, name in enumerate(("old", "new")):
            engine = client.register_engine(layout, engine_name=name)
            got = client.reserve(engine.engine_id, [BlockHash(bytes([k, i]) * 16)
                                                    for i in range(2)])
            batch.append(commits._Queued(Reservation(engine.engine_id, got.lease_id,
                                                     got.slot_ids, got.already_stored),
                                         [True, True], None, Future(), 0.0))
        assert commits._landed(client, batch) == [(2, 0, 0, None), (2, 0, 0, None)]


def test_matches_stop_before_last_token_and_after_local_hit(sock: str, engines: Any) -> None:
    """6 blocks stored: a 96-token prompt matches 5, beyond a 2-block local hit 3, beyond 5 none."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(96)))
    assert a.counters() == (0, 0, 6, 0, 0)
    req = FakeRequest("b", prompt(96))
    asks = [(req, 0), (req, 32), (req, 80), (FakeRequest("c", prompt(97)), 0),
            (FakeRequest("d", prompt(96, salt=1)), 0),
            (FakeRequest("e", prompt(40) + prompt(56, salt=2)), 0)]
    assert [ask(b.scheduler, r, n) for r, n in asks] == [
        (80, False), (48, False), (0, False), (96, False), (0, False), (32, False)]
    assert usage(sock) == (6, 6)  # c pins blocks 0-5, e 0-1; b's last lookup dropped its pin
    for r, _ in asks:
        assert b.scheduler.request_finished(r, []) == (False, None)
    assert usage(sock) == (6, 0)


def test_decode_blocks_are_saved_once_as_they_fill(sock: str, engines: Any) -> None:
    """A 30-token prefill saves block 0; decoding saves block 1 at token 32, block 2 at 48."""
    a = engines(0)
    req = FakeRequest("a", prompt(30))
    a.prefill(req)
    assert a.counters() == (0, 0, 1, 0, 0)
    saved = []
    for token in range(18):  # positions 30..47
        a.decode(req, 7 + token)
        saved.append(a.counters()[2])
    assert saved == [1, 2] + [2] * 15 + [3]
    assert a.counters() == (0, 0, 3, 0, 0) and usage(sock) == (3, 0)
    probe = FakeRequest("b", list(req.all_token_ids) + [1])
    b = engines(20)
    assert ask(b.scheduler, probe, 0) == (48, False)
    assert b.scheduler.request_finished(probe, []) == (False, None)


def test_preempted_request_resumes_from_tierd(sock: str, engines: Any) -> None:
    """Preempted after 50 tokens, a request resumes into other blocks loading 3 of its 4."""
    a = engines(0)
    req = FakeRequest("a", prompt(40))
    a.prefill(req)
    for token in range(10):
        a.decode(req, 100 + token)
    assert a.counters() == (0, 0, 3, 0, 0)
    before = [a.block(b).clone() for b in a.tables["a"][:3]]
    computed = a.computed_tokens
    a.preempt(req)
    assert a.admit(req) == 48
    assert a.step([req]).invalid_block_ids == set()
    ids = a.tables["a"]
    assert ids == [4, 5, 6, 7] and a.computed_tokens - computed == 2
    load, = a.metas[-1].loads
    assert a.metas[-1].saves == [] and (load.req_id, load.block_ids, load.block_hashes) == (
        "a", [4, 5, 6], [bytes(h) for h in req.block_hashes[:3]])
    assert [len(run.slot_ids) for run in load.pinned] == [3]  # loaded under the scheduler's pin
    assert all(torch.equal(a.block(ids[i]), before[i]) for i in range(3))
    assert a.counters() == (3, 0, 3, 0, 0) and usage(sock) == (3, 0)
    for token in range(14):  # positions 50..63: block 3 fills at the last one
        a.decode(req, 200 + token)
    assert a.counters() == (3, 0, 4, 0, 0)


def test_already_stored_blocks_are_skipped(engines: Any) -> None:
    """B (loading off) computes A's prompt cold: its 6 saves are skipped as already stored."""
    a, b = engines(0), engines(20, load=False)
    a.prefill(FakeRequest("a", prompt(100)))
    assert b.prefill(FakeRequest("b", prompt(100))) == (0, set())
    assert b.counters() == (0, 0, 0, 6, 0)


def test_request_without_block_hashes_is_neither_loaded_nor_saved(engines: Any) -> None:
    """A request carrying no block hashes gets 0 matches and plans no save."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    assert b.prefill(FakeRequest("b", prompt(100), hashed=False)) == (0, set())
    assert b.metas[-1] == TierdConnectorMetadata(step=len(b.metas), prefill_tokens=100)
    assert b.counters() == (0, 0, 0, 0, 0)


def test_local_prefix_cache_hit_is_not_saved_again(engines: Any) -> None:
    """A request with a 2-block local hit (no tierd hit beyond it) saves its blocks 2-5 only."""
    a = engines(0)
    a.prefill(FakeRequest("a", prompt(100)))
    req = FakeRequest("b", prompt(32) + prompt(68, salt=1))
    assert a.admit(req, local_hit=32, shared=a.tables["a"][:2]) == 0
    a.step([req])
    assert [s.block_ids for s in a.metas[-1].saves] == [a.tables["b"][2:6]]
    assert a.counters() == (0, 0, 10, 0, 0)



def test_a_step_slower_than_half_its_write_lease_reoffers_its_saves(sock: str,
                                                                    engines: Any) -> None:
    """A's worker clock jumps 1,000 s on every reading, so its prefill step outlasts half its
    write lease between the Reserve and wait_for_save: the 6 blocks are reserved and copied
    again, stored once, the old reservation freed; B loads them bit-exact."""
    a, b = engines(0), engines(20)
    worker = a.workers[0]._worker
    now = [time.monotonic()]

    def jumping() -> float:
        now[0] += 1000.0
        return now[0]

    worker._clock = jumping
    req_a, req_b = FakeRequest("a", prompt(100)), FakeRequest("b", prompt(100))
    assert a.prefill(req_a) == (0, set())
    assert a.counters() == (0, 0, 6, 0, 0) and usage(sock) == (6, 0)
    assert a.workers[0].worker_counters.data["reoffered_blocks"] == 6
    assert b.prefill(req_b) == (96, set())
    for block_a, block_b in zip(a.tables["a"][:6], b.tables["b"][:6]):
        assert torch.equal(a.block(block_a), b.block(block_b))


def test_a_certain_miss_is_answered_from_the_presence_filter_and_still_counted(
        sock: str, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt nobody stored: its first ask answers 0 at once with no Probe (the daemon's
    presence filter holds none of its blocks), and the step after reports its 6 blocks' tokens,
    so the daemon counts them as queried, none hit. Once stored, the same prompt is probed and
    hit."""
    from tierd.wire.client import TierdClient

    real_probe, probed = TierdClient.probe, []

    def spy(client: TierdClient, engine_id: str, hashes: Any, **flags: Any) -> Any:
        probed.append(len(hashes))
        return real_probe(client, engine_id, hashes, **flags)

    monkeypatch.setattr(TierdClient, "probe", spy)

    def queried() -> int:
        usage(sock)  # every scheduler-side call landed
        with TierdClient(socket_path=sock) as client:
            return next(t.query_tokens for t in client.stats().tiers if t.tier == "dram")

    a, b = engines(0), engines(20)
    before = queried()
    assert a.prefill(FakeRequest("a", prompt(100, salt=5))) == (0, set())
    assert probed == [] and queried() == before + 96
    assert b.prefill(FakeRequest("b", prompt(100, salt=5))) == (96, set())
    assert probed == [6]


def _dram_query_tokens(sock: str) -> int:
    """The daemon's query tokens as it counts them now (nothing awaited)."""
    from tierd.wire.client import TierdClient

    with TierdClient(socket_path=sock) as client:
        return next(t.query_tokens for t in client.stats().tiers if t.tier == "dram")


def test_certain_misses_are_counted_in_one_report_per_period(
        sock: str, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts nobody stored, one step each, within one report period: nothing reaches
    the daemon until the period ends (here it never does), then one report carries all three
    prompts' tokens (``drain`` sends it, as the period's end would)."""
    from tierd.connector.vllm.connector import filtered

    reports: list[int] = []
    real_report = filtered.report_filtered

    def spy(link: Any, tokens: int) -> None:
        reports.append(tokens)
        real_report(link, tokens)

    monkeypatch.setattr(filtered, "report_filtered", spy)
    a = engines(0)
    side = a.scheduler._scheduler
    side._filtered.seconds = 3600.0  # no timer fires during the test
    before = _dram_query_tokens(sock)
    for salt in (11, 12, 13):
        assert a.prefill(FakeRequest(f"m{salt}", prompt(100, salt=salt))) == (0, set())
    assert reports == [] and _dram_query_tokens(sock) == before
    usage(sock)  # drains the scheduler side: its counted lookups are reported first
    assert reports == [3 * 96] and _dram_query_tokens(sock) == before + 3 * 96


def test_a_certain_miss_is_counted_within_the_report_period_without_another_step(
        sock: str, engines: Any) -> None:
    """After one certain miss and no further step, the daemon counts its tokens within
    ``REPORT_SECONDS`` (a timer sends them; nothing drains the scheduler side here)."""
    from tierd.connector.vllm.connector.filtered import REPORT_SECONDS

    a = engines(0)
    before = _dram_query_tokens(sock)
    assert a.prefill(FakeRequest("m", prompt(100, salt=14))) == (0, set())
    deadline = time.monotonic() + REPORT_SECONDS + 10.0  # the period, and a slow host's slack
    while _dram_query_tokens(sock) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dram_query_tokens(sock) == before + 96


def test_each_period_s_certain_misses_are_counted_by_one_reporter_thread(
        sock: str, engines: Any) -> None:
    """Two certain misses, the second after the first one's report landed: each is counted
    within ``REPORT_SECONDS`` with no further step, and one reporter thread sent both (none is
    started per report: starting one makes vLLM's scheduler thread wait for it)."""
    from tierd.connector.vllm.connector.filtered import REPORT_SECONDS

    a = engines(0)
    filtered = a.scheduler._scheduler._filtered
    before = _dram_query_tokens(sock)
    reporters = []
    for salt, counted in ((15, 96), (16, 2 * 96)):
        assert a.prefill(FakeRequest(f"m{salt}", prompt(100, salt=salt))) == (0, set())
        deadline = time.monotonic() + REPORT_SECONDS + 10.0  # the period, and a slow host's slack
        while _dram_query_tokens(sock) < before + counted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _dram_query_tokens(sock) == before + counted
        reporters.append(filtered._reporter)
    assert reporters[0] is reporters[1] and reporters[0].is_alive()
    assert not any(isinstance(t, threading.Timer) for t in threading.enumerate())


def test_a_lookup_done_within_lookup_wait_is_answered_at_the_first_ask(sock: str,
                                                                         engines: Any) -> None:
    """With ``lookup_wait_seconds`` 1 the first ask of a 6-block hit waits for its Probe and
    answers the hit (the request starts this step); with 0 the first ask answers None and a
    later one the hit."""
    a = engines(0)
    a.prefill(FakeRequest("a", prompt(100)))
    waiting, eager = engines(20, lookup_wait_seconds=1.0), engines(40, lookup_wait_seconds=0)
    assert waiting.scheduler.get_num_new_matched_tokens(FakeRequest("w", prompt(100)), 0) == \
        (96, False)
    req = FakeRequest("e", prompt(100))
    assert eager.scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
    assert ask(eager.scheduler, req, 0) == (96, False)
    for conn, name in ((waiting.scheduler, "w"), (eager.scheduler, "e")):
        assert conn.request_finished(FakeRequest(name, prompt(100)), []) == (False, None)


def test_a_lookup_that_would_hold_the_running_requests_longer_than_a_step_is_not_waited_for(
        sock: str, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Probe takes 0.2 s and ``lookup_wait_seconds`` is 1. Until the lookups' latency and
    the steps' period are measured, the first ask waits and answers the hit. Then, with two
    requests running and steps a few milliseconds apart, the first ask of a new hit answers None
    at once (waiting would hold three requests 0.2 s each; not waiting costs the new one a
    step), and a later ask the hit; with no request running, the first ask waits again."""
    from tierd.wire.client import TierdClient

    a, b = engines(0), engines(20, lookup_wait_seconds=1.0)
    a.prefill(FakeRequest("a", prompt(100)))
    real_probe = TierdClient.probe

    def slow(client: TierdClient, engine_id: str, hashes: Any, **flags: Any) -> Any:
        time.sleep(0.2)
        return real_probe(client, engine_id, hashes, **flags)

    monkeypatch.setattr(TierdClient, "probe", slow)
    running = [FakeRequest(f"r{i}", prompt(100)) for i in range(2)]
    for req in running:  # latency measured, no step yet: both waited for
        assert b.scheduler.get_num_new_matched_tokens(req, 0) == (96, False)
        b.admit(req)
    for _ in range(3):
        b.step(running)
    late = FakeRequest("late", prompt(100))
    start = time.perf_counter()
    assert b.scheduler.get_num_new_matched_tokens(late, 0) == (None, False)
    assert time.perf_counter() - start < 0.1
    assert ask(b.scheduler, late, 0) == (96, False)
    for req in running:
        b.finish(req)
    for _ in range(3):
        b.step([])
    alone = FakeRequest("alone", prompt(100))
    assert b.scheduler.get_num_new_matched_tokens(alone, 0) == (96, False)
    for req in (late, alone):
        assert b.scheduler.request_finished(req, []) == (False, None)


def test_a_slow_daemon_answers_none_at_once_then_the_hit(sock: str, engines: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Probe takes 0.5 s: the lookup answers None within 0.1 s at each ask while its job
    waits, then the 6-block hit; the daemon saw one Probe (a hold) for the request."""
    from tierd.wire.client import TierdClient

    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    real_probe, counted = TierdClient.probe, []

    def slow(client: TierdClient, engine_id: str, hashes: Any, **flags: Any) -> Any:
        counted.append(bool(flags.get("hold")))
        time.sleep(0.5)
        return real_probe(client, engine_id, hashes, **flags)

    monkeypatch.setattr(TierdClient, "probe", slow)
    req = FakeRequest("b", prompt(100))
    answers, longest = [], 0.0
    for _ in range(400):
        start = time.perf_counter()
        answers.append(b.scheduler.get_num_new_matched_tokens(req, 0))
        longest = max(longest, time.perf_counter() - start)
        if answers[-1][0] is not None:
            break
        time.sleep(0.01)
    assert answers[-1] == (96, False) and set(answers[:-1]) == {(None, False)}
    assert len(answers) > 10 and longest < 0.1 and counted == [True]
    assert b.scheduler.request_finished(req, []) == (False, None)
