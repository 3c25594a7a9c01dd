"""The arena's room check: a directory too small for the arena is a clear error, never SIGBUS,
and nothing is left behind."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierd.daemon.arena import OwnedArena, check_room, free_bytes

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def test_check_room_names_sizes_and_fixes() -> None:
    """Short by a byte: the error names both sizes, --shm-size and TIERD_DRAM_BYTES; room is
    enough when need equals free."""
    check_room("/dev/shm", 64 * MiB, 64 * MiB)
    with pytest.raises(ValueError) as err:
        check_room("/dev/shm", 1024 * MiB, 64 * MiB)
    assert str(err.value) == (
        "the DRAM arena needs 1024 MiB in /dev/shm but only 64 MiB is free: give it more shared "
        "memory (docker run --shm-size=1088m, compose shm_size) or make the arena smaller "
        "(TIERD_DRAM_BYTES / --dram-bytes)")


def test_create_larger_than_free_shm_makes_nothing() -> None:
    """An arena one GiB larger than /dev/shm's free bytes is refused before any file exists."""
    name = f"tierd-test-{os.getpid()}-{secrets.token_hex(4)}"
    size = free_bytes("/dev/shm") + 1024 * MiB
    try:
        with pytest.raises(ValueError, match=r"--shm-size=.*TIERD_DRAM_BYTES / --dram-bytes"):
            OwnedArena.create(name, size, prefault=False)
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        Path("/dev/shm", name).unlink(missing_ok=True)


def _in_small_tmpfs(script: str, mib: int = 8) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (bash) with a fresh ``mib``-MiB tmpfs at $SMALL, in a user and mount
    namespace of its own (what a container with a small --shm-size gives the daemon)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces unavailable: {probe.stderr.decode().strip()}")
    wrapped = (f"SMALL=$(mktemp -d) && mount -t tmpfs -o size={mib}m tmpfs $SMALL && "
               f"export SMALL && {script}")
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c",
                           wrapped], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_serve_in_too_small_shm_exits_with_the_fix() -> None:
    """`tierd serve` with the default pre-fault and a 32 MiB arena in an 8 MiB tmpfs exits 2 at
    once with the one-line error (not SIGBUS), and leaves the tmpfs empty."""
    result = _in_small_tmpfs(
        f"{sys.executable} -P -m tierd.commands.serve --arena-directory $SMALL "
        "--dram-bytes 32MiB --slab-bytes 1MiB --ssd-dir '' --socket-path $SMALL/t.sock; "
        "echo rc=$?; ls -A $SMALL")
    assert result.stdout.split() == ["rc=2"], (result.stdout, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tierd serve: error: the DRAM arena needs 33 MiB in /tmp/"), last
    assert last.endswith("but only 8 MiB is free: give it more shared memory (docker run "
                         "--shm-size=36m, compose shm_size) or make the arena smaller "
                         "(TIERD_DRAM_BYTES / --dram-bytes)"), last


def test_allocation_running_short_is_an_error_not_sigbus() -> None:
    """The room check passed but the tmpfs is short when pages are allocated (another process
    filled it): create raises the same clear ValueError and removes its file."""
    script = textwrap.dedent("""
        import os, sys
        import tierd.daemon.arena as arena
        arena.free_bytes = lambda directory: 1 << 40   # the check passes; the tmpfs is 8 MiB
        try:
            arena.OwnedArena.create("tierd-1-ab", 16 << 20, directory=os.environ["SMALL"])
        except ValueError as exc:
            print("ValueError:", exc)
        print("left:", os.listdir(os.environ["SMALL"]))
    """)
    result = _in_small_tmpfs(f"{sys.executable} -P -c '{script}'")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ValueError: the DRAM arena needs 16 MiB in /tmp/"), lines
    assert "but it ran out of room while allocating the arena: give it more shared memory" \
        in lines[0]
    assert lines[1] == "left: []"
