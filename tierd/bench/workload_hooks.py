"""`tierd bench workload --hook-times`: how long the TierdConnector's hooks hold each engine step.

vLLM runs a step's scheduler hooks and its worker hooks one after the other on the step's
critical path (the scheduler's in ``schedule()`` and ``update_from_output``, the worker's around
its forward pass), so their time is the connector's direct cost per step, whatever the host's
noise does to a throughput ratio. The tierd arms' servers run with ``TIERD_HOOK_TIMES`` set
(``connector.core.hook_times``: every hook call's wall and CPU time summed per process); each
run's share is the difference of the sums read before and after it (``run_hooks``), and
``hook_lines`` prints, per case and tierd arm, the hooks' time per engine step beside the mean
step (the run's length over its worker steps). The timing adds about 1 us a call to what it
reports (a worker makes about 13 hook calls a step, a scheduler 3-5).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierd.connector.core.hook_times import Times

if TYPE_CHECKING:
    from tierd.bench.workload_report import Sample

WORKER_STEP = "bind_connector_metadata"
"""The worker hook vLLM calls once a step: its count is the worker's steps."""
SCHEDULER_STEP = "build_connector_meta"
"""The scheduler hook vLLM calls once a step."""

TOP = 3
"""Hooks named per side in a line, the longest first."""


@dataclass(frozen=True)
class HookTimes:
    """One run's hooks: per side, its steps and each hook's (wall, CPU) seconds in all."""

    worker_steps: int
    worker: dict[str, tuple[float, float]]
    scheduler_steps: int
    scheduler: dict[str, tuple[float, float]]


def run_hooks(before: dict[int, Times], after: dict[int, Times]) -> HookTimes | None:
    """What the hooks took between two readings (``read_times``): a process with worker steps
    counts as a worker (the workers' sums added up), one with scheduler steps as the scheduler
    (``vllm serve`` runs its workers in processes of their own); None if no step ran."""
    sides: dict[str, tuple[int, dict[str, tuple[float, float]]]] = {}
    for pid, now in after.items():
        then = before.get(pid, {})
        delta = {}
        for name, (calls, wall, cpu) in now.items():
            was = then.get(name, (0, 0.0, 0.0))
            delta[name] = (calls - was[0], wall - was[1], cpu - was[2])
        for side, step in (("worker", WORKER_STEP), ("scheduler", SCHEDULER_STEP)):
            if delta.get(step, (0,))[0] > 0:
                steps, hooks = sides.get(side, (0, {}))
                for name, (_, wall, cpu) in delta.items():
                    had = hooks.get(name, (0.0, 0.0))
                    hooks[name] = (had[0] + wall, had[1] + cpu)
                sides[side] = (max(steps, delta[step][0]), hooks)
    if "worker" not in sides:
        return None
    worker_steps, worker = sides["worker"]
    scheduler_steps, scheduler = sides.get("scheduler", (0, {}))
    return HookTimes(worker_steps, worker, scheduler_steps, scheduler)


def hook_lines(samples: Sequence[Sample]) -> list[str]:
    """Per case and tierd arm, medians over its repeats: the worker's and the scheduler's hook
    time per engine step (wall, and the worker's CPU), their share of the mean step, and the
    longest hooks of each side (us per step)."""
    runs: dict[tuple[str, str], list[tuple[Sample, HookTimes]]] = {}
    for sample in samples:
        if sample.hooks is not None and sample.hooks.worker_steps:
            runs.setdefault((sample.case, sample.arm), []).append((sample, sample.hooks))
    lines = []
    for (case, arm), found in runs.items():
        def per_step(side: dict[str, tuple[float, float]], steps: int, cpu: bool = False
                     ) -> float:
            return sum(v[1 if cpu else 0] for v in side.values()) * 1e6 / steps if steps else 0.0
        worker = statistics.median(per_step(h.worker, h.worker_steps) for _, h in found)
        worker_cpu = statistics.median(per_step(h.worker, h.worker_steps, True) for _, h in found)
        scheduler = statistics.median(per_step(h.scheduler, h.scheduler_steps) for _, h in found)
        step_ms = statistics.median(s.timing.duration_s * 1e3 / h.worker_steps for s, h in found)
        share = (worker + scheduler) / (step_ms * 1e3) if step_ms else float("nan")

        def longest(side: str) -> str:
            names = {name for _, h in found for name in getattr(h, side)}
            each = {name: statistics.median(
                getattr(h, side).get(name, (0.0, 0.0))[0] * 1e6
                / max(1, h.worker_steps if side == "worker" else h.scheduler_steps)
                for _, h in found) for name in names}
            top = sorted(each.items(), key=lambda item: -item[1])[:TOP]
            return ", ".join(f"{name} {us:.0f}" for name, us in top)
        lines.append(f"  {case:<24} {arm:<12} worker {worker:.0f} us (CPU {worker_cpu:.0f}) + "
                     f"scheduler {scheduler:.0f} us a step of {step_ms:.2f} ms: {share:.1%} "
                     f"({len(found)} runs); worker: {longest('worker')}; scheduler: "
                     f"{longest('scheduler')}")
    return lines
