"""Which cores each process of `tierd bench workload` runs on.

vLLM's CPU build runs the forward pass in its worker process, whose OpenMP threads it binds to
``VLLM_CPU_OMP_THREADS_BIND``; the rest (the API server, the engine core's scheduler, the
benchmark's client, tierd's daemon) float over every core the host gives, so they preempt the
OpenMP threads at random and the arms' timings move with whatever else woke up. The bench
splits the host as vLLM's own default does for an engine alone (one core reserved off the
OpenMP threads): the forward pass gets ``omp`` and the servers (vLLM's API server and engine
core, tierd's daemon) ``others``. On a one-core host both are that core. The benchmark's client
stays on every core: it stands for users on other machines, and kept on ``others`` beside the
API server and the engine core's polling loop, it made whole runs of either arm fall to about
half their throughput at random.

``confine_group`` moves every thread of a `vllm serve` (its process group) but its worker's (the
process vLLM bound to ``omp``) to ``others``; ``confine_process`` moves every thread of one
process (the daemon). Threads started later inherit their creator's cores.

On ``others`` the API server shares a core with the engine core, which polls for its worker's
answer in a busy loop while a step runs, and with tierd's daemon. At equal priority that loop
can starve the API server: requests then reach the engine a few at a time, every step runs a
handful of them and sends the API server more messages per token, and the run stays in that
state to its end, at about half the throughput the same arm makes otherwise, in whichever arm
it strikes. ``lower_priority`` gives the engine core (``lower_group``, by its process title)
and the daemon niceness ``BACKEND_NICE``, in every arm alike: the API server takes the core
whenever it has work, and they have it whenever it waits. Threads started later inherit their
creator's niceness.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass

BACKEND_NICE = 10
"""Niceness of vLLM's engine cores and tierd's daemons under the bench (module doc)."""

ENGINE_CORE = "VLLM::EngineCore"
"""The process title of vLLM's engine core (its scheduler)."""


@dataclass(frozen=True)
class Cores:
    """``omp``: the cores vLLM's OpenMP threads bind; ``others``: those of every other
    server process the bench starts."""

    omp: list[int]
    others: list[int]

    @property
    def bind(self) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND`` for ``omp``."""
        return ",".join(str(c) for c in self.omp)


def _parse(flag: str, text: str) -> list[int]:
    """"0,2-3" -> [0, 2, 3] (ValueError naming ``flag`` for anything else)."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first:
            continue
        try:
            out += range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"{flag} takes core ids and ranges such as 0,2-3, not "
                             f"{text!r}") from None
    return out


def plan(cpus: str | None, others: str | None) -> Cores:
    """The split for ``--cpus`` and ``--other-cpus`` (each None: the default, every core this
    process may use but the first for OpenMP, the first for the rest). ValueError naming the
    flag for a core this process may not use."""
    allowed = sorted(os.sched_getaffinity(0))
    omp = _parse("--cpus", cpus) if cpus else (allowed[1:] or allowed)
    rest = (_parse("--other-cpus", others) if others else
            [c for c in allowed if c not in omp] or allowed)
    for flag, cores in (("--cpus", omp), ("--other-cpus", rest)):
        if not cores or set(cores) - set(allowed):
            raise ValueError(f"{flag} names cores {cores}: this host allows {allowed}")
    return Cores(omp, rest)


def confine_process(pid: int, cores: Iterable[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (threads that exit meanwhile are skipped)."""
    wanted = set(cores)
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, wanted)
        except (ProcessLookupError, PermissionError):
            continue


def confine_group(leader: int, cores: Cores) -> int:
    """Every process of ``leader``'s process group whose main thread is not bound to
    ``cores.omp`` (a `vllm serve`: all but its worker) onto ``cores.others``; how many
    processes were moved."""
    moved = 0
    for pid in group_pids(os.getpgid(leader)):
        try:
            bound = os.sched_getaffinity(pid) == set(cores.omp)
        except ProcessLookupError:
            continue
        if not bound:
            confine_process(pid, cores.others)
            moved += 1
    return moved


def lower_priority(pid: int, nice: int = BACKEND_NICE) -> None:
    """Every thread of ``pid`` at niceness ``nice`` (threads that exit meanwhile are skipped)."""
    for tid in _threads(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (ProcessLookupError, PermissionError):
            continue


def lower_group(leader: int, titles: Collection[str] = (ENGINE_CORE,),
                nice: int = BACKEND_NICE) -> int:
    """``lower_priority`` of every process of ``leader``'s process group whose title (the first
    word of its command line) is one of ``titles``; how many there were."""
    lowered = 0
    for pid in group_pids(os.getpgid(leader)):
        if process_title(pid) in titles:
            lower_priority(pid, nice)
            lowered += 1
    return lowered


def process_title(pid: int) -> str | None:
    """The title of process ``pid`` (the first word of its command line, as vLLM sets it:
    ``VLLM::EngineCore``); None if it has exited."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            first = f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return None
    return first.split(" ")[0]


def group_pids(group: int) -> list[int]:
    """The pids of process group ``group`` (processes that exit meanwhile are left out)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getpgid(int(name)) == group:
                found.append(int(name))
        except ProcessLookupError:
            continue
    return found


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []
