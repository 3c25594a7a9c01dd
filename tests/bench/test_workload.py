"""`tierd bench workload`'s reading and reporting, without vLLM: `vllm bench serve`'s result
JSON, vLLM's Prometheus counters and OpenMP log lines, the chat client's turn-taking, the
medians and the per-repeat ratios the targets are judged on, py-spy's stacks summed by connector
hook (structure, never a timing)."""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import asdict, replace

import pytest

from tierd.bench.workload_chat import ChatShape, _Users
from tierd.bench.workload_hooks import hook_lines, run_hooks
from tierd.bench.workload_profile import CpuSplit, cpu_lines, profile_line, summarize
from tierd.bench.workload_report import (
    HitRates,
    Sample,
    Timing,
    against_both,
    as_json,
    bound_cores,
    from_bench_serve,
    from_latencies,
    medians,
    percentile,
    phase_lines,
    summary,
    table,
    tierd_hit_rate,
    verdict_lines,
    verdicts,
    vllm_hit_rates,
    vllm_phases,
)

RESULT = {"duration": 10.0, "completed": 95, "failed": 1, "num_prompts": 96,
          "request_throughput": 9.5, "output_throughput": 152.0, "median_ttft_ms": 80.0,
          "p50_ttft_ms": 80.0, "p90_ttft_ms": 200.0, "p99_ttft_ms": 400.0}


def test_bench_serve_result_is_read_field_by_field() -> None:
    """The saved JSON of `vllm bench serve` gives every figure; without the percentile flags
    the error names them."""
    assert from_bench_serve(RESULT) == Timing(95, 1, 10.0, 9.5, 152.0, 80.0, 200.0, 400.0)
    old = {k: v for k, v in RESULT.items() if k != "failed"}
    assert from_bench_serve(old).failed == 1  # an older vLLM: num_prompts - completed
    with pytest.raises(ValueError, match="--metric-percentiles 50,90,99"):
        from_bench_serve({k: v for k, v in RESULT.items() if k != "p99_ttft_ms"})


def test_chat_latencies_become_a_timing() -> None:
    """Four TTFTs over 2 s: 2 req/s, the tokens over the time, percentiles linear between
    ranks as numpy's."""
    t = from_latencies([0.1, 0.2, 0.3, 0.4], output_tokens=64, failed=1, duration_s=2.0)
    assert (t.completed, t.failed, t.request_throughput, t.output_throughput) == (4, 1, 2.0, 32.0)
    assert t.ttft_p50_ms == pytest.approx(250.0)
    assert from_latencies([], 0, failed=3, duration_s=1.0).request_throughput == 0.0
    assert t.ttft_p90_ms == pytest.approx(370.0)
    assert percentile([5.0], 99) == 5.0


def _exposition(local: tuple[int, int], external: tuple[int, int]) -> str:
    """vLLM's /metrics text with (queries, hits) of its prefix cache and of its connector,
    split over two label sets as a server with two engines would."""
    lines = ["# HELP vllm:prefix_cache_queries Prefix cache queries",
             "# TYPE vllm:prefix_cache_queries counter"]
    for engine, share in (("0", 0.25), ("1", 0.75)):
        labels = f'{{engine="{engine}",model_name="tiny"}}'
        lines += [f"vllm:prefix_cache_queries_total{labels} {local[0] * share}",
                  f"vllm:prefix_cache_hits_total{labels} {local[1] * share}",
                  f"vllm:external_prefix_cache_queries_total{labels} {external[0] * share}",
                  f"vllm:external_prefix_cache_hits_total{labels} {external[1] * share}",
                  f"vllm:prefix_cache_queries_created{labels} 1.7e9"]
    return "\n".join(lines) + "\n"


def test_hit_rates_are_counter_deltas() -> None:
    """Over a run that asked 1,000 tokens of vLLM's cache (hit 400) and 600 of the connector
    (hit 300): 0.4 and 0.5, whatever the counters held before; no queries: None."""
    before = _exposition((2_000, 1_000), (800, 100))
    after = _exposition((3_000, 1_400), (1_400, 400))
    assert vllm_hit_rates(before, after) == (pytest.approx(0.4), pytest.approx(0.5))
    assert vllm_hit_rates(after, after) == (None, None)
    assert tierd_hit_rate((100, 10), (700, 310)) == 0.5
    assert tierd_hit_rate((0, 0), (0, 0)) is None


def _phases(queue: float, prefill: float, decode: float, requests: int, steps: int,
            computed: int = 0) -> str:
    """vLLM's /metrics text with its per-request phase histograms (seconds summed over
    ``requests``, split over two label sets), its steps (``iteration_tokens_total``) and the
    prompt tokens it computed (``request_prefill_kv_computed_tokens``)."""
    lines = []
    for engine, share in (("0", 0.5), ("1", 0.5)):
        labels = f'{{engine="{engine}",model_name="tiny"}}'
        for name, seconds in (("request_queue_time", queue), ("request_prefill_time", prefill),
                              ("request_decode_time", decode),
                              ("e2e_request_latency", queue + prefill + decode)):
            lines += [f"vllm:{name}_seconds_sum{labels} {seconds * share}",
                      f"vllm:{name}_seconds_count{labels} {requests * share}",
                      f'vllm:{name}_seconds_bucket{{le="+Inf",engine="{engine}"}} {requests}']
        lines += [f"vllm:iteration_tokens_total_sum{labels} {steps * 7 * share}",
                  f"vllm:iteration_tokens_total_count{labels} {steps * share}",
                  f"vllm:request_prefill_kv_computed_tokens_sum{labels} {computed * share}",
                  f"vllm:request_prefill_kv_computed_tokens_count{labels} {requests * share}"]
    return "\n".join(lines) + "\n"


def test_vllms_phases_are_per_request_means_of_histogram_deltas() -> None:
    """Over a run that finished 10 requests in 40 steps, waiting 0.05 s, prefilling 0.2 s and
    decoding 0.6 s in all and computing 640 prompt tokens: 5, 20 and 60 ms per request, 4
    steps and 64 tokens each, whatever the histograms held before (buckets are not sums);
    nothing finished: NaN."""
    before = _phases(1.0, 2.0, 3.0, 100, 300, 5_000)
    after = _phases(1.05, 2.2, 3.6, 110, 340, 5_640)
    got = asdict(vllm_phases(before, after))
    assert got == pytest.approx({"queue_ms": 5.0, "prefill_ms": 20.0, "decode_ms": 60.0,
                                 "steps_per_request": 4.0, "computed_tokens": 64.0})
    assert all(math.isnan(v) for v in asdict(vllm_phases(after, after)).values())


def test_a_run_is_strict_json_with_its_missing_figures_as_null() -> None:
    """A run where nothing finished has NaN phases: ``--json`` writes them as null, and the
    text parses as strict JSON; the other figures are kept."""
    run = Sample("prefix 1024 c4", "tierd-small", 0, Timing(0, 4, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0),
                 HitRates(None, 0.5, None))
    text = json.dumps(as_json(run))
    back = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))
    assert back["timing"]["queue_ms"] is None and back["timing"]["failed"] == 4
    assert back["hits"]["external"] == 0.5 and back["arm"] == "tierd-small"


def test_the_bound_cores_are_read_from_vllms_log() -> None:
    """The OpenMP report of vLLM's CPU build: the reserve and the cores of rank 0 (the last
    report if the engine restarted); a log without one gives None."""
    head = "(EngineCore pid=1) INFO 12-03 22:51:30 [ompmultiprocessing.py:185] "
    log = "".join(head + line + "\n" for line in (
        "OpenMP thread binding info: ",
        "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False",
        "\tlocal_world_size=1, reserve_cpu_num=1",
        "\tlocal_rank=0, core ids=[0]",
        "\treserved_cpus=[1]"))
    assert bound_cores(log) == (1, [0])
    again = log.replace("reserve_cpu_num=1", "reserve_cpu_num=2").replace("[0]", "[0, 1]")
    assert bound_cores(log + again) == (2, [0, 1])
    assert bound_cores("INFO nothing about OpenMP\n") is None


def _timing(throughput: float, ttft: float, cpu: float = 0.5) -> Timing:
    return Timing(10, 0, 1.0, throughput, throughput * 16, ttft, ttft * 2, ttft * 3, cpu)


def _samples() -> list[Sample]:
    """Three repeats of one judged case on four arms: tierd with a small cache at 0.9, 1.0 and
    1.2x vLLM's throughput with a cache that fits, TTFT 1.1, 1.0, 0.5x."""
    hits = HitRates(0.5, 0.4, 0.41)
    out = []
    for r, (tp, ttft) in enumerate([(0.9, 1.1), (1.0, 1.0), (1.2, 0.5)]):
        out += [Sample("prefix 1024 c4", "vllm-big", r, _timing(10.0, 100.0), hits),
                Sample("prefix 1024 c4", "tierd-small", r, _timing(10.0 * tp, 100.0 * ttft),
                       hits),
                Sample("prefix 1024 c4", "vllm-small", r, _timing(5.0, 300.0), hits),
                Sample("prefix 256 c4", "vllm-small", r, _timing(8.0, 50.0), hits),
                Sample("prefix 256 c4", "tierd-small", r, _timing(8.0, 50.0), hits)]
    return out


def test_targets_are_judged_on_the_median_of_each_repeats_ratio() -> None:
    """Ratios pair the two arms' runs of each repeat; the verdict is their median (1.0 >= 0.95:
    met; TTFT 1.0 <= 1.15: met); CPU per request is shown, not judged; arms that did not run
    (tierd-big) give no verdict; a case not judged, or a target group not judged in a case,
    shows its ratios without a limit."""
    both = {"prefix 1024 c4": {"pressure", "fits"}}
    found = {(v.case, v.target.what): v for v in verdicts(_samples(), both)}
    tp = found[("prefix 1024 c4", "pressure: tierd small KV / vLLM KV fits, throughput")]
    assert tp.ratios == pytest.approx([0.9, 1.0, 1.2]) and tp.median == pytest.approx(1.0)
    assert tp.met is True and tp.straddled  # 0.9 misses 0.95, the other two meet it
    ttft = found[("prefix 1024 c4", "pressure: tierd small KV / vLLM KV fits, TTFT p50")]
    assert ttft.median == pytest.approx(1.0) and ttft.met is True
    cpu = found[("prefix 1024 c4", "pressure: tierd small KV / vLLM KV fits, CPU per request")]
    assert cpu.ratios == [1.0, 1.0, 1.0] and cpu.met is None  # shown, never judged
    gain = found[("prefix 1024 c4", "gain: tierd / vLLM alone, small KV, throughput")]
    assert gain.met is None and gain.median == pytest.approx(2.0)
    assert not any(what.startswith("fits") for _, what in found)
    unjudged = verdicts(_samples(), {"prefix 1024 c4": {"fits"}})
    assert all(v.met is None for v in unjudged)
    short = found[("prefix 256 c4", "gain: tierd / vLLM alone, small KV, TTFT p50")]
    assert short.met is None and short.ratios == [1.0, 1.0, 1.0]
    missed = verdicts([s if s.arm != "tierd-small" else
                       Sample(s.case, s.arm, s.repeat, _timing(9.0, 200.0), s.hits)
                       for s in _samples()], {"prefix 1024 c4": {"pressure"}})
    lines = verdict_lines(missed)
    assert any("throughput: 0.90" in x and "MISSED" in x for x in lines)
    assert any("TTFT p50: 2.00" in x and "(limit <= 1.15) -> MISSED" in x
               and "straddle" not in x for x in lines)
    assert sum("straddle" in x for x in verdict_lines(list(found.values()))) == 1


def test_medians_and_the_table() -> None:
    """The table has one line per (case, arm) with its median and every repeat's hit rates."""
    med = medians(_samples())
    assert med[("prefix 1024 c4", "tierd-small")].request_throughput == pytest.approx(10.0)
    lines = table(_samples())
    assert len(lines) == 1 + 5
    row = next(x for x in lines if "vLLM+tierd, small KV" in x and x.startswith("prefix 1024"))
    assert row.count(" 50%/ 40%/ 41%") == 3


def test_phase_lines_give_each_compared_pair_its_median_difference() -> None:
    """tierd with a small cache queued 1, 3 and 2 ms longer per request than vLLM with a cache
    that fits (median +2.0), decoded 10 ms longer in each repeat, in 5 steps to 4, computing
    40 prompt tokens to 30: one line per pair of arms a target compares that ran in the case
    (the gain's pair too), none for pairs that did not run."""
    slower = {0: 1.0, 1: 3.0, 2: 2.0}
    samples = [replace(s, timing=replace(
        s.timing, queue_ms=slower[s.repeat] if s.arm == "tierd-small" else 0.0,
        prefill_ms=10.0, decode_ms=70.0 if s.arm == "tierd-small" else 60.0,
        steps_per_request=5.0 if s.arm == "tierd-small" else 4.0,
        computed_tokens=40.0 if s.arm == "tierd-small" else 30.0)) for s in _samples()]
    lines = phase_lines(samples)
    pressure = [x for x in lines if "vLLM+tierd, small KV - vLLM alone, KV fits" in x]
    assert len(pressure) == 1 and pressure[0].startswith("  prefix 1024 c4")
    assert "queue +2.0, prefill +0.0, decode +10.0 ms per request" in pressure[0]
    assert pressure[0].endswith("steps per request 5.0 vs 4.0; "
                                "prompt tokens computed per request 40 vs 30")
    assert sum("vLLM alone, small KV" in x for x in lines) == 2  # the gain, both cases
    assert not any("KV fits - " in x for x in lines)  # tierd-big did not run
    assert len(lines) == 3


def test_cpu_lines_set_each_part_of_two_arms_apart_per_request() -> None:
    """tierd with a small cache used 1 and 3 ms more of the worker's CPU per request than
    vLLM with a cache that fits (10 requests a run; median +2.0) and 0.5 s of its daemon's a
    run (+50.0); the third repeat's tierd run (5 ms more) has no CPU read, so that repeat is
    left out; a split subtracts part by part and its total is their sum."""
    later, earlier = CpuSplit(1.0, 2.0, 3.5, 4.0), CpuSplit(0.5, 1.0, 1.5, 0.0)
    assert later - earlier == CpuSplit(0.5, 1.0, 2.0, 4.0) and later.total == 10.5
    more = {0: 0.01, 1: 0.03, 2: 0.05}
    samples = [replace(s, cpu=CpuSplit(0.1, 0.2, 0.3 + more[s.repeat], 0.5)
                       if s.arm == "tierd-small" else CpuSplit(0.1, 0.2, 0.3, 0.0))
               for s in _samples() if s.case == "prefix 1024 c4"]
    samples = [replace(s, cpu=None) if (s.arm, s.repeat) == ("tierd-small", 2) else s
               for s in samples]
    lines = cpu_lines(samples)
    pressure = [x for x in lines if "vLLM+tierd, small KV - vLLM alone, KV fits" in x]
    assert pressure == ["  prefix 1024 c4           vLLM+tierd, small KV - vLLM alone, KV fits: "
                        "api +0.0, scheduler +0.0, worker +2.0, daemon +50.0 ms per request"]
    assert len(lines) == 2  # the gain's pair too


def test_chat_users_take_turns_one_at_a_time_until_every_turn_ran() -> None:
    """Three workers over five users of three turns: no user ever has two turns running, each
    history grows by every turn's message and reply, every conversation runs all its turns;
    a failed turn ends only its own user's conversation."""
    shape = ChatShape(users=5, turns=3, system_tokens=8, user_tokens=4, reply_tokens=2)
    assert shape.longest_prompt() == 8 + 3 * 4 + 2 * 2
    users = _Users(shape, seed=7)
    running: set[int] = set()
    turns: list[int] = []
    guard = threading.Lock()

    def worker() -> None:
        while (user := users.take()) is not None:
            with guard:
                assert user not in running
                running.add(user)
                turns.append(user)
            with users.lock:
                text = users.history[user] + " " + users.message(user)
            with guard:
                running.discard(user)
            users.give_back(user, None if (user, turns.count(user)) == (4, 2) else
                            f"{text} w1 w2")

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(turns) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    assert users.turn == [3, 3, 3, 3, 1]
    assert len(users.history[0].split()) == 8 + 3 * (4 + 2)
    assert all(h.split()[:8] == users.history[0].split()[:8] for h in users.history)


def test_profile_shares_are_of_the_main_loop_by_connector_hook() -> None:
    """py-spy's collapsed stacks: samples outside the scheduler's busy loop (idle threads) are
    left out; inside it, each TierdConnector hook's share (nested vLLM frames above it count);
    the worker's loop is told apart by its own frame."""
    loop = "run_busy_loop (vllm/v1/engine/core.py:900)"
    collapsed = "\n".join([
        f"<module> (x.py:1);{loop};step (core.py:1);schedule (s.py:2) 60",
        f"<module> (x.py:1);{loop};schedule (s.py:2);TierdConnector.get_num_new_matched_tokens "
        "(tierd/connector/vllm/connector.py:250);_blocking (grpc.py:3) 30",
        f"<module> (x.py:1);{loop};TierdConnector.build_connector_meta (c.py:9) 10",
        "_bootstrap (threading.py:1);wait (threading.py:2) 500",
        "malformed line without a count",
    ])
    profile = summarize("scheduler", collapsed)
    assert profile.samples == 100
    assert profile.hooks == {"get_num_new_matched_tokens": 0.3, "build_connector_meta": 0.1}
    assert summarize("worker", collapsed).samples == 0
    line = profile_line("tierd-big", "prefix 1024 c16", [profile])
    assert "get_num_new_matched_tokens 30.0%" in line and "connector in all: 40.0%" in line


def test_the_control_is_judged_on_the_fits_limits_and_counted_apart() -> None:
    """The control (a second vLLM alone against the first) is judged where fits is, on the
    fits limits; the closing line counts it apart from tierd's targets, so a control that
    misses (the host's noise) leaves the verdict to tierd's own targets."""
    samples = []
    for r, (control, tierd) in enumerate([(0.9, 1.0), (0.95, 0.99), (1.02, 1.01)]):
        samples += [Sample("chat c4", "vllm-big", r, _timing(10.0, 100.0), HitRates(0, 0, 0)),
                    Sample("chat c4", "vllm-control", r, _timing(10.0 * control, 100.0),
                           HitRates(0, 0, 0)),
                    Sample("chat c4", "tierd-big", r, _timing(10.0 * tierd, 100.0),
                           HitRates(0, 0, 0))]
    second = [Sample("prefix 1024 c4", s.arm, s.repeat,
                     _timing(11.0 if s.arm == "vllm-control" else 10.0, 100.0), s.hits)
              for s in samples]  # another case, the control 1.10 in every repeat
    both = verdicts(samples + second, {"chat c4": {"fits"}, "prefix 1024 c4": {"fits"}})
    found = {v.target.what: v for v in both if v.case == "chat c4"}
    control = found["control: 2nd vLLM alone / vLLM alone, KV fits, throughput"]
    assert control.target.limit == 0.97 and control.median == pytest.approx(0.95)
    assert control.met is False and control.straddled
    assert found["fits: tierd / vLLM alone, throughput"].met is True
    ok, line = summary(both, failures=0)
    assert ok and "targets judged: 4, missed: 0" in line
    assert ("the control (two identical vLLM alone, held to the fits limits) missed 1 of 4 "
            "(its repeats: throughput 0.90-1.10, TTFT p50 1.00-1.00)") in line
    assert line.endswith("-> met")
    unjudged = verdicts(samples, {"chat c4": {"pressure"}})
    assert all(v.met is None for v in unjudged)
    assert summary(unjudged, failures=1)[0] is False


def test_each_tierd_arm_is_set_against_both_vllm_alone_per_repeat_with_its_interval() -> None:
    """A tierd arm's figure over the geometric mean of vLLM alone and the control, averaged (in
    logs) over a repeat's cases where its target is judged, then over the repeats; the interval
    spans the repeats' spread and shrinks to the estimate where every repeat agrees; no line
    without the control."""
    def runs(case: str, repeat: int, big: float, control: float, tierd: float,
             arm: str = "tierd-big") -> list[Sample]:
        return [Sample(case, which, repeat, _timing(value, 100.0 / value), HitRates(0, 0, 0))
                for which, value in (("vllm-big", big), ("vllm-control", control),
                                     (arm, tierd))]

    judged = {"chat c4": {"fits", "pressure"}, "prefix 1024 c4": {"fits", "pressure"},
              "prefix 1024 c16": {"fits"}}
    # every repeat: tierd 0.96 of sqrt(8 * 12.5) = 10 in one case, 0.98 of 10 in the other
    steady = [s for r in range(5) for s in runs("chat c4", r, 8.0, 12.5, 9.6)
              + runs("prefix 1024 c4", r, 10.0, 10.0, 9.8)]
    throughput, ttft = against_both(steady, judged)
    middle = math.sqrt(0.96 * 0.98)
    assert throughput == (f"  fits: tierd / both, throughput: {middle:.3f}x, 95% interval "
                          f"{middle:.3f}-{middle:.3f} over 5 repeats (10 runs)")
    assert ttft.startswith(f"  fits: tierd / both, TTFT p50: {1 / middle:.3f}x")
    # the small-cache arm where pressure is judged (not at 16 clients); repeats at 0.90-1.10:
    # the interval holds the estimate and lies inside them
    ratios = (0.9, 1.0, 1.1, 0.95, 1.05)
    spread = [s for r, t in enumerate(ratios) for s in runs("chat c4", r, 10, 10, 10 * t,
                                                               "tierd-small")
              + runs("prefix 1024 c16", r, 10, 10, 5, "tierd-small")]
    line = against_both(spread, judged)[0]
    estimate = math.prod(ratios) ** (1 / 5)
    low, high = (float(x) for x in line.split("interval ")[1].split(" ")[0].split("-"))
    assert line.startswith(f"  pressure: tierd small KV / both, throughput: {estimate:.3f}x")
    assert 0.9 <= low < estimate < high <= 1.1 and line.endswith("over 5 repeats (5 runs)")
    # a run with no finished request (NaN) and cases without the control count for nothing;
    # below 5 repeats, their range instead of an interval
    broken = [replace(s, timing=_timing(math.nan, 1.0)) if s.repeat == 2 and s.arm ==
              "tierd-small" else s for s in spread]
    assert against_both(broken, judged)[0] == (
        f"  pressure: tierd small KV / both, throughput: {(0.9 * 0.95 * 1.05) ** 0.25:.3f}x, "
        "the repeats 0.900-1.050 (an interval needs 5 repeats) over 4 repeats (4 runs)")
    assert against_both([s for s in steady if s.arm != "vllm-control"], judged) == []


def test_connector_config_reaches_the_tierd_arms_and_bad_keys_name_the_fix() -> None:
    """``--connector-config`` takes TierdConnector's extra-config keys as a JSON object, over the
    bench's own (write-back), merged into each tierd arm's --kv-transfer-config under the
    bench's own socket and engine name;
    anything else is refused with what to give instead. ``--daemon-nice`` takes a niceness the
    kernel keeps as given."""
    import argparse

    from tierd.bench.serve_stack import VllmServe
    from tierd.bench.workload import _connector_config, arm_config, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    given = parser.parse_args(["--connector-config", '{"save": false, "load": false}'])
    assert given.connector_config == {"save": False, "load": False}
    assert parser.parse_args([]).connector_config == {}
    assert arm_config({}) == {"save_policy": "write_back"}  # one engine per daemon
    assert arm_config({"save_policy": "write_through"}) == {"save_policy": "write_through"}
    assert (parser.parse_args([]).daemon_nice, parser.parse_args(["--daemon-nice", "0"])
            .daemon_nice) == (10, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--daemon-nice", "20"])  # setpriority would clamp it silently
    server = VllmServe("python", "/tmp", "/models/tiny", "tiny", "tierd-big", "/tmp/a.sock",
                       connector_config=given.connector_config, port=8123)
    extra = server.transfer_config()["kv_connector_extra_config"]
    assert extra == {"retry_seconds": 1.0, "save": False, "load": False,
                     "socket_path": "/tmp/a.sock", "engine_name": "tierd-big"}
    for bad, says in (("[1]", "JSON object"), ("{", "not JSON"), ('{"sav": false}', "'sav'"),
                      ('{"save": 1}', "save must be true or false"),
                      ('{"socket_path": "/x"}', "sets ['socket_path'] itself")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--connector-config", bad])
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            _connector_config(bad)


def test_hook_lines_set_the_hooks_time_per_step_beside_the_step() -> None:
    """Two runs of a worker (pid 2) and its scheduler (pid 1): each run's share is the sums'
    growth (a process that did not move, like an old server's, adds nothing); per step the
    worker's hooks took 100 and 300 us (median 200), the scheduler's 50; a run of 1 s over 100
    steps is a 10 ms step, so 2.5%; the longest hooks are named per side."""
    def times(steps: int, load: float) -> dict[int, dict[str, tuple[int, float, float]]]:
        return {1: {"build_connector_meta": (steps, steps * 40e-6, steps * 30e-6),
                    "update_connector_output": (steps, steps * 10e-6, steps * 5e-6)},
                2: {"bind_connector_metadata": (steps, steps * 20e-6, steps * 20e-6),
                    "start_load_kv": (steps, load, load / 2)},
                3: {"bind_connector_metadata": (7, 1.0, 1.0)}}
    first = run_hooks(times(0, 0.0), times(100, 0.008))
    second = run_hooks(times(100, 0.008), times(200, 0.036))
    assert first is not None and second is not None
    assert first.worker_steps == 100 and first.scheduler_steps == 100
    assert first.worker["start_load_kv"] == pytest.approx((0.008, 0.004))
    assert run_hooks(times(0, 0.0), times(0, 0.0)) is None
    samples = [replace(s, hooks=hooks) for s, hooks in zip(
        [s for s in _samples() if (s.case, s.arm) == ("prefix 1024 c4", "tierd-small")][:2],
        [first, second], strict=True)]
    (line,) = hook_lines(samples)
    assert line.startswith("  prefix 1024 c4           tierd-small  worker 200 us (CPU 110) + "
                           "scheduler 50 us a step of 10.00 ms: 2.5% (2 runs)")
    assert line.endswith("worker: start_load_kv 180, bind_connector_metadata 20; scheduler: "
                         "build_connector_meta 40, update_connector_output 10")
    assert json.loads(json.dumps(as_json(samples[0])))["hooks"]["worker_steps"] == 100


def test_in_process_workloads_are_the_serve_benchs_as_token_ids() -> None:
    """``--in-process``'s workloads (``workload_engine_child``): the prefix case sends every
    prefix ``prompts / prefixes`` times, each with a suffix of its own, the same for the same
    seed; the chat gives each user every turn, one running at a time, its history growing by
    each message and reply, every history starting with the shared system prompt."""
    from tierd.bench.workload_engine_child import Case, _chat, _prefix

    case = Case("prefix", seed=3, clients=2, output_len=6, output_min=2, stop_every=4,
                prefix_len=10, suffix_len=3, prefixes=2, prompts=6)
    take, _ = _prefix(case)
    sent = [r for r in iter(take, None)]
    assert len(sent) == 6 and all(len(tokens) == 13 for _, tokens, _ in sent)
    assert len({tuple(tokens[:10]) for _, tokens, _ in sent}) == 2
    assert len({tuple(tokens[10:]) for _, tokens, _ in sent}) == 6
    assert all(2 <= n <= 6 for _, _, n in sent)
    assert [t for _, t, _ in iter(_prefix(case)[0], None)] == [t for _, t, _ in sent]
    fixed = replace(case, stop_every=0)
    assert {n for _, _, n in iter(_prefix(fixed)[0], None)} == {6}

    chat = Case("chat", seed=5, clients=2, output_len=2, output_min=2, stop_every=0, users=3,
                turns=2, system_tokens=8, user_tokens=4)
    take, done = _chat(chat)
    running = [take(), take()]
    system = running[0][1][:8] if running[0] else []
    turns: dict[int, int] = {}
    while running:
        request = running.pop(0)
        assert request is not None
        user, tokens, _ = request
        assert user not in [r[0] for r in running if r is not None]
        assert tokens[:8] == system
        assert len(tokens) == 8 + turns.get(user, 0) * (4 + 2) + 4
        if turns.get(user):
            assert tokens[12:14] == [user, user]  # the reply of its first turn
        turns[user] = turns.get(user, 0) + 1
        done(user, [user, user])
        while len(running) < 2 and (more := take()) is not None:
            running.append(more)
    assert turns == {0: 2, 1: 2, 2: 2}


def test_an_in_process_run_becomes_a_timing() -> None:
    """An engine process's run (``workload_engine.timing``): throughputs over its wall time,
    TTFT percentiles in ms, CPU with its daemon's, steps and prompt tokens computed per
    request."""
    from tierd.bench.workload_engine import timing

    run = {"wall_s": 2.0, "cpu_s": 1.5, "completed": 4, "output_tokens": 40,
           "ttfts_s": [0.01, 0.02, 0.03, 0.04], "decode_s": 0.2, "steps": 20,
           "prompt_tokens": 400, "cached_tokens": 300}
    t = timing(run, daemon_cpu=0.5)
    assert (t.request_throughput, t.output_throughput, t.cpu_seconds) == (2.0, 20.0, 2.0)
    assert t.ttft_p50_ms == pytest.approx(25.0) and t.decode_ms == pytest.approx(200.0)
    assert (t.steps_per_request, t.computed_tokens, t.cpu_ms_per_request) == (5.0, 25.0, 500.0)
    assert math.isnan(t.queue_ms)
