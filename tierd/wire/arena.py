"""The engine's map of the daemon's DRAM arena: one shared-memory file, mapped by the daemon and
by every engine (``ShmArena``; the daemon creates it as ``tierd.daemon.arena.OwnedArena``).

KV bytes live here and never cross gRPC: engines attach by name and copy blocks in and out of
slots themselves (``as_tensor`` + ``torch.copy_``). On a GPU host an engine registers the mapping
as pinned memory once (``cudaHostRegister``) so copies run at PCIe speed.

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
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierd.wire.access import denied

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def check_name(name: str) -> None:
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
        """Internal: use ``attach`` (engine) or ``OwnedArena.create`` (daemon)."""
        self._owner_fd = owner_fd  # the maker's open fd, holding the file's lock until close
        self.name = name
        self.path = path
        self.size = len(mm)
        self._mm: mmap.mmap | None = mm
        self._whole: memoryview | None = memoryview(mm)

    @classmethod
    def attach(cls, name: str, *, directory: str = "/dev/shm", prefault: bool = False) -> ShmArena:
        """Map an existing arena (engine side). FileNotFoundError if the daemon has not created it;
        PermissionError naming the file's owner and mode and the fixes if this user may not.

        ``prefault=True`` maps every page into this process now (pages already exist, so this only
        builds page tables: far cheaper than the daemon's pre-fault, but still worth doing once
        before the first copy). Registers nothing with ``multiprocessing``.
        """
        check_name(name)
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
            populate_parallel(ctypes.addressof(anchor), self.size, fresh)
        finally:
            del anchor

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
            populate_parallel(tensor.data_ptr(), self.size, fresh=False)
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


def in_parallel(work: Callable[[int, int], None], size: int) -> None:
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


def populate_parallel(base: int, size: int, fresh: bool) -> None:
    """``_populate`` the page-aligned range ``[base, base + size)`` in a few threads at once."""
    in_parallel(lambda off, length: _populate(base + off, length, fresh), size)


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
