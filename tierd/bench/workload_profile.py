"""Where an arm of `tierd bench workload` spends its time: the CPU time its processes use over
a run (``cpu_seconds``, every run) and, with ``--profile``, py-spy
samples vLLM's engine-core process (the scheduler) and its worker during one run, and the
samples are summed by the TierdConnector hook they are in, as shares of the scheduler's busy
loop and of the worker's (time the other side waits for it, on the critical path of every
step). Threads blocked in a call are sampled too (``--idle``), so a hook waiting for the daemon
counts its wall time, not only its CPU time. Needs `py-spy` on PATH (``pip install py-spy``);
root or ptrace rights over the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tierd.bench.serve_stack import VllmServe
from tierd.bench.workload_cores import ENGINE_CORE, group_pids, process_title

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


def cpu_seconds(server: VllmServe, daemon_pid: int | None) -> float:
    """CPU time (user + system) used so far by ``server``'s processes and the daemon's."""
    def used(fields: list[str]) -> float:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    total = sum(used(fields) for _, fields in _processes(server).values())
    if daemon_pid is not None:
        with open(f"/proc/{daemon_pid}/stat") as f:
            total += used(f.read().rpartition(")")[2].split())
    return total


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
