"""The engine's own step times in `tierd bench workload --steps`: vLLM logs every engine step
(``--enable-logging-iteration-details``: the prompt and generated tokens the step computed and
how long its forward pass took, the worker's hooks included, the scheduler's excluded), and this
module reads a run's lines back out of the server's log and sums them per kind of step.

A throughput ratio says that two arms differ, not where: a step that only decodes does the same
work in every arm (no load, no save, tierd's hooks return at once), so a difference there is
the host's speed between the two runs or a fixed cost per step; a difference in the steps that
compute prompt tokens is what loads and saves add (they happen on those steps and the one after).
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierd.bench.workload_report import Sample

FLAG = "--enable-logging-iteration-details"
"""The `vllm serve` flag that logs every engine step (vLLM's ``LoggingStatLogger``)."""

_ITERATION = re.compile(
    r"Iteration\(\d+\): \d+ context requests, (\d+) context tokens, \d+ generation requests, "
    r"(\d+) generation tokens, iteration elapsed time: ([0-9.]+) ms")


@dataclass(frozen=True)
class Steps:
    """One run's engine steps: how many, their forward passes' time in all, and the median time
    of a step that only decodes and of one that computes prompt tokens (NaN: none such)."""

    count: int
    busy_ms: float
    decode_p50_ms: float
    prefill_p50_ms: float


def log_size(path: str) -> int:
    """Where a run's lines will start in the server's log ``path`` (its size now)."""
    return os.path.getsize(path) if os.path.exists(path) else 0


def steps_since(path: str, offset: int) -> Steps:
    """The steps vLLM logged in ``path`` from byte ``offset`` on (those of one run)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return parse(f.read().decode("utf-8", "replace"))


def parse(text: str) -> Steps:
    """The steps of vLLM's iteration lines in ``text`` (other lines ignored)."""
    decode: list[float] = []
    prefill: list[float] = []
    for match in _ITERATION.finditer(text):
        context, generated, elapsed = int(match[1]), int(match[2]), float(match[3])
        if context:
            prefill.append(elapsed)
        elif generated:
            decode.append(elapsed)
    return Steps(len(decode) + len(prefill), sum(decode) + sum(prefill), _median(decode),
                 _median(prefill))


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


FIGURES: dict[str, Callable[[Steps, int], float]] = {
    "step time per request": lambda s, requests: s.busy_ms / requests if requests else math.nan,
    "decode-only step p50": lambda s, requests: s.decode_p50_ms,
    "prompt step p50": lambda s, requests: s.prefill_p50_ms,
    "steps": lambda s, requests: float(s.count)}
"""What ``step_lines`` compares, from a run's steps and its requests."""


def step_lines(samples: Sequence[Sample]) -> list[str]:
    """Per case and pair of arms a target compares: the first arm's figure over the second's,
    for each of ``FIGURES`` (median of the repeats' ratios, then every repeat)."""
    from tierd.bench.workload_report import ARM_TITLES, compared_runs

    lines = []
    for case, top_arm, bottom_arm, both in compared_runs(
            samples, lambda s: None if s.steps is None else (s.steps, s.timing.completed)):
        parts = []
        for name, figure in FIGURES.items():
            values = [(figure(*a), figure(*b)) for a, b in both]
            if any(math.isnan(x) or math.isnan(y) or y <= 0 for x, y in values):
                continue  # a kind some run had no step of
            ratios = [x / y for x, y in values]
            parts.append(f"{name} {statistics.median(ratios):.2f} ["
                         + ", ".join(f"{r:.2f}" for r in ratios) + "]")
        lines.append(f"  {case:<24} {ARM_TITLES[top_arm]} / {ARM_TITLES[bottom_arm]}: "
                     + ("; ".join(parts) or "no steps logged"))
    return lines
