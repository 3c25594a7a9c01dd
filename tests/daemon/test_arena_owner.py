"""Stale arenas are judged by the lock their daemon holds, not by a PID: a killed daemon's files
go at the next start, a live daemon's (in any PID namespace) and other programs' files stay."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tierd.bench.tierd_serve import TierdServe
from tierd.daemon.arena_owner import new_arena_name, remove_stale_arenas


def _shm_dir(workdir: str) -> str:
    path = os.path.join(workdir, "shm")
    os.makedirs(path, exist_ok=True)
    return path


def _names(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_live_daemon_arena_is_kept(make_daemon: Any, workdir: str) -> None:
    """A second start in the same directory keeps the arena and filter of a daemon still up."""
    shm = _shm_dir(workdir)
    running = make_daemon(arena_directory=shm)
    held = _names(shm)
    assert held == [running.daemon.arena.name, running.daemon.arena.name + "-presence"]
    assert remove_stale_arenas(shm) == []
    assert _names(shm) == held


def test_killed_daemon_arena_is_removed_at_next_start(make_daemon: Any, workdir: str,
                                                      processes: list[Any]) -> None:
    """`tierd serve` killed with -9 leaves its arena and filter; the next daemon's start removes
    both, and only those."""
    shm = _shm_dir(workdir)
    serve = TierdServe(workdir, ["--dram-bytes", "4MiB", "--slab-bytes", "64KiB", "--no-prefault",
                                 "--ssd-dir", "", "--arena-directory", shm])
    processes.append(serve.start())
    left = _names(shm)
    assert len(left) == 2 and left[0].startswith("tierd-arena-"), left
    serve.stop(kill=True)
    assert _names(shm) == left
    Path(shm, "tierd-1-ab12").write_bytes(b"an arena of an older tierd: never judged")
    Path(shm, "notes").write_bytes(b"not ours")
    running = make_daemon(arena_directory=shm, socket_path=os.path.join(workdir, "b.sock"))
    assert _names(shm) == sorted([running.daemon.arena.name,
                                  running.daemon.arena.name + "-presence", "tierd-1-ab12",
                                  "notes"])


def test_file_locked_by_another_process_is_kept(tmp_path: Path) -> None:
    """An arena held by a process this one cannot see (a daemon in another PID namespace, with
    the PID of any other) is kept while the lock is held and removed once it is let go."""
    name = new_arena_name()
    path = tmp_path / name
    path.write_bytes(b"x")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys
            fd = os.open({str(path)!r}, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("held", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert remove_stale_arenas(str(tmp_path)) == []
        assert path.exists()
    finally:
        holder.communicate("", timeout=30)
    assert remove_stale_arenas(str(tmp_path)) == [name]
    assert not path.exists()
