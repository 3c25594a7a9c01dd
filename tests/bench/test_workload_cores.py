"""How `tierd bench workload` splits the host's cores: the flags read, real processes and their
threads moved (``tierd.bench.workload_cores``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tierd.bench.workload_cores import (
    Cores,
    confine_group,
    confine_process,
    lower_group,
    lower_priority,
    plan,
)

# A child that starts a second thread, says so, then sleeps; BOUND binds itself first, as vLLM
# binds its worker to the OpenMP cores.
CHILD = """
import os, sys, threading, time
if len(sys.argv) > 1:
    os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
os.write(1, b"up\\n")  # one write: two children's lines never interleave
time.sleep(60)
"""


def _threads_cores(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def _threads_nice(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.fixture
def children() -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        child = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE,
                                 **kwargs)
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
        child.wait()


def test_the_default_split_leaves_the_first_core_to_everything_else(monkeypatch: Any) -> None:
    """On four cores OpenMP gets 1-3 and the rest 0; flags name either side ("a-b,c"); on one
    core both share it; a core this process may not use, or a word, names its flag."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert plan(None, None) == Cores([1, 2, 3], [0])
    assert plan("2-3", None) == Cores([2, 3], [0, 1])
    assert plan("0-1,3", "2") == Cores([0, 1, 3], [2])
    assert plan("0-3", None) == Cores([0, 1, 2, 3], [0, 1, 2, 3])
    assert plan(None, None).bind == "1,2,3"
    with pytest.raises(ValueError, match="--other-cpus"):
        plan(None, "7")
    with pytest.raises(ValueError, match="--cpus"):
        plan("1-4", None)
    with pytest.raises(ValueError, match="--other-cpus takes core ids"):
        plan(None, "one")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert plan(None, None) == Cores([5], [5])


def test_every_thread_of_a_process_is_moved(children: Any) -> None:
    """A child with two threads: both end on the core given."""
    first = min(os.sched_getaffinity(0))
    child = children()
    confine_process(child.pid, [first])
    assert _threads_cores(child.pid) == [{first}, {first}]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_group_moves_but_the_process_bound_to_the_openmp_cores() -> None:
    """A process group as `vllm serve` makes one: a shell, a child and a child that bound
    itself to the OpenMP cores (vLLM's worker). The shell's and the first child's threads move
    to the other cores; the bound child stays where it is."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = Cores(allowed[1:], allowed[:1])
    omp = ",".join(str(c) for c in cores.omp)
    leader = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" -c "$0" & "{sys.executable}" -c "$0" {omp} & wait',
         CHILD], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert leader.stdout is not None
        assert [leader.stdout.readline() for _ in range(2)] == [b"up\n"] * 2
        group = [int(p) for p in os.listdir("/proc")
                 if p.isdigit() and _pgid(int(p)) == leader.pid]
        bound = [p for p in group if os.sched_getaffinity(p) == set(cores.omp)]
        assert len(group) == 3 and len(bound) == 1
        assert confine_group(leader.pid, cores) == 2
        for pid in group:
            assert _threads_cores(pid) == [set(cores.omp if pid in bound else cores.others)] * \
                len(os.listdir(f"/proc/{pid}/task"))
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_every_thread_of_a_process_is_lowered(children: Any) -> None:
    """A child with two threads: both end at the niceness given, above this process's."""
    nice = os.getpriority(os.PRIO_PROCESS, 0) + 3
    child = children()
    lower_priority(child.pid, nice)
    assert _threads_nice(child.pid) == [nice, nice]


def test_a_group_lowers_the_processes_of_the_titles_named() -> None:
    """A process group with two ``sleep`` processes (titles as vLLM's engine core has its own)
    and a Python child: only the two sleeps are lowered."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    leader = subprocess.Popen(
        ["sh", "-c", f'sleep 60 & sleep 60 & "{sys.executable}" -c "$0" & wait', CHILD],
        stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert leader.stdout is not None and leader.stdout.readline() == b"up\n"
        group = [int(p) for p in os.listdir("/proc")
                 if p.isdigit() and _pgid(int(p)) == leader.pid]
        assert lower_group(leader.pid, ("sleep",), mine + 4) == 2
        for pid in group:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                sleeps = f.read().startswith(b"sleep")
            assert _threads_nice(pid) == [mine + 4 if sleeps else mine] * \
                len(os.listdir(f"/proc/{pid}/task"))
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()
