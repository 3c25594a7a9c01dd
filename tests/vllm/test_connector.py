"""TierdConnector inside real vLLM 0.33: vLLM's Scheduler/AsyncScheduler and connector factory,
KV tensors from vLLM's allocator in every layout, a real `tierd serve`."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")

import torch  # noqa: E402
from harness import BLOCK, HEAD, Daemon, Engine, engine_layout, make_request, vllm_config  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = [(i * 37 + 11) % 997 for i in range(6 * BLOCK + 5)]  # 6 full blocks and a tail
LAYOUTS = list(KVCacheLayout)

PINNED = {"answer_from_filter": False}
"""Extra config of an engine whose hits are pinned by a lookup first (never answered from the
presence filter): the subject of the tests of the pin between lookup and load."""


def baseline(model_dir: str, daemon: Daemon, prompt: list[int], tp: int = 1) -> list[int]:
    """The tokens of a run with tierd's loading and saving off (the reference)."""
    engine = Engine.start(vllm_config(model_dir, daemon.socket_path, tp=tp,
                                      extra={"load": False, "save": False}))
    try:
        return engine.run([make_request("ref", prompt)])["ref"]
    finally:
        engine.close()


def wait_on_ssd(daemon: Daemon, engine: Engine, hashes: list[Any]) -> None:
    """Wait (readiness, up to 30 s) until ``hashes`` are held on SSD only (the daemon's 50 ms
    demotion pass of a "demote-all" daemon)."""
    import time

    with daemon.client() as client:
        probe = client.register_engine(engine_layout(engine.config), "probe")
        for _ in range(600):
            if client.lookup(probe.engine_id, hashes) == ["ssd"] * len(hashes):
                break
            time.sleep(0.05)
        assert client.lookup(probe.engine_id, hashes) == ["ssd"] * len(hashes)
        client.unregister_engine(probe.engine_id)


def restart_before_first_load(engine: Engine, daemon: Daemon) -> list[bool]:
    """Make ``engine`` kill and restart the daemon (empty) after the first step that plans a
    load was scheduled, before its forward pass; the returned list holds True once done."""
    restarted: list[bool] = []

    def restart(engine: Engine, out: object) -> None:
        if not restarted and out.kv_connector_metadata.loads:  # type: ignore[attr-defined]
            restarted.append(True)
            daemon.restart(kill=True)

    engine.between = restart
    return restarted


def expire_first_load(engine: Engine) -> list[bool]:
    """Make the pins of the first step that plans a load run out before its forward pass (their
    deadline passed, as in a step slower than the lease): that load fails on every rank; the
    returned list holds True once done."""
    expired: list[bool] = []

    def expire(engine: Engine, out: Any) -> None:
        loads = out.kv_connector_metadata.loads
        if not expired and loads:
            expired.append(True)
            loads[:] = [dataclasses.replace(spec, pinned=[
                dataclasses.replace(run, deadline=0.0) for run in spec.pinned]) for spec in loads]

    engine.between = expire
    return expired


def logical_blocks(engine: Engine, req_id: str, count: int) -> list[torch.Tensor]:
    """The first ``count`` blocks of a request, every layer, as logical [H, N, C] bytes."""
    table = engine.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
    return [t.view(torch.uint8)[table[i]].contiguous()
            for t in engine.kv.values() for i in range(count)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_prefix_saved_in_one_layout_loads_byte_exact_in_another(model_dir: str, daemon: Daemon,
                                                                  layout: KVCacheLayout,
                                                                  dtype: str) -> None:
    """An engine in LBNHC saves a prompt; a fresh engine in ``layout`` loads its 6 full blocks
    (every layer byte-identical, logically) and samples the reference tokens."""
    want = baseline(model_dir, daemon, PROMPT)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path, dtype=dtype,
                                     layout=KVCacheLayout.LBNHC))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, dtype=dtype, layout=layout))
    try:
        # keep the first request's blocks alive to compare: run without finishing it
        assert first.run([make_request("a", PROMPT)])["a"] == want
        assert first.worker.worker_counters.data["saved_blocks"] >= 6
        assert second.run([make_request("b", PROMPT)])["b"] == want
        counters = second.worker.worker_counters.data
        assert counters["loaded_blocks"] == 6 and counters["failed_blocks"] == 0
        assert second.invalid_reported == set()
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


def test_fp8_cache_moves_raw_bytes(model_dir: str, daemon: Daemon) -> None:
    """With --kv-cache-dtype fp8 (float8_e4m3fn tensors, which vLLM allows on CPU) blocks are
    stored and loaded as raw bytes: the second engine samples the reference tokens."""
    config = vllm_config(model_dir, daemon.socket_path, cache_dtype="fp8")
    want = baseline(model_dir, daemon, PROMPT)
    first, second = Engine.start(config), Engine.start(
        vllm_config(model_dir, daemon.socket_path, cache_dtype="fp8",
                    layout=KVCacheLayout.LBHNC))
    try:
        assert next(iter(first.kv.values())).dtype == torch.float8_e4m3fn
        assert first.run([make_request("a", PROMPT)])["a"] == want
        assert second.run([make_request("b", PROMPT)])["b"] == want
        assert second.worker.worker_counters.data["loaded_blocks"] == 6
    finally:
        first.close()
        second.close()


def test_async_scheduler_loads_and_saves(model_dir: str, daemon: Daemon) -> None:
    """vLLM's AsyncScheduler (one step in flight) with the connector: same tokens, the hit is
    loaded, every pin is released."""
    want = baseline(model_dir, daemon, PROMPT)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path, async_scheduling=True))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, async_scheduling=True))
    try:
        assert first.run([make_request("a", PROMPT)])["a"] == want
        assert second.run([make_request("b", PROMPT)])["b"] == want
        assert second.worker.worker_counters.data["loaded_blocks"] == 6
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


def test_lookup_reports_hit_sources_to_vllm(model_dir: str, daemon: Daemon) -> None:
    """vLLM's connector prefix-cache stats count tierd's DRAM hits as host hits."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path))
    seen: list[dict[CacheHitSource, int]] = []
    original = second.connector.get_external_cache_hit_sources

    def record(request, tokens):  # type: ignore[no-untyped-def]
        seen.append(original(request, tokens))
        return seen[-1]

    second.connector.get_external_cache_hit_sources = record
    try:
        first.run([make_request("a", PROMPT)])
        second.run([make_request("b", PROMPT)])
        assert seen == [{CacheHitSource.HOST: 6 * BLOCK}]
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("daemon", ["no-ssd-small"], indirect=True)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "from-filter"])
def test_a_hit_evicted_between_lookup_and_load(model_dir: str, daemon: Daemon,
                                               pinned: bool) -> None:
    """Another engine floods the DRAM tier (4 MiB, no SSD) between the scheduler's answer and
    the worker's load. A hit pinned by a lookup is not evicted, so it loads in full. A hit
    answered from the presence filter is not pinned until the worker's Probe, which finds it
    gone: vLLM recomputes it and samples the same tokens. (The arena is small so the flood ends
    well inside the 30 s lease: a lapsed lease is another test's subject.)"""
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path,
                                      extra=PINNED if pinned else None))
    flood = Engine.start(vllm_config(model_dir, daemon.socket_path), num_blocks=4096)

    def evict_everything(engine: Engine, out: object) -> None:
        if engine.between is None or not out.kv_connector_metadata.loads:  # type: ignore[attr-defined]
            return
        engine.between = None
        prompts = [[(i * 7 + j) % 991 for i in range(128 * BLOCK + 1)] for j in range(8)]
        flood.run([make_request(f"f{j}", p, max_tokens=1) for j, p in enumerate(prompts)],
                  max_steps=5000)
        arena_blocks = daemon.dram_bytes // first.worker._worker.format.slot_bytes
        assert flood.worker.worker_counters.data["saved_blocks"] > arena_blocks

    try:
        want = first.run([make_request("a", PROMPT)])["a"]
        second.between = evict_everything
        assert second.run([make_request("b", PROMPT)])["b"] == want
        loaded = second.worker.worker_counters.data["loaded_blocks"]
        assert (loaded, bool(second.invalid_reported)) == ((6, False) if pinned else (0, True))
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()
        flood.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hit_in_dram_is_answered_from_the_filter_and_pinned_by_the_worker(
        model_dir: str, daemon: Daemon, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """B asks for the 6 blocks A stored: vLLM's first ask is answered with the hit, and the
    request loads the 6 blocks and samples A's tokens; the lease is released after the load.
    With "recompute" the hit is answered from the presence filter (it reads the blocks as in
    DRAM): the one Probe of the request is the worker's, not the scheduler's, sent at
    ``handle_preemptions`` (before vLLM prepares the step and binds its metadata). With "fail" (a
    failed load would fail the request) the scheduler pins the hit by its own Probe first."""
    from tierd.wire.client import TierdClient

    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, policy=policy))
    try:
        want = first.run([make_request("a", PROMPT)])["a"]
        probes: list[tuple[str, str]] = []
        for name in ("probe", "probe_sent"):
            def spy(client: TierdClient, *args: Any, name: str = name,
                    real: Any = getattr(TierdClient, name), **flags: Any) -> Any:
                probes.append((name, threading.current_thread().name))
                return real(client, *args, **flags)

            monkeypatch.setattr(TierdClient, name, spy)
        bind = second.worker.bind_connector_metadata
        monkeypatch.setattr(second.worker, "bind_connector_metadata", lambda meta: (
            probes.append(("bind", "")) if meta.loads else None, bind(meta))[1])
        answers: list[Any] = []
        lookup = second.connector.get_num_new_matched_tokens

        def recorded(request: Any, num_computed: int) -> Any:
            answers.append(lookup(request, num_computed))
            return answers[-1]

        second.connector.get_num_new_matched_tokens = recorded
        assert second.run([make_request("b", PROMPT)])["b"] == want
        assert answers[0] == (6 * BLOCK, False) and not second.invalid_reported
        by_scheduler = probes[0][1].startswith("tierd-scheduler")
        if policy == "recompute":  # sent at the step's first hook by the worker's own thread
            assert [name for name, _ in probes] == ["probe_sent", "bind"] and not by_scheduler
            assert not probes[0][1].startswith("tierd-")
            assert second.worker._worker is not None
            assert second.worker._worker.link.client._calls is None
        else:
            assert [name for name, _ in probes] == ["probe", "bind"] and by_scheduler
        assert second.worker.worker_counters.data["loaded_blocks"] == 6
        deadline = time.monotonic() + 10.0  # the release goes out without waiting
        while daemon.pinned_blocks() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(("policy", "async_scheduling"),
                         [("recompute", False), ("fail", False), ("recompute", True)])
def test_a_load_whose_pin_ran_out_is_recomputed_or_fails(model_dir: str, daemon: Daemon,
                                                         policy: str,
                                                         async_scheduling: bool) -> None:
    """The pin on a reported hit runs out before the load. "recompute": the request completes
    with the reference tokens; "fail": vLLM fails it. Either way nothing computed on top of the
    failed load was stored: a third engine that later finds the prompt in tierd loads the
    first engine's 6 blocks (and the 2 after them the recompute stored) and samples the
    reference tokens."""
    longer = PROMPT[:6 * BLOCK] + [(i * 3 + 2) % 991 for i in range(2 * BLOCK + 3)]
    want = baseline(model_dir, daemon, longer)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, policy=policy,
                                      async_scheduling=async_scheduling, extra=PINNED))
    try:
        first.run([make_request("a", PROMPT[:6 * BLOCK + 1])])
        expired = expire_first_load(second)
        got = second.run([make_request("b", longer)])["b"]
        assert expired and second.invalid_reported
        if policy == "recompute":
            assert got == want and second.finish["b"] != "error"
        else:
            assert second.finish["b"] == "error"
        counters = second.worker.worker_counters.data
        assert counters["failed_blocks"] == 6 and counters["dropped_blocks"] == 2
        third = Engine.start(vllm_config(model_dir, daemon.socket_path))
        try:
            assert third.run([make_request("c", longer)])["c"] == want
            loaded = third.worker.worker_counters.data["loaded_blocks"]
            assert loaded == (8 if policy == "recompute" else 6)
        finally:
            third.close()
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


def test_daemon_restart_between_lookup_and_load_still_loads_the_pinned_blocks(
        model_dir: str, daemon: Daemon) -> None:
    """The daemon is killed and restarted (empty) after the scheduler reported a hit and before
    the load: the worker still maps the dead daemon's arena, where nothing writes any more, so
    the pinned blocks verify against their checksums and load; the request samples the
    reference tokens, and its blocks computed after them are stored in the new daemon."""
    longer = PROMPT[:6 * BLOCK] + [(i * 3 + 2) % 991 for i in range(2 * BLOCK + 3)]
    want = baseline(model_dir, daemon, longer)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, extra=PINNED))
    try:
        first.run([make_request("a", PROMPT[:6 * BLOCK + 1])])
        restarted = restart_before_first_load(second, daemon)
        assert second.run([make_request("b", longer)])["b"] == want
        assert restarted and not second.invalid_reported
        assert second.worker.worker_counters.data["loaded_blocks"] == 6
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


def test_failed_load_of_a_shared_block_drops_other_requests_saves(model_dir: str,
                                                                  daemon: Daemon) -> None:
    """Two requests share a prefix that is being loaded; the load fails (its pin ran out):
    neither request's blocks computed on top of it are stored, and a later engine gets the
    reference tokens for both prompts."""
    tail_a = [(i * 5 + 3) % 991 for i in range(2 * BLOCK + 3)]
    tail_b = [(i * 11 + 1) % 991 for i in range(2 * BLOCK + 3)]
    prefix = PROMPT[:6 * BLOCK]
    want_a = baseline(model_dir, daemon, prefix + tail_a)
    want_b = baseline(model_dir, daemon, prefix + tail_b)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, extra=PINNED))
    try:
        first.run([make_request("a", prefix + [1])])
        expired = expire_first_load(second)
        got = second.run([make_request("a2", prefix + tail_a), make_request("b2", prefix + tail_b)])
        assert expired and second.invalid_reported and got == {"a2": want_a, "b2": want_b}
        third = Engine.start(vllm_config(model_dir, daemon.socket_path))
        try:
            got = third.run([make_request("a3", prefix + tail_a)])
            got |= third.run([make_request("b3", prefix + tail_b)])
            assert got == {"a3": want_a, "b3": want_b}
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_factory_builds_the_connector_and_flags(model_dir: str, daemon: Daemon) -> None:
    """vLLM's factory finds TierdConnector by module path; it declares sleep mode unsupported,
    no layout requirement, and rebuilds its stats from a data dict."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = vllm_config(model_dir, daemon.socket_path)
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert cls.__name__ == "TierdConnector"
    assert cls.supports_sleep_mode(config.kv_transfer_config) is False
    assert cls.get_required_kvcache_layout(config) is None
    stats = cls.build_kv_connector_stats({"loaded_blocks": 3})
    assert stats.reduce()["loaded_blocks"] == 3 and not stats.is_empty()
    assert stats.aggregate(cls.build_kv_connector_stats({"loaded_blocks": 2})).data[
        "loaded_blocks"] == 5


def test_removed_and_unknown_keys_name_the_fix(model_dir: str, daemon: Daemon) -> None:
    """A removed extra-config key (hash_algo) is refused by name at connector construction."""
    with pytest.raises(ValueError, match="hash_algo.*removed"):
        Engine.start(vllm_config(model_dir, daemon.socket_path, extra={"hash_algo": "x"}))


def test_aborted_request_releases_its_pin(model_dir: str, daemon: Daemon) -> None:
    """A request aborted after the scheduler pinned its hit and planned its load, before the
    step ran: the pin holds while the workers may still load under it, and is released once the
    step has run and the workers reported (not at lease expiry)."""
    from vllm.v1.request import RequestStatus

    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, extra=PINNED))
    try:
        first.run([make_request("a", PROMPT)])
        second.scheduler.add_request(make_request("b", PROMPT))
        out = second.schedule_until_loads()
        assert daemon.pinned_blocks() == 6
        second.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        second.settle_scheduler()
        assert daemon.pinned_blocks() == 6
        second.run_connector_step(out)
        second.settle_scheduler()
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


def test_fail_policy_warns_naming_recompute(model_dir: str, daemon: Daemon,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """With vLLM's default kv_load_failure_policy ("fail") the connector warns at start,
    naming the setting that makes vLLM recompute instead; with "recompute" it does not."""
    engine = Engine.start(vllm_config(model_dir, daemon.socket_path, policy="fail"))
    engine.close()
    assert '"kv_load_failure_policy":"recompute"' in caplog.text
    caplog.clear()
    engine = Engine.start(vllm_config(model_dir, daemon.socket_path, policy="recompute"))
    engine.close()
    assert "kv_load_failure_policy" not in caplog.text


@pytest.mark.parametrize("daemon", ["demote-all"], indirect=True)
def test_ssd_hit_streams_while_vllm_schedules_on(model_dir: str, daemon: Daemon) -> None:
    """A prefix held only on SSD is an asynchronous load: vLLM parks the request
    (WAITING_FOR_REMOTE_KVS) and schedules another one in the same step; the worker streams the
    hit in, reports it finished receiving, and the request samples the reference tokens (hit
    source: disk) with nothing left pinned."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import RequestStatus

    from tierd.types import BlockHash

    want = baseline(model_dir, daemon, PROMPT)
    other = [(i * 5 + 1) % 991 for i in range(3 * BLOCK + 2)]
    want_other = baseline(model_dir, daemon, other)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path,  # "not yet" first
                                      extra={"lookup_wait_seconds": 0}))
    answers: list[object] = []
    sources: list[dict[CacheHitSource, int]] = []
    steps: list[tuple[object, set[str]]] = []
    lookup = second.connector.get_num_new_matched_tokens
    hit_sources = second.connector.get_external_cache_hit_sources

    def spy(request: Any, num_computed: int) -> Any:
        answer = lookup(request, num_computed)
        if request.request_id == "b":
            answers.append(answer)
        return answer

    second.connector.get_num_new_matched_tokens = spy  # type: ignore[method-assign]
    second.connector.get_external_cache_hit_sources = (  # type: ignore[method-assign]
        lambda r, n: sources.append(hit_sources(r, n)) or sources[-1])
    second.between = lambda engine, out: steps.append(
        (engine.scheduler.requests["b"].status if "b" in engine.scheduler.requests else None,
         set(out.num_scheduled_tokens)))
    try:
        request = make_request("a", PROMPT)
        first.run([request])
        wait_on_ssd(daemon, first, [BlockHash(h) for h in request.block_hashes[:6]])
        got = second.run([make_request("b", PROMPT), make_request("c", other)])
        assert got == {"b": want, "c": want_other}
        assert answers[-1] == (6 * BLOCK, True)  # after the lookup job's None
        assert set(answers[:-1]) == {(None, False)}
        assert (RequestStatus.WAITING_FOR_REMOTE_KVS, {"c"}) in steps
        assert sources == [{CacheHitSource.DISK: 6 * BLOCK}]
        assert second.recved == {"b"} and not second.invalid_reported
        assert second.worker.worker_counters.data["loaded_blocks"] == 6
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("daemon", ["demote-all"], indirect=True)
def test_tp2_ssd_hit_streams_on_both_ranks(model_dir: str, daemon: Daemon) -> None:
    """TP 2: each rank's worker streams its own half of an SSD-only hit; vLLM's
    KVOutputAggregator reports the request received once both ranks have; the tokens are the
    reference ones and no lease is left."""
    from tierd.types import BlockHash

    want = baseline(model_dir, daemon, PROMPT, tp=2)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path, tp=2))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, tp=2))
    try:
        request = make_request("a", PROMPT)
        first.run([request])
        wait_on_ssd(daemon, first, [BlockHash(h) for h in request.block_hashes[:6]])
        assert second.run([make_request("b", PROMPT)])["b"] == want
        assert second.recved == {"b"} and not second.invalid_reported
        assert [w.worker_counters.data["loaded_blocks"] for w in second.workers] == [6, 6]
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("daemon", ["demote-all"], indirect=True)
def test_streamed_load_failure_is_recomputed(model_dir: str, daemon: Daemon) -> None:
    """A streamed load whose fourth block does not verify: the worker reports the request
    finished receiving and blocks 3-5 as load errors in the same step; vLLM recomputes them and
    samples the reference tokens; nothing computed on the bad block is stored, so a third engine
    loads the whole prompt and samples them too."""
    from tierd.types import BlockHash

    longer = PROMPT[:6 * BLOCK] + [(i * 3 + 2) % 991 for i in range(2 * BLOCK + 3)]
    want = baseline(model_dir, daemon, longer)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path))
    streaming = second.worker._worker._streaming
    real = streaming.sink

    class OneBad:  # the streams' sink, with block 3's checksum wrong
        def place(self, slots, slot_ids, checksums, block_ids):  # type: ignore[no-untyped-def]
            sums = list(checksums)
            return real.place(slots, slot_ids, sums[:3] + [sums[3] ^ 1] + sums[4:], block_ids)

        def settle(self) -> None:
            real.settle()

    streaming.sink = OneBad()
    streaming.streams = None  # built on the first stream, with the patched sink
    try:
        request = make_request("a", PROMPT[:6 * BLOCK + 1])
        first.run([request])
        wait_on_ssd(daemon, first, [BlockHash(h) for h in request.block_hashes[:6]])
        assert second.run([make_request("b", longer)])["b"] == want
        assert second.recved == {"b"} and len(second.invalid_reported) == 3
        counters = second.worker.worker_counters.data
        assert counters["loaded_blocks"] == 3 and counters["failed_blocks"] == 3
        third = Engine.start(vllm_config(model_dir, daemon.socket_path))
        try:
            assert third.run([make_request("c", longer)])["c"] == want
            assert third.worker.worker_counters.data["loaded_blocks"] == 8
        finally:
            third.close()
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("daemon", ["demote-all"], indirect=True)
def test_request_aborted_while_its_hit_streams(model_dir: str, daemon: Daemon) -> None:
    """A request aborted after its streamed load started: vLLM keeps its blocks until the
    worker reports the load ended, then frees them; no lease is left behind."""
    from vllm.v1.request import RequestStatus

    from tierd.types import BlockHash

    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path))
    try:
        request = make_request("a", PROMPT)
        first.run([request])
        wait_on_ssd(daemon, first, [BlockHash(h) for h in request.block_hashes[:6]])
        second.scheduler.add_request(make_request("gone", PROMPT))
        out = second.schedule_until_loads()
        assert [load.stream for load in out.kv_connector_metadata.loads] == [True]
        result = second._forward(out)  # the worker starts streaming
        second.scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
        second.scheduler.update_from_output(out, result)
        for _ in range(500):
            out = second.scheduler.schedule()
            second.scheduler.update_from_output(out, second._forward(out))
            if "gone" not in second.scheduler.requests:
                break
            time.sleep(0.002)
        assert "gone" not in second.scheduler.requests and second.recved == {"gone"}
        assert second.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63
        second.settle_scheduler()
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()


def overwrite_slot(daemon: Daemon, engine: Engine, block_hash: bytes, offset: int) -> None:
    """Flip byte ``offset`` of the DRAM slot holding ``block_hash`` (a writer gone wrong after
    the block was committed), through a probe registration of ``engine``'s layout."""
    from tierd.types import BlockHash
    from tierd.wire.arena import ShmArena

    with daemon.client() as client:
        probe = client.register_engine(engine_layout(engine.config), "corrupter")
        got = client.acquire(probe.engine_id, [BlockHash(block_hash)])
        arena = ShmArena.attach(probe.arena_name, directory=probe.arena_directory)
        view = arena.view(probe.geometry.offset(got.slot_ids[0]) + offset, 1)
        view[0] ^= 0xFF
        view.release()
        arena.close()
        client.release(probe.engine_id, got.lease_id)
        client.unregister_engine(probe.engine_id)


def flip_on_disk(daemon: Daemon, block_hash: bytes) -> None:
    """Flip one byte of the stored payload of ``block_hash``'s record in the daemon's SSD
    segment files (found by the hash in its 512-byte header, at byte 52)."""
    from pathlib import Path

    from tierd.daemon.ssd.record import HEADER_BYTES, RecordHeader

    for path in Path(daemon.workdir, f"ssd-{daemon.starts}").rglob("*"):
        raw = bytearray(path.read_bytes()) if path.is_file() else bytearray()
        at = raw.find(block_hash)
        head = RecordHeader.unpack(raw[at - 52:at - 52 + HEADER_BYTES]) if at >= 52 else None
        if head is not None and head.block_hash == block_hash:
            raw[at - 52 + HEADER_BYTES + head.stored_len // 2] ^= 0xFF
            path.write_bytes(raw)
            return
    raise AssertionError("no SSD record holds the block")


@pytest.mark.parametrize(("daemon", "where"), [("", "dram-slot"), ("demote-all", "ssd-record")],
                         indirect=["daemon"])
def test_corrupted_block_is_a_miss_and_recomputed(model_dir: str, daemon: Daemon,
                                                   where: str) -> None:
    """The last block of a stored 6-block prefix damaged where it lies: its DRAM slot
    overwritten after the commit, in the byte the stand-in forward reads next (the load's
    one-pass check catches it), or one byte of its SSD record flipped (the daemon's read check
    does: the streamed load ends there). vLLM recomputes that block and samples the reference
    tokens; the daemon no longer serves the bad copy, so a third engine loads the whole longer
    prompt (the recompute stored the block again) and samples them too."""
    from tierd.types import BlockHash

    longer = PROMPT[:6 * BLOCK] + [(i * 3 + 2) % 991 for i in range(2 * BLOCK + 3)]
    want = baseline(model_dir, daemon, longer)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path))
    third = Engine.start(vllm_config(model_dir, daemon.socket_path))
    try:
        request = make_request("a", PROMPT[:6 * BLOCK + 1])
        first.run([request])
        if where == "dram-slot":  # layer 0, head 0, last token, byte 0: its state's low byte
            overwrite_slot(daemon, first, request.block_hashes[5], (BLOCK - 1) * 2 * HEAD * 2)
        else:
            wait_on_ssd(daemon, first, [BlockHash(h) for h in request.block_hashes[:6]])
            flip_on_disk(daemon, request.block_hashes[5])
        assert second.run([make_request("b", longer)])["b"] == want
        assert len(second.invalid_reported) == 1
        counters = second.worker.worker_counters.data
        assert counters["loaded_blocks"] == 5 and counters["failed_blocks"] == 1
        assert third.run([make_request("c", longer)])["c"] == want
        assert third.worker.worker_counters.data["loaded_blocks"] == 8
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()
        third.close()


def test_tp2_failed_load_on_one_rank_is_stored_on_no_rank(model_dir: str, daemon: Daemon,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2 (two worker connectors, outputs merged by vLLM's KVOutputAggregator): rank 1 cannot
    load under the scheduler's pin and its own Acquire of a 6-block hit keeps only 3 blocks.
    vLLM recomputes; rank 0 stores nothing computed on rank 1's missing KV (its Commits wait
    for the scheduler's verdict), so a third engine loads all 8 blocks on both ranks and
    samples the reference tokens."""
    longer = PROMPT[:6 * BLOCK] + [(i * 3 + 2) % 991 for i in range(2 * BLOCK + 3)]
    want = baseline(model_dir, daemon, longer, tp=2)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path, tp=2))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path, tp=2))
    third = Engine.start(vllm_config(model_dir, daemon.socket_path, tp=2))
    try:
        first.run([make_request("a", PROMPT[:6 * BLOCK + 1])])
        assert [w.worker_counters.data["saved_blocks"] for w in first.workers] == [6, 6]
        rank1 = second.workers[1]._worker  # it cannot load under the pin (another arena) and
        client, load = rank1.link.client, rank1.load  # its own Acquire finds 3 blocks
        real = client.acquire
        monkeypatch.setattr(client, "acquire",
                            lambda eid, hashes, **kw: real(eid, hashes[:3], **kw))
        monkeypatch.setattr(rank1, "load", lambda meta: load(dataclasses.replace(
            meta, loads=[dataclasses.replace(spec, pinned=[]) for spec in meta.loads])))
        assert second.run([make_request("b", longer)])["b"] == want
        assert second.invalid_reported
        assert third.run([make_request("c", longer)])["c"] == want
        assert [w.worker_counters.data["loaded_blocks"] for w in third.workers] == [8, 8]
        assert third.invalid_reported == set()
        assert daemon.pinned_blocks() == 0
    finally:
        first.close()
        second.close()
        third.close()


def test_savings_count_a_load_once_at_the_workers_measured_speed(model_dir: str,
                                                                 daemon: Daemon) -> None:
    """A 300-token prompt (a 256-token prefill step, timed by the worker) saves 18 blocks; a
    fresh engine loads them: the daemon's savings count their 288 tokens once (the scheduler's
    pin is a hold), at the speed the first engine's worker reported."""
    prompt = [(i * 53 + 7) % 997 for i in range(300)]
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path))
    try:
        first.run([make_request("a", prompt)])
        second.run([make_request("b", prompt)])
        assert second.worker.worker_counters.data["loaded_blocks"] == 18
        with daemon.client() as client:
            rows = client.stats().savings
        assert [(r.tier, r.tokens, r.speed_source) for r in rows] == [("dram", 288, "reported")]
        assert rows[0].tokens_per_second > 0
    finally:
        first.close()
        second.close()
