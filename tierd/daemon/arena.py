"""The DRAM arena as its maker holds it: ``OwnedArena`` creates the shared-memory file, pre-faults
it (so the first block copied in is not slowed by page faults), may give it to the engines'
group, and unlinks it at shutdown. Engines map the same file with ``tierd.wire.arena.ShmArena``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time

from tierd.daemon.arena_owner import create_locked
from tierd.daemon.engine_access import share
from tierd.wire.arena import ShmArena, check_name, in_parallel

_log = logging.getLogger(__name__)


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_room(directory: str, need_bytes: int, free: int) -> None:
    """``ValueError`` naming the sizes and the fixes when ``need_bytes`` exceed ``free`` bytes
    of ``directory`` (a tmpfs whose pages, once short, would kill the process with SIGBUS)."""
    if need_bytes > free:
        raise ValueError(_short(directory, need_bytes, f"only {_mib(free)} is free"))


def _short(directory: str, need_bytes: int, why: str) -> str:
    return (f"the DRAM arena needs {_mib(need_bytes)} in {directory} but {why}: give it more "
            f"shared memory (docker run --shm-size={_suggest(need_bytes)}, compose shm_size) "
            "or make the arena smaller (TIERD_DRAM_BYTES / --dram-bytes)")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _suggest(need_bytes: int) -> str:
    """A ``--shm-size`` with some room above ``need_bytes``, in whole MiB (``1088m``)."""
    return f"{-(-need_bytes * 17 // 16 // (1 << 20))}m"


class OwnedArena(ShmArena):
    """The daemon's arena: an ``ShmArena`` it made and holds locked until ``close``."""

    @classmethod
    def create(
        cls, name: str, size_bytes: int, *, directory: str = "/dev/shm", prefault: bool = True
    ) -> OwnedArena:
        """Create the file (mode 0600, must not exist), size it and map it. The file is
        locked (``arena_owner``) until ``close``, so a later daemon sees it is alive.

        ValueError naming ``--shm-size`` and ``--dram-bytes`` if ``directory`` has less than
        ``size_bytes`` free (nothing is created). With ``prefault`` every page is allocated
        now (``posix_fallocate``: a tmpfs that runs short answers ENOSPC, the same ValueError,
        instead of SIGBUS on a later touch) and mapped, by several threads at once
        (``madvise(MADV_POPULATE_WRITE)`` per range, or a ``memset`` where the kernel lacks it),
        rather than lazily, serially, on the copy path.
        Blocks for that time. ValueError if ``size_bytes <= 0`` or the file already exists.
        """
        check_name(name)
        if size_bytes <= 0:
            raise ValueError(f"arena size must be > 0 bytes, got {size_bytes}")
        check_room(directory, size_bytes, free_bytes(directory))
        start = time.perf_counter()
        path = os.path.join(directory, name)
        try:
            fd = create_locked(path, 0o600)
        except FileExistsError:
            raise ValueError(
                f"{path} already exists: pick another arena name or unlink the stale file"
            ) from None
        try:
            os.ftruncate(fd, size_bytes)
            if prefault:
                _allocate_parallel(fd, size_bytes, directory)
            mm = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        arena = cls(name, path, mm, owner_fd=fd)  # fd stays open: the lock marks us alive
        if prefault:
            try:
                arena._prefault(fresh=True)
            except BaseException:
                arena.close()
                arena.unlink()
                raise
            _log.info("arena %s: pre-faulted %d MiB in %.3f s", path, size_bytes >> 20,
                      time.perf_counter() - start)
        return arena

    def share_with_group(self, gid: int) -> None:
        """Give the file to group ``gid``, mode 0660, so engines of that group may attach
        (``engine_access``). Only the maker, while open; ValueError naming the fix if refused."""
        assert self._owner_fd is not None, "only the maker of an open arena can share it"
        share(self._owner_fd, gid)

    def unlink(self) -> None:
        """Remove the file (daemon side, at shutdown). Engines still attached keep their mapping
        until they close it. Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _allocate_parallel(fd: int, size: int, directory: str) -> None:
    """Allocate every page of the file now; ValueError naming the fixes if the filesystem runs
    out (another process filled it since ``check_room``, or a memory limit). A filesystem
    without ``fallocate`` is left to the pre-fault."""
    try:
        in_parallel(lambda off, length: os.posix_fallocate(fd, off, length), size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        if exc.errno == errno.ENOSPC:
            raise ValueError(_short(directory, size, "it ran out of room while allocating "
                                    "the arena")) from None
        raise
