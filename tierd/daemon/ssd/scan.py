"""The start-up scan of the SSD directory: which files it trusts, how their ids are kept in range,
and which records it finds in each (``SegmentTable.load`` in ``index`` builds the index from it).

**Trust.** A name of the form ``seg-<id>.kvs`` is only a candidate. The scan opens it with
``O_NOFOLLOW`` (a symlink is refused by the kernel) and keeps it only if it is a regular file with
one link, owned by the daemon's effective uid, checked on the open descriptor (``fstat``), so a
name swapped between the check and the open is caught too. Anything else named like a segment (a
symlink, a hard link to a file elsewhere, a directory, a FIFO, another user's file) is skipped
with one warning each and never read, written, truncated, renamed or removed: the daemon may run
as root, and the directory is not proof that its files are ours. A trusted segment readable by
group or others (an older version's 0644) is made 0600 (logged, with the count).

**Ids.** Segment names carry their id in at least 16 hex digits (``segment_name``); ids only grow.
A name whose id is at or near 2^64 (planted, or written by an older version that let the id pass
16 digits) would leave no room for the next one, so when the largest trusted id passes
``RENUMBER_ABOVE`` every trusted segment is renamed, in id order, to the smallest ids free (names
of skipped files stay taken). Renaming in increasing order never lets a new name pass an old one,
so a crash halfway leaves the same order, and a restart finishes the job.

**Records.** ``scan_segment`` walks a segment header by header. A header that does not verify, or
a record that runs past the end of the file, is damage: the scan resynchronises on the next
512-byte-aligned offset holding the record magic and a header that verifies and fits, and keeps
every record from there. What lies between is a damaged span (garbage, only that record lost).
Bytes after the last header that verifies are the tail: cut off only in the newest segment (the
one being written at a crash: a torn batch), kept as garbage in a sealed one (media damage; a
sealed segment is never truncated).

Blocking, small reads; runs on the caller's thread once, at ``SsdStore.open``.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from tierd.daemon.ssd.record import ALIGN, HEADER_BYTES, MAGIC, RecordHeader
from tierd.daemon.ssd.segment import SEGMENT_ID_MAX, segment_id, segment_name
from tierd.daemon.ssd.statefile import tighten

_log = logging.getLogger(__name__)

RENUMBER_ABOVE = SEGMENT_ID_MAX - (1 << 32)
"""A largest trusted id above this leaves fewer than 2^32 ids (256 PiB of 64 MiB segments) to grow
into: the scan renumbers the segments from the smallest free ids."""

_RESYNC_CHUNK = 1 << 20  # bytes read at a time while looking for the next header


@dataclass(slots=True)
class Opened:
    """A trusted segment file, open for reading and writing (``dfd``: ``O_DIRECT`` too)."""

    id: int
    path: str
    fd: int
    dfd: int | None
    size: int


@dataclass(frozen=True, slots=True)
class Scan:
    """What ``scan_segment`` found in one segment: its records (offset, header) in order, the
    damaged spans it skipped (start, end) before a record that verifies, and ``end``: where the
    last record ends (the tail after it holds no header that verifies)."""

    records: list[tuple[int, RecordHeader]]
    damaged: list[tuple[int, int]]
    end: int


@dataclass(frozen=True, slots=True)
class Listing:
    """The directory's segments: the trusted ones open in id order (renumbered if need be), the
    names skipped (not trusted), and the id the next new segment takes."""

    opened: list[Opened]
    skipped: set[str]
    next_id: int


def open_trusted(directory: Path, direct: bool) -> Listing:
    """Open every trusted segment of ``directory`` (``direct``: with an ``O_DIRECT`` descriptor
    too), warn once per name skipped, renumber if the ids are near the top (see the module
    docstring). Blocks; raises only what renaming a trusted segment raises."""
    opened: list[Opened] = []
    skipped: dict[str, int] = {}  # name -> its id
    tightened = 0
    for name in sorted(os.listdir(directory)):
        sid = segment_id(name)
        if sid is None:
            continue
        path = os.path.join(directory, name)
        got = _open_trusted(path)
        if isinstance(got, str):
            _log.warning("SSD tier %s: skipping %s (%s); it is left untouched: remove it or move "
                         "it out of the directory", directory, name, got)
            skipped[name] = sid
            continue
        fd, size = got
        tightened += tighten(fd) is not None
        opened.append(Opened(sid, path, fd, _open_direct(path, fd) if direct else None, size))
    if tightened:
        _log.info("SSD tier %s: %d segment files were readable by other users; made 0600",
                     directory, tightened)
    opened.sort(key=lambda o: o.id)
    if opened and opened[-1].id > RENUMBER_ABOVE:
        _renumber(directory, opened, set(skipped.values()))
    below = [sid for sid in skipped.values() if sid <= RENUMBER_ABOVE]
    next_id = max([o.id for o in opened] + below, default=-1) + 1
    return Listing(opened, set(skipped), next_id)


def _open_trusted(path: str) -> tuple[int, int] | str:
    """(fd, size) of a regular file with one link owned by us, else why not."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:  # ELOOP: a symlink; EISDIR: a directory; ENXIO: a socket
        return "a symlink" if os.path.islink(path) else f"cannot open it: {exc.strerror}"
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif st.st_nlink != 1:
        why = f"{st.st_nlink} hard links: not a file the daemon created"
    elif st.st_uid != os.geteuid():
        why = f"owned by uid {st.st_uid}, not the daemon's {os.geteuid()}"
    if why is not None:
        os.close(fd)
        return why
    os.set_blocking(fd, True)  # O_NONBLOCK only kept a FIFO swapped in from blocking the open
    return fd, st.st_size


def _open_direct(path: str, fd: int) -> int | None:
    """An ``O_DIRECT`` descriptor of the file open as ``fd`` (None if refused or if the name
    now points elsewhere)."""
    try:
        dfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECT)
    except OSError:
        return None
    a, b = os.fstat(fd), os.fstat(dfd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(dfd)
        return None
    return dfd


def _renumber(directory: Path, opened: list[Opened], taken: set[int]) -> None:
    """Rename the trusted segments, in id order, to the smallest ids not ``taken`` by a skipped
    name; each new id is at most the old one, so order survives a crash halfway."""
    new_id = 0
    for seg in opened:
        while new_id in taken:
            new_id += 1
        if new_id != seg.id:
            path = os.path.join(directory, segment_name(new_id))
            os.rename(seg.path, path)
            seg.id, seg.path = new_id, path
        new_id += 1
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    _log.warning("SSD tier %s: segment ids were near 2^64; renumbered %d segments from 0",
                 directory, len(opened))


def scan_segment(fd: int, size: int) -> Scan:
    """The records of a segment file of ``size`` bytes, in order, resynchronising past damage
    (see the module docstring). Reads headers only (payloads are verified when read), plus the
    bytes of damaged spans while looking for the next header."""
    records: list[tuple[int, RecordHeader]] = []
    damaged: list[tuple[int, int]] = []
    offset = 0
    while offset + HEADER_BYTES <= size:
        head = _header_at(fd, offset, size)
        if head is not None:
            records.append((offset, head))
            offset += head.size
            continue
        found = _resync(fd, offset + ALIGN, size)
        if found is None:
            break
        damaged.append((offset, found))
        offset = found
    _advise_dontneed(fd)
    return Scan(records, damaged, offset)


def _header_at(fd: int, offset: int, size: int) -> RecordHeader | None:
    """The header at ``offset`` if it verifies and its record fits in the file, else None."""
    raw = os.pread(fd, HEADER_BYTES, offset)
    head = RecordHeader.unpack(raw)
    return head if head is not None and offset + head.size <= size else None


def _resync(fd: int, start: int, size: int) -> int | None:
    """The first ``ALIGN``-aligned offset from ``start`` (aligned) holding a header that
    verifies and fits, or None."""
    chunk_at = start
    while chunk_at + HEADER_BYTES <= size:
        chunk = os.pread(fd, min(_RESYNC_CHUNK, size - chunk_at), chunk_at)
        pos = chunk.find(MAGIC)
        while pos != -1:
            if pos % ALIGN == 0 and _header_at(fd, chunk_at + pos, size) is not None:
                return chunk_at + pos
            pos = chunk.find(MAGIC, pos + 1)
        chunk_at += len(chunk)
    return None


def _advise_dontneed(fd: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # only a hint
