"""The daemon's own small files in the SSD directory (``models.json``): private, written whole and
atomically, and read only when they are what the daemon wrote.

**Modes.** The SSD directory is ``PRIVATE_DIR`` (0700) and every file in it ``PRIVATE_FILE``
(0600): segments hold every tenant's KV. Files are created with that mode; ``tighten`` takes the
group and other bits off an existing directory or file (one of an older version), and the caller
logs what changed.

**Who.** Every operation here is relative to the directory's descriptor, which the caller has only
while it holds the directory's lock (``SsdStore.state_directory``): a daemon locked out of the
directory reads and writes nothing there.

**Writes** (``write_state``): the bytes go to ``<name>.new``, created with
``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600, are fsynced, then renamed over ``<name>`` and the
directory fsynced: a crash leaves the old file or the new one, never a mix. A ``<name>.new`` that
exists (left by a crash, or planted: a symlink, a FIFO) is unlinked first, never opened or
followed, so nothing outside the directory is ever written. ``StateWriter`` runs the writes on a
thread of its own, latest content wins, so the event loop never waits on a disk.

**Reads** (``read_state``): opened with ``O_NOFOLLOW|O_NONBLOCK`` (a symlink is refused; a FIFO
cannot block the open), then checked on the descriptor: a regular file with one link, owned by
the daemon's uid, of at most the caller's byte cap. Anything else is a ``problem`` to log; the
caller starts with an empty table.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

_log = logging.getLogger(__name__)

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
TEMP_SUFFIX = ".new"


@dataclass(frozen=True, slots=True)
class StateRead:
    """What ``read_state`` found: ``data`` (None: no file, or refused), ``problem`` (why it was
    refused, for the warning; None when read or missing) and ``tightened`` (the file's former
    mode when it was readable by others and was made 0600)."""

    data: bytes | None
    problem: str | None = None
    tightened: int | None = None


def tighten(fd: int) -> int | None:
    """Take the group and other permission bits off the file or directory open as ``fd``: its
    former mode if it had any (the caller logs it), else None. OSError if not allowed."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if not mode & 0o077:
        return None
    os.fchmod(fd, mode & ~0o077)
    return mode


def read_state(dir_fd: int, name: str, max_bytes: int) -> StateRead:
    """The contents of ``name`` in the directory open as ``dir_fd`` if it is a regular file with
    one link, owned by the daemon, of at most ``max_bytes`` bytes (see the module docstring).
    Blocks for one small read; never raises for what the file is."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return StateRead(None)
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a socket
        return StateRead(None, f"cannot open it: {exc.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return StateRead(None, "not a regular file")
        if st.st_nlink != 1:
            return StateRead(None, f"{st.st_nlink} hard links: not a file the daemon wrote")
        if st.st_uid != os.geteuid():
            return StateRead(None, f"owned by uid {st.st_uid}, not the daemon's {os.geteuid()}")
        if st.st_size > max_bytes:
            return StateRead(None, f"{st.st_size} bytes, over the cap of {max_bytes}")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            return StateRead(None, f"grew past the cap of {max_bytes} bytes while read")
        return StateRead(b"".join(chunks), tightened=tighten(fd))
    except OSError as exc:
        return StateRead(None, f"cannot read it: {exc.strerror}")
    finally:
        os.close(fd)


def write_state(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the directory open as ``dir_fd`` by ``data``, atomically and durably,
    with mode 0600 (see the module docstring). Blocks; OSError if the disk refuses (the old file
    is then intact)."""
    temp = name + TEMP_SUFFIX
    try:
        os.unlink(temp, dir_fd=dir_fd)  # a symlink is removed, not followed
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, PRIVATE_FILE, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


class StateWriter:
    """Writes one state file (``write_state``) on a thread of its own. ``submit`` never blocks:
    while a write is in flight, later submissions wait and only the latest is written (each is a
    whole file). A write that fails is logged (once until one succeeds) and not retried: the
    next submission writes the whole file again.

    ``dir_fd`` must stay open until ``close`` returns."""

    def __init__(self, dir_fd: int, name: str, where: str) -> None:
        self._dir_fd, self._name, self._where = dir_fd, name, where
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierd-state")
        self._lock = threading.Lock()
        self._next: Callable[[], bytes] | None = None  # guarded by _lock
        self._busy = False  # a drain is queued or running; guarded by _lock
        self._failing = False
        self.writes = 0
        """Writes completed (the file holds the latest)."""

    def submit(self, render: Callable[[], bytes]) -> None:
        """Write the file's new contents, ``render()``, soon; ``render`` runs on the writer's
        thread (give it a snapshot, not live state)."""
        with self._lock:
            self._next = render
            if self._busy:
                return
            self._busy = True
        self._pool.submit(self._drain)

    def close(self) -> None:
        """Write what was submitted last, then stop the thread. Blocks until done; idempotent.
        No ``submit`` after this."""
        self._pool.shutdown(wait=True)

    def _drain(self) -> None:
        while True:
            with self._lock:
                render, self._next = self._next, None
                if render is None:
                    self._busy = False
                    return
            try:
                write_state(self._dir_fd, self._name, render())
            except OSError as exc:
                if not self._failing:
                    _log.warning("cannot write %s (%s): it keeps its former contents", self._where,
                                 exc)
                self._failing = True
                continue
            self._failing = False
            self.writes += 1
