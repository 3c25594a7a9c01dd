"""The DRAM tier's memory: one shared-memory file, mapped by the daemon and by every engine.

KV bytes live here and never cross gRPC. The daemon creates the arena at start-up (and pre-faults
it, so the first block copied in is not slowed by page faults) and unlinks it at shutdown; engines
attach by name and copy blocks in and out of slots themselves (``as_tensor`` + ``torch.copy_``).
On a GPU host an engine registers the mapping as pinned memory once
(``cudaHostRegister(tensor.data_ptr(), size, cudaHostRegisterPortable)``) so copies run at PCIe
speed; the CPU-only build of torch has no such call and copies through pageable memory.

The file is opened with ``os.open`` + ``mmap``, not ``multiprocessing.shared_memory``: Python 3.11
has no ``track=False``, so an engine attaching through it would make the resource tracker warn
about, or unlink, the daemon's segment when the engine exits.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierd.daemon.arena_owner import create_locked
from tierd.daemon.engine_access import denied, share

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


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


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"arena name {name!r} must be a plain file name such as 'tierd-1234-ab12'")


class ShmArena:
    """One file under ``/dev/shm`` (or ``directory``) mapped shared and writable.

    ``name`` is the file name only (what engines receive in the register reply), ``path`` the full
    path, ``size`` the mapped bytes. Not thread-safe to close while other threads use views.
    """

    name: str
    path: str
    size: int

    def __init__(self, name: str, path: str, mm: mmap.mmap, owner_fd: int | None = None) -> None:
        """Internal: use ``create`` (daemon) or ``attach`` (engine)."""
        self._owner_fd = owner_fd  # the maker's open fd, holding the file's lock until close
        self.name = name
        self.path = path
        self.size = len(mm)
        self._mm: mmap.mmap | None = mm
        self._whole: memoryview | None = memoryview(mm)

    @classmethod
    def create(
        cls, name: str, size_bytes: int, *, directory: str = "/dev/shm", prefault: bool = True
    ) -> ShmArena:
        """Create the file (mode 0600, must not exist), size it and map it. The file is
        locked (``arena_owner``) until ``close``, so a later daemon sees it is alive.

        ValueError naming ``--shm-size`` and ``--dram-bytes`` if ``directory`` has less than
        ``size_bytes`` free (nothing is created). With ``prefault`` every page is allocated
        now (``posix_fallocate``: a tmpfs that runs short answers ENOSPC, the same ValueError,
        instead of SIGBUS on a later touch) and mapped, by several threads at once
        (``madvise(MADV_POPULATE_WRITE)`` per range, or a ``memset`` where the kernel lacks it):
        first touch costs ~2-2.7 s per GiB when done lazily, serially, on the copy path.
        Blocks for that time. ValueError if ``size_bytes <= 0`` or the file already exists.
        """
        _check_name(name)
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

    @classmethod
    def attach(cls, name: str, *, directory: str = "/dev/shm", prefault: bool = False) -> ShmArena:
        """Map an existing arena (engine side). FileNotFoundError if the daemon has not created it;
        PermissionError naming the file's owner and mode and the fixes if this user may not.

        ``prefault=True`` maps every page into this process now (pages already exist, so this only
        builds page tables: far cheaper than the daemon's pre-fault, but still worth doing once
        before the first copy). Registers nothing with ``multiprocessing``.
        """
        _check_name(name)
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError as exc:
            raise PermissionError(exc.errno, denied(path, "arena") or str(exc)) from None
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ValueError(f"{path} is empty: it is not a tierd arena "
                                 "(daemon still starting?)")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arena = cls(name, path, mm)
        if prefault:
            arena.prefault()
        return arena

    def prefault(self) -> None:
        """Map every page of the mapping for writing, a few ranges in parallel. Blocks until done;
        contents are unchanged (a no-op on kernels without ``MADV_POPULATE_WRITE``)."""
        self._prefault(fresh=False)

    def _prefault(self, *, fresh: bool) -> None:
        whole = self._require_open()
        anchor = ctypes.c_char.from_buffer(whole)
        try:
            _populate_parallel(ctypes.addressof(anchor), self.size, fresh)
        finally:
            del anchor

    def share_with_group(self, gid: int) -> None:
        """Give the file to group ``gid``, mode 0660, so engines of that group may attach
        (``engine_access``). Only the maker, while open; ValueError naming the fix if refused."""
        assert self._owner_fd is not None, "only the maker of an open arena can share it"
        share(self._owner_fd, gid)

    def address(self, offset: int, length: int) -> int:
        """The address of ``[offset, offset + length)`` in this process's mapping, for native
        code that reads it while the arena stays open; ValueError as ``view``."""
        anchor = ctypes.c_char.from_buffer(self.view(offset, length))
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``[offset, offset + length)``: no copy, valid until ``close``.

        ValueError if the range is empty or leaves the arena (e.g. a slot id out of range).
        """
        whole = self._require_open()
        if length <= 0 or offset < 0 or offset + length > self.size:
            raise ValueError(
                f"range [{offset}, {offset + length}) is outside arena {self.name} of {self.size} "
                "bytes: check the slot id and slot geometry"
            )
        return whole[offset : offset + length]

    def as_tensor(self, *, prefault: bool = True) -> torch.Tensor:
        """A uint8 torch tensor over the whole arena file (``torch.from_file``, shared mapping).

        ``prefault`` maps every page of the tensor's own mapping now (page tables only, contents
        unchanged; a mapping of its own is not covered by ``attach(prefault=True)``): otherwise
        the first copy through each page takes a page fault on the copying thread.

        Engines copy blocks with ``tensor[off:off + n].copy_(src)``; on a GPU host they
        ``cudaHostRegister`` ``tensor.data_ptr()`` once so those copies are DMA from pinned memory.
        The tensor owns a mapping of its own, held by its storage: it stays valid after ``close``
        and after the daemon unlinks the file, and is unmapped when the last tensor over it dies.
        (A ``torch.frombuffer`` view of this object's mmap would dangle after ``close``.)
        """
        import torch

        self._require_open()
        tensor = torch.from_file(self.path, shared=True, size=self.size, dtype=torch.uint8)
        if prefault:
            _populate_parallel(tensor.data_ptr(), self.size, fresh=False)
        return tensor

    def close(self) -> None:
        """Drop this process's mapping (and the maker's lock: unlink next). Idempotent. If views
        or tensors are still alive the pages stay mapped until the last of them is
        garbage-collected (never a dangling pointer)."""
        whole, mm, owner_fd = self._whole, self._mm, self._owner_fd
        self._whole = self._mm = self._owner_fd = None
        if owner_fd is not None:
            os.close(owner_fd)
        if whole is not None and mm is not None:
            whole.release()
            try:
                mm.close()
            except BufferError:
                _log.debug("arena %s: views still alive; unmapped when they are freed", self.name)

    def unlink(self) -> None:
        """Remove the file (daemon side, at shutdown). Engines still attached keep their mapping
        until they close it. Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _require_open(self) -> memoryview:
        if self._whole is None:
            raise ValueError(f"arena {self.name} is closed: attach it again")
        return self._whole

    def __repr__(self) -> str:
        return f"ShmArena(name={self.name!r}, size={self.size}, open={self._whole is not None})"


def _ranges(size: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut into a few page-aligned ``(offset, length)`` ranges, one per thread."""
    n = max(1, min(os.cpu_count() or 1, 8))
    chunk = -(-size // n // _PAGE) * _PAGE
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def _in_parallel(work: Callable[[int, int], None], size: int) -> None:
    """``work(offset, length)`` over ``_ranges(size)``, in threads; the first error is raised
    once every thread has finished."""
    errors: list[BaseException] = []

    def run(offset: int, length: int) -> None:
        try:
            work(offset, length)
        except BaseException as exc:  # handed to the caller's thread below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=r) for r in _ranges(size)[1:]]
    for worker in workers:
        worker.start()
    run(*_ranges(size)[0])
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


def _allocate_parallel(fd: int, size: int, directory: str) -> None:
    """Allocate every page of the file now; ValueError naming the fixes if the filesystem runs
    out (another process filled it since ``check_room``, or a memory limit). A filesystem
    without ``fallocate`` is left to the pre-fault."""
    try:
        _in_parallel(lambda off, length: os.posix_fallocate(fd, off, length), size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        if exc.errno == errno.ENOSPC:
            raise ValueError(_short(directory, size, "it ran out of room while allocating "
                                    "the arena")) from None
        raise


def _populate_parallel(base: int, size: int, fresh: bool) -> None:
    """``_populate`` the page-aligned range ``[base, base + size)`` in a few threads at once."""
    _in_parallel(lambda off, length: _populate(base + off, length, fresh), size)


def _populate(address: int, length: int, fresh: bool) -> None:
    """Fault in ``length`` bytes at ``address`` for writing; ctypes releases the GIL meanwhile.
    On a kernel without MADV_POPULATE_WRITE (EINVAL) a ``fresh`` (all-zero, unshared) range is
    zero-filled instead, which faults it just the same; an attached range is left alone. Any
    other failure of a ``fresh`` range (EFAULT: the kernel has no page for it, where a touch
    would be SIGBUS) raises OSError."""
    if _libc.madvise(address, length, _MADV_POPULATE_WRITE) == 0 or not fresh:
        return
    code = ctypes.get_errno()
    if code != errno.EINVAL:
        raise OSError(code, f"pre-faulting the arena failed: {os.strerror(code)}")
    ctypes.memset(address, 0, length)
