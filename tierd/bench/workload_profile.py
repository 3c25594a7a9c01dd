"""Where an arm of `tierd bench workload` spends its time: the CPU time its processes use over
a run, by process (``cpu_split``, every run; ``cpu_lines`` sets two arms apart per request),
and, with ``--profile``, py-spy samples vLLM's engine-core process (the scheduler) and its
worker during one run, and the samples are summed by the TierdConnector hook they are in, as
shares of the scheduler's busy loop and of the worker's (time the other side waits for it, on
the critical path of every step). Threads blocked in a call are sampled too (``--idle``), so a
hook waiting for the daemon counts its wall time, not only its CPU time. Needs `py-spy` on PATH
(``pip install py-spy``); root or ptrace rights over the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

from tierd.bench.serve_stack import VllmServe
from tierd.bench.workload_cores import ENGINE_CORE, group_pids, process_title

if TYPE_CHECKING:
    from tierd.bench.workload_report import Sample

T = TypeVar("T")

LOOPS = {"scheduler": "run_busy_loop", "worker": "worker_busy_loop"}
"""vLLM's process kind -> the frame of its main loop (samples outside it are idle threads)."""
PROCESSES = {ENGINE_CORE: "scheduler", "VLLM::Worker": "worker"}
HOOK = "TierdConnector."


@dataclass(frozen=True)
class Profile:
    """Shares of one process's main-loop samples."""

    kind: str
    """"scheduler" or "worker"."""
    samples: int
    """Samples inside the main loop."""
    hooks: dict[str, float]
    """TierdConnector hook -> its share of those samples (biggest first)."""


def py_spy() -> str:
    """The py-spy executable on PATH or beside this Python (ValueError naming the fix if there
    is none)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if found is None:
        raise ValueError("--profile needs py-spy on PATH: pip install py-spy")
    return found


def _processes(server: VllmServe) -> dict[int, tuple[str, list[str]]]:
    """pid -> (process title, the fields of /proc/pid/stat after the name) of every process in
    ``server``'s session (the API server, vLLM's engine core and its workers)."""
    assert server.process is not None, "the server is not running"
    found = {}
    for pid in group_pids(os.getpgid(server.process.pid)):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # exited while listed
            continue
        title = process_title(pid)
        if title is not None:
            found[pid] = (title, fields)
    return found


def _children(server: VllmServe) -> dict[int, str]:
    """pid -> kind of vLLM's engine-core and worker processes of ``server``."""
    return {pid: PROCESSES[title] for pid, (title, _) in _processes(server).items()
            if title in PROCESSES}


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds (user + system) of an arm's processes, by part."""

    api: float
    """vLLM's API server (every process of the server's session but the two below)."""
    scheduler: float
    """vLLM's engine core: its scheduler, with the connector's scheduler side."""
    worker: float
    """vLLM's worker: the forward pass, with the connector's worker side."""
    daemon: float
    """The arm's `tierd serve` (0 for vLLM alone)."""

    @property
    def total(self) -> float:
        return self.api + self.scheduler + self.worker + self.daemon

    def __sub__(self, earlier: CpuSplit) -> CpuSplit:
        return CpuSplit(*(getattr(self, f.name) - getattr(earlier, f.name)
                          for f in fields(self)))


def cpu_split(server: VllmServe, daemon_pid: int | None) -> CpuSplit:
    """CPU time used so far by ``server``'s processes, by kind, and by the daemon's."""
    def used(stat: list[str]) -> float:
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    parts = dict.fromkeys(("api", *PROCESSES.values()), 0.0)
    for title, stat in _processes(server).values():
        parts[PROCESSES.get(title, "api")] += used(stat)
    daemon = 0.0
    if daemon_pid is not None:
        with open(f"/proc/{daemon_pid}/stat") as f:
            daemon = used(f.read().rpartition(")")[2].split())
    return CpuSplit(parts["api"], parts["scheduler"], parts["worker"], daemon)


def cpu_lines(samples: Sequence[Sample]) -> list[str]:
    """Per case and pair of arms a target compares: how much more (or less) CPU a request of
    the first arm used than one of the second, in each part (ms; median over the repeats of
    each repeat's difference)."""
    from tierd.bench.workload_report import ARM_TITLES, compared_runs

    def per_request(sample: Sample) -> dict[str, float] | None:
        done = sample.timing.completed
        if sample.cpu is None or not done:
            return None
        return {f.name: getattr(sample.cpu, f.name) * 1e3 / done for f in fields(sample.cpu)}

    lines = []
    for case, top_arm, bottom_arm, both in compared_runs(samples, per_request):
        parts = [f"{part} " + format(statistics.median(a[part] - b[part] for a, b in both),
                                     "+.1f")
                 for part in both[0][0]]
        lines.append(f"  {case:<24} {ARM_TITLES[top_arm]} - {ARM_TITLES[bottom_arm]}: "
                     f"{', '.join(parts)} ms per request")
    return lines


def profiled(server: VllmServe, workdir: str, run: Callable[[], T]) -> tuple[T, list[Profile]]:
    """``run()`` with py-spy sampling ``server``'s scheduler and worker for its duration; its
    result and one ``Profile`` per process."""
    spy = py_spy()
    records = []
    for pid, kind in _children(server).items():
        out = os.path.join(workdir, f"profile-{server.engine}-{kind}-{pid}.txt")
        records.append((kind, out, subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--rate", "100", "--nonblocking", "--idle",
             "--format", "raw", "--output", out],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    try:
        result = run()
    finally:
        for _, _, spying in records:
            spying.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for _, _, spying in records:
            spying.wait(timeout=60)
    profiles = []
    for kind, out, _ in records:
        with open(out) as f:
            profiles.append(summarize(kind, f.read()))
    return result, profiles


def summarize(kind: str, collapsed: str) -> Profile:
    """A ``Profile`` from py-spy's raw (collapsed-stack) output: each line a ``;``-joined stack,
    outermost first, then a space and its sample count."""
    loop = LOOPS[kind]
    total = 0
    hooks: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        if not count.isdigit() or not any(loop in f for f in frames):
            continue
        total += int(count)
        hook = next((f for f in frames if f.startswith(HOOK)), None)
        if hook is not None:
            hooks[hook[len(HOOK):]] += int(count)
    return Profile(kind, total, {h: n / total for h, n in hooks.most_common()} if total else {})


def profile_line(arm: str, case: str, profiles: list[Profile]) -> str:
    parts = []
    for p in sorted(profiles, key=lambda p: p.kind):
        hooks = ", ".join(f"{h} {share * 100:.1f}%" for h, share in p.hooks.items()) or "none"
        parts.append(f"{p.kind} loop ({p.samples} samples): {hooks}")
        parts[-1] += f" (connector in all: {sum(p.hooks.values()) * 100:.1f}%)"
    return f"  {case:<16} {arm:<12} " + "; ".join(parts)
