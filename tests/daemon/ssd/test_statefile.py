"""Files of the SSD directory are private (directory 0700, files 0600, older ones tightened at
open); state files are written through O_EXCL temp files and read only if regular, ours and
small (``statefile``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_kit import NS, h, payload

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.statefile import read_state, write_state


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The common 022 umask, under which an explicit mode is what makes a file private."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def test_new_directory_and_segments_are_private(tmp_path: Path) -> None:
    """A store in a fresh directory: the directory is 0700 and its segment 0600."""
    store = SsdStore(tmp_path / "ssd", 1 << 20)
    store.open()
    p = payload(0)
    assert await store.write(NS, h(0), p, block_checksum(p)) is not None
    store.close()
    assert mode(tmp_path / "ssd") == 0o700
    assert [mode(s) for s in (tmp_path / "ssd").glob("seg-*.kvs")] == [0o600]


async def test_open_tightens_an_older_directory_and_segments_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 0755 directory with a 0644 segment (an older version's): open makes them 0700 and 0600,
    warns once naming the directory's former mode, and the block is still found."""
    store = SsdStore(tmp_path / "ssd", 1 << 20)
    store.open()
    p = payload(0)
    assert await store.write(NS, h(0), p, block_checksum(p)) is not None
    store.close()
    segment = next((tmp_path / "ssd").glob("seg-*.kvs"))
    os.chmod(tmp_path / "ssd", 0o755)
    os.chmod(segment, 0o644)
    again = SsdStore(tmp_path / "ssd", 1 << 20)
    with caplog.at_level("INFO", logger="tierd.daemon.ssd"):
        assert [e.block_hash for e in again.open()] == [h(0)]
    again.close()
    assert (mode(tmp_path / "ssd"), mode(segment)) == (0o700, 0o600)
    said = [r.getMessage() for r in caplog.records if "0755 changed to 0700" in r.getMessage()
            or "made 0600" in r.getMessage()]
    assert len(said) == 2, said


def test_locked_out_store_has_no_state_directory(tmp_path: Path) -> None:
    """Only the store holding the directory's lock hands out its descriptor."""
    first, second = SsdStore(tmp_path / "ssd", 1 << 20), SsdStore(tmp_path / "ssd", 1 << 20)
    first.open()
    second.open()
    assert first.state_directory() is not None and second.state_directory() is None
    first.close()
    assert first.state_directory() is None


def test_write_unlinks_a_planted_temp_file_and_replaces_atomically(tmp_path: Path) -> None:
    """A FIFO or a symlink at ``<name>.new`` is removed, never opened; the file is replaced whole,
    mode 0600; a directory there fails the write and leaves the old file intact."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mkfifo(tmp_path / "state.new")
        write_state(fd, "state", b"one")
        os.symlink(victim, tmp_path / "state.new")
        write_state(fd, "state", b"two")
        assert (tmp_path / "state").read_bytes() == b"two" and mode(tmp_path / "state") == 0o600
        assert victim.read_bytes() == b"precious"
        assert not os.path.lexists(tmp_path / "state.new")
        (tmp_path / "state.new").mkdir()
        with pytest.raises(OSError):
            write_state(fd, "state", b"three")
        assert (tmp_path / "state").read_bytes() == b"two"
    finally:
        os.close(fd)


def test_read_refuses_links_specials_and_oversized_files(tmp_path: Path) -> None:
    """Only a regular file with one link of at most the cap is read; a symlink, a hard link, a
    FIFO or a larger file is a named problem; a missing file is no data and no problem."""
    (tmp_path / "ok").write_bytes(b"12345")
    (tmp_path / "outside").write_bytes(b"x")
    os.symlink(tmp_path / "outside", tmp_path / "link")
    os.link(tmp_path / "outside", tmp_path / "hard")
    os.mkfifo(tmp_path / "fifo")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_state(fd, "ok", 5).data == b"12345"
        assert read_state(fd, "missing", 5).data is read_state(fd, "missing", 5).problem is None
        problems = {name: read_state(fd, name, 4).problem for name in ("ok", "link", "hard",
                                                                          "fifo")}
    finally:
        os.close(fd)
    assert problems == {"ok": "5 bytes, over the cap of 4", "link": "cannot open it: Too many "
                        "levels of symbolic links", "hard": "2 hard links: not a file the "
                        "daemon wrote", "fifo": "not a regular file"}
