"""`tierd bench workload --steps`: vLLM's log lines of its engine steps read back per run and
compared per kind of step between the arms a target compares (structure, never a timing)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from tierd.bench.workload_report import HitRates, Sample, Timing, as_json
from tierd.bench.workload_steps import Steps, log_size, parse, step_lines, steps_since

PREFILL = ("(APIServer pid=15409) INFO 12-07 05:56:03 [loggers.py:199] Engine 000: Iteration(0): "
           "1 context requests, 1144 context tokens, 0 generation requests, 0 generation tokens, "
           "iteration elapsed time: 105.17 ms, CPU KV cache usage: 0.9%\n")


def _decode(ms: float, requests: int = 4) -> str:
    return ("(APIServer pid=15409) INFO 12-07 05:56:03 [loggers.py:199] Engine 000: "
            f"Iteration(7): 0 context requests, 0 context tokens, {requests} generation "
            f"requests, {requests} generation tokens, iteration elapsed time: {ms:.2f} ms, "
            "CPU KV cache usage: 1.2%\n")


def test_vllms_iteration_lines_are_summed_per_kind_of_step() -> None:
    """A step that computes prompt tokens (with or without decodes beside it) and one that only
    decodes are told apart; an empty step and every other line are ignored."""
    text = ("INFO 12-07 05:56:01 [api_server.py:1] Starting vLLM API server\n" + PREFILL
            + _decode(4.0) + _decode(6.0, 3) + _decode(5.0)
            + PREFILL.replace("0 generation requests, 0 generation tokens",
                              "3 generation requests, 3 generation tokens")
            .replace("105.17", "9.00")
            + _decode(0.0, 0).replace("0.00 ms", "0.50 ms"))
    steps = parse(text)
    assert steps.count == 5
    assert steps.busy_ms == pytest.approx(105.17 + 4.0 + 6.0 + 5.0 + 9.0)
    assert steps.decode_p50_ms == 5.0
    assert steps.prefill_p50_ms == pytest.approx((105.17 + 9.0) / 2)
    none = parse("no steps here\n")
    assert none.count == 0 and math.isnan(none.decode_p50_ms) and math.isnan(none.prefill_p50_ms)


def test_a_run_reads_only_the_lines_logged_since_it_started(tmp_path: Path) -> None:
    log = tmp_path / "vllm-tierd-big.log"
    assert log_size(str(log)) == 0  # the server has not written yet
    log.write_text(PREFILL + _decode(4.0))
    offset = log_size(str(log))
    with log.open("a") as f:
        f.write(_decode(8.0) + _decode(10.0))
    steps = steps_since(str(log), offset)
    assert (steps.count, steps.busy_ms, steps.decode_p50_ms) == (2, 18.0, 9.0)
    assert math.isnan(steps.prefill_p50_ms)


def _sample(case: str, arm: str, repeat: int, steps: Steps | None, completed: int = 10) -> Sample:
    return Sample(case, arm, repeat, Timing(completed, 0, 1.0, 10.0, 160.0, 20.0, 40.0, 60.0),
                  HitRates(None, None, None), steps)


def test_step_lines_give_each_compared_pair_its_ratios_per_kind_of_step() -> None:
    """tierd with the cache that fits spent 1.1, 1.2 and 1.0x vLLM alone's forward-pass time per
    request (the same requests), its decode-only steps as long, its prompt steps 1.5x: one line
    for the pair, medians then every repeat; a pair without steps logged gets none, and a kind
    with no step in some run is left out."""
    samples = []
    for r, more in enumerate([1.1, 1.2, 1.0]):
        samples += [
            _sample("prefix 1024 c4", "vllm-big", r, Steps(100, 500.0, 4.0, 10.0)),
            _sample("prefix 1024 c4", "tierd-big", r, Steps(100, 500.0 * more, 4.0, 15.0)),
            _sample("chat c4", "vllm-big", r, Steps(50, 300.0, 4.0, math.nan)),
            _sample("chat c4", "tierd-big", r, Steps(50, 300.0, 4.0, 12.0)),
            _sample("prefix 256 c4", "vllm-small", r, None),
            _sample("prefix 256 c4", "tierd-small", r, None)]
    lines = step_lines(samples)
    assert len(lines) == 2
    fits = lines[0]
    assert fits.startswith("  prefix 1024 c4")
    assert "vLLM+tierd, KV fits / vLLM alone, KV fits" in fits
    assert "step time per request 1.10 [1.10, 1.20, 1.00]" in fits
    assert "decode-only step p50 1.00 [1.00, 1.00, 1.00]" in fits
    assert "prompt step p50 1.50" in fits and "steps 1.00" in fits
    chat = lines[1]
    assert chat.startswith("  chat c4") and "prompt step" not in chat
    assert "step time per request 1.00" in chat
    # per request: the same time over twice the requests is half the time per request
    halved = [replace(s, timing=replace(s.timing, completed=20)) if s.arm == "tierd-big" else s
              for s in samples if s.case == "prefix 1024 c4"]
    assert "step time per request 0.55 [0.55, 0.60, 0.50]" in step_lines(halved)[0]


def test_a_runs_steps_are_strict_json_with_a_missing_kind_as_null() -> None:
    run = _sample("chat c4", "tierd-big", 0, Steps(3, 12.0, 4.0, math.nan))
    text = json.dumps(as_json(run))
    back = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))
    assert back["steps"] == {"count": 3, "busy_ms": 12.0, "decode_p50_ms": 4.0,
                             "prefill_p50_ms": None}
    assert json.loads(json.dumps(as_json(replace(run, steps=None))))["steps"] is None
