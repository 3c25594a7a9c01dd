"""The raw-disk baseline the SSD tier is judged against: sequential write + fsync, then read back.

Used by ``tierd bench daemon`` ("SSD store at >= 70% of raw disk", measured in the same run).
Reads must come from the device, not the page cache, without dropping the machine's caches: the
file is written and read with ``O_DIRECT`` where the filesystem allows it (ext4, xfs; not tmpfs),
else buffered with ``fdatasync`` and ``POSIX_FADV_DONTNEED`` on that one file before reading back.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

_ALIGN = 4096


def o_direct_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT``."""
    path = os.path.join(directory, f".tierd-odirect-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


def measure_raw_disk(directory: str | os.PathLike[str], nbytes: int, *,
                     chunk_bytes: int = 2 << 20) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one temporary file of ``nbytes`` (rounded up to whole
    ``chunk_bytes``) in ``directory``, written sequentially then fsync'ed, then read back.
    O_DIRECT if supported (see the module docstring). Blocks; the file is removed after."""
    if nbytes <= 0 or chunk_bytes <= 0 or chunk_bytes % _ALIGN:
        raise ValueError(f"need nbytes > 0 and chunk_bytes a positive multiple of {_ALIGN}")
    chunks = -(-nbytes // chunk_bytes)
    total = chunks * chunk_bytes
    direct = o_direct_supported(directory)
    flag = os.O_DIRECT if direct else 0
    buf = mmap.mmap(-1, chunk_bytes)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(chunk_bytes))  # incompressible, like fp16 KV
    view = memoryview(buf)
    path = os.path.join(directory, f".tierd-rawdisk-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o600)
        try:
            start = time.perf_counter()
            for i in range(chunks):
                assert os.pwrite(fd, view, i * chunk_bytes) == chunk_bytes, "short raw write"
            os.fdatasync(fd)
            write_s = time.perf_counter() - start
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | flag)
        try:
            start = time.perf_counter()
            for i in range(chunks):
                assert os.preadv(fd, [view], i * chunk_bytes) == chunk_bytes, "short raw read"
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        view.release()
        buf.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return total / write_s / 1e9, total / read_s / 1e9
