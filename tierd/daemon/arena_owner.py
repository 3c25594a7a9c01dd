"""Who owns a file in the arena directory, in a way that survives PID namespaces.

Every file ``ShmArena.create`` makes (the daemon's arena, its presence filter) is created with an
exclusive ``flock`` its maker holds for as long as the arena is open. The kernel drops the lock
when that process dies, however it dies (``kill -9`` included) and whatever PID namespace it
ran in: daemons in containers all run as PID 1, so a PID in the name says nothing, while a lock
on the shared tmpfs's inode is seen the same by every container and the host.

At start-up a daemon removes the stale files of its own kind (names made by ``new_arena_name``,
plus the ``-presence`` filters beside them): those whose lock it can take. A file whose lock is
held (a live daemon, in any namespace), that it cannot open (another user's), or whose name is
not of that form (another program's, or an arena of a tierd before these locks) is never
touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import stat

_log = logging.getLogger(__name__)

PENDING = ".new"
"""Suffix of a file being created: it gets its final name only once its lock is held."""

_STALE_CANDIDATE = re.compile(r"^tierd-arena-[0-9a-f]{16}(-presence)?$")
"""Files a daemon may judge. Not ``PENDING`` ones: a daemon creating one takes its lock a moment
after ``open``, and a crash in that moment leaves an empty file, nothing worth a race."""


def new_arena_name() -> str:
    """A fresh daemon arena name, ``tierd-arena-<16 hex digits>`` (unique across hosts and
    containers sharing a ``/dev/shm``: no PID, which every container's daemon shares)."""
    return f"tierd-arena-{secrets.token_hex(8)}"


def create_locked(path: str, mode: int) -> int:
    """Create ``path`` (``FileExistsError`` if it exists) with ``mode``, and return its open
    read-write fd holding an exclusive ``flock``: the file is never visible under ``path``
    unlocked. Closing the fd (or the process dying) releases the lock."""
    pending = path + PENDING
    fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file just made: nobody else has it
        os.link(pending, path)  # FileExistsError if taken; never replaces a file
    except BaseException:
        os.close(fd)
        os.unlink(pending)
        raise
    os.unlink(pending)
    return fd


def unlink_if_abandoned(path: str) -> bool:
    """Unlink ``path`` if it is a regular file this process can open and nobody holds its lock
    (its maker died); True if it was removed. Never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone, another user's, or a link: not ours to judge
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live process holds it
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            return False  # replaced since it was opened
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def remove_stale_arenas(directory: str) -> list[str]:
    """Unlink the daemon arenas and presence filters in ``directory`` whose makers died (see the
    module doc); returns the names removed, sorted."""
    removed = []
    for name in sorted(os.listdir(directory)):
        if _STALE_CANDIDATE.match(name) is None:
            continue
        try:
            if unlink_if_abandoned(os.path.join(directory, name)):
                removed.append(name)
        except OSError as exc:
            _log.warning("could not remove stale arena %s: %s", name, exc)
    if removed:
        _log.info("removed %d stale arena files of dead daemons from %s: %s", len(removed),
                  directory, ", ".join(removed))
    return removed
