"""Segment files of the SSD tier and the blocking I/O on them (run on the store's threads; the
store is in ``store``, its index in ``index``, the record format in ``record``, all in
``tierd.daemon.ssd``).

A segment ``seg-<id, 16 hex digits>.kvs`` is records appended back to back; ids only grow. One
``SegmentWriter``, owned by a single thread, appends: a batch of records is one vectored write
(``pwritev`` of header, payload and padding per record) and one ``fdatasync`` per segment it
touches, plus a directory ``fsync`` when it creates a segment, before any record is reported
written. A record never crosses a segment: the writer rolls to a new segment when the next one
would pass ``segment_bytes`` (a record larger than that gets a segment of its own). A failed
batch is cut off again (``ftruncate``) and the writer moves on to a fresh segment, so a segment is
always acknowledged records followed by at most one torn batch, which the start-up scan
(``scan``) cuts off.

Transfers go straight between the caller's memory and the disk with ``O_DIRECT`` when every
buffer is 512-byte aligned in address and length (DRAM slots are); otherwise through the page
cache, whose pages for the range are dropped (``POSIX_FADV_DONTNEED``) once written and synced or
read, so it never becomes a second, unbounded DRAM tier.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import lz4.block

from tierd.checksum import block_checksum
from tierd.daemon.ssd.record import (
    ALIGN,
    FLAG_LZ4,
    HEADER_BYTES,
    Compression,
    RecordHeader,
    choose_payload,
    padded,
)
from tierd.daemon.ssd.statefile import PRIVATE_FILE
from tierd.types import BlockHash, Namespace

SEGMENT_SUFFIX = ".kvs"
_NAME = re.compile(r"seg-([0-9a-f]{16,})\.kvs")
SEGMENT_ID_MAX = (1 << 64) - 1
"""The largest id a segment name holds in its 16 hex digits; the writer never passes it."""
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))
_KICK_BYTES = 4 << 20  # buffered writes start writeback every this many bytes
_DIRECT_PIECE = 1 << 62  # O_DIRECT writes: one pwritev per IOV_MAX buffers, whatever the bytes
_ZEROS = memoryview(bytes(ALIGN))


def segment_name(segment_id: int) -> str:
    """``seg-<id in at least 16 hex digits>.kvs``: one name per id, one id per name."""
    return f"seg-{segment_id:016x}{SEGMENT_SUFFIX}"


def segment_id(name: str) -> int | None:
    """The id in a segment file's name, or None for any other name (also for a non-canonical
    spelling such as a 17-digit id with a leading zero, so no two names share an id). Ids past
    ``SEGMENT_ID_MAX`` (names of an older version's overflow) are returned: the scan renumbers
    them."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    sid = int(match.group(1), 16)
    return sid if segment_name(sid) == name else None


def open_segment(path: str, *, create: bool = False, direct: bool = False
                 ) -> tuple[int, int | None]:
    """(read-write fd, ``O_DIRECT`` fd or None) of a segment the writer made; ``create`` fails if
    the name exists (mode 0600: other local users never read KV). Never follows a symlink (the
    scan's checks of files it did not just make are in ``scan``)."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, PRIVATE_FILE)
    if not direct:
        return fd, None
    try:
        return fd, os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECT)
    except OSError:
        return fd, None


@dataclass(frozen=True, slots=True)
class AppendJob:
    """A block to append: its payload unchanged until the writer returns."""

    namespace: Namespace
    block_hash: BlockHash
    payload: memoryview
    checksum: int  # block_checksum of payload, as the engine computed it


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a record was written (and synced)."""

    segment: int
    offset: int
    head: RecordHeader


@dataclass(frozen=True, slots=True)
class Source:
    """Records adjacent in one segment, to read with one ``preadv``: from ``offset`` of the
    segment open as ``fd`` / ``dfd`` (O_DIRECT), one after the other."""

    fd: int
    dfd: int | None
    offset: int
    heads: list[RecordHeader]  # what the index expects each record to say


@dataclass(frozen=True, slots=True)
class WriterReport:
    """A writer job's outcome: one result per input, the file size of every segment the job
    touched, and the id below which every segment is sealed (never appended to again)."""

    results: list[Placed | int | OSError | str]
    ends: dict[int, int]
    sealed_below: int


@dataclass(slots=True)
class _Item:
    index: int
    head: RecordHeader
    parts: list[memoryview]  # header, payload, padding: head.size bytes in all


class SegmentWriter:
    """Appends records to the current segment. Not thread-safe: every call from one thread."""

    def __init__(self, directory: str, dir_fd: int, segment_bytes: int, first_id: int,
                 direct: bool) -> None:
        self.directory, self.dir_fd, self.segment_bytes = directory, dir_fd, segment_bytes
        self.direct = direct
        self._next = first_id
        self._id = -1
        self._fd: int | None = None
        self._dfd: int | None = None
        self._end = 0
        self._ends: dict[int, int] = {}

    @property
    def sealed_below(self) -> int:
        return self._id if self._fd is not None else self._next

    def append(self, jobs: Sequence[AppendJob], compression: Compression) -> WriterReport:
        """Write ``jobs`` durably: per job a ``Placed``, -1 if its payload does not match its
        checksum (nothing written), or the OSError that stopped the batch."""
        results: list[Placed | int | OSError | str] = [-1] * len(jobs)
        chosen = []
        for i, job in enumerate(jobs):
            if block_checksum(job.payload) == job.checksum:
                flags, data = choose_payload(job.payload, compression)
                chosen.append((i, RecordHeader(flags, job.namespace, job.block_hash,
                                               len(job.payload), len(data), job.checksum),
                               memoryview(data)))
        headers = memoryview(mmap.mmap(-1, max(1, len(chosen)) * HEADER_BYTES))
        items = []
        for k, (i, head, data) in enumerate(chosen):
            view = headers[k * HEADER_BYTES:(k + 1) * HEADER_BYTES]
            head.pack_into(view)
            items.append(_Item(i, head, [view, data, *_pad(head.stored_len)]))
        self._write(items, results)
        return self._report(results)

    def copy(self, runs: Sequence[Source]) -> WriterReport:
        """Compaction: re-append the records of ``runs`` (each run contiguous in one segment),
        read and verified first. Per record, in order: its new ``Placed``, what is wrong with it
        (a str: not copied), or the OSError that stopped the copy."""
        results: list[Placed | int | OSError | str] = []
        for run in runs:
            scratch = memoryview(mmap.mmap(-1, sum(head.size for head in run.heads)))
            faults = _read_run(run, [], scratch)
            items, at = [], 0
            for head, fault in zip(run.heads, faults):
                if fault is None:
                    items.append(_Item(len(results), head, [scratch[at:at + head.size]]))
                results.append(fault or -1)
                at += head.size
            self._write(items, results)
        return self._report(results)

    def close(self) -> None:
        self._seal()

    def _report(self, results: list[Placed | int | OSError | str]) -> WriterReport:
        ends, self._ends = self._ends, {}
        return WriterReport(results, ends, self.sealed_below)

    def _write(self, items: list[_Item], results: list[Placed | int | OSError | str]) -> None:
        pos = 0
        while pos < len(items):
            try:
                if self._fd is not None and self._end and (
                        self._end + items[pos].head.size > self.segment_bytes):
                    self._seal()
                if self._fd is None:
                    self._create()
                end, k = self._end + items[pos].head.size, pos + 1
                while k < len(items) and end + items[k].head.size <= self.segment_bytes:
                    end += items[k].head.size
                    k += 1
                self._write_chunk(items[pos:k])
            except OSError as exc:
                for item in items[pos:]:
                    results[item.index] = exc
                return
            at = end - sum(item.head.size for item in items[pos:k])
            for item in items[pos:k]:
                results[item.index] = Placed(self._id, at, item.head)
                at += item.head.size
            pos = k

    def _create(self) -> None:
        if self._next > SEGMENT_ID_MAX:  # only after 2^32 segments past a renumbering scan
            raise OSError(errno.EOVERFLOW, "segment ids exhausted: restart the daemon to "
                          "renumber them")
        self._id, self._next = self._next, self._next + 1
        path = os.path.join(self.directory, segment_name(self._id))
        self._fd, self._dfd = open_segment(path, create=True, direct=self.direct)
        self._end = 0
        self._ends[self._id] = 0
        os.fsync(self.dir_fd)  # the name is durable before any record in it is acknowledged

    def _write_chunk(self, chunk: list[_Item]) -> None:
        assert self._fd is not None, "writing with no segment open"
        start = self._end
        parts = [p for item in chunk for p in item.parts]
        total = sum(item.head.size for item in chunk)
        direct = self._dfd is not None and all(_aligned(p) for p in parts)
        try:
            if direct:
                assert self._dfd is not None
                try:
                    _pwrite_all(self._dfd, parts, start, _DIRECT_PIECE, kick=False)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    os.close(self._dfd)  # this filesystem wants more than 512-byte alignment
                    self._dfd, self.direct, direct = None, False, False
            if not direct:
                _pwrite_all(self._fd, parts, start, _KICK_BYTES, kick=True)
            os.fdatasync(self._fd)
            if not direct:
                os.posix_fadvise(self._fd, start, total, os.POSIX_FADV_DONTNEED)
        except OSError:
            try:
                os.ftruncate(self._fd, start)
                self._ends[self._id] = start
            except OSError:
                self._ends[self._id] = start + total  # counted as garbage by the store
            self._seal()
            raise
        self._end = self._ends[self._id] = start + total

    def _seal(self) -> None:
        for fd in (self._fd, self._dfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._dfd = None


def read_runs(runs: Sequence[Source], targets: Sequence[Sequence[memoryview]]
              ) -> list[list[str | None]]:
    """Read and verify runs of records (one ``preadv`` per run where ``IOV_MAX`` allows)
    straight into their targets (each exactly its block's payload length): per record None if
    intact, else what is wrong. Never raises for a bad record or a read error. Buffered runs ask
    the kernel for the next run's bytes while reading this one."""
    faults = []
    for k, (run, into) in enumerate(zip(runs, targets)):
        if k + 1 < len(runs) and runs[k + 1].dfd is None:
            after = runs[k + 1]
            _advise(after.fd, after.offset, sum(head.size for head in after.heads),
                    os.POSIX_FADV_WILLNEED)
        faults.append(_read_run(run, into, None))
    return faults


def _read_run(run: Source, into: Sequence[memoryview], raw: memoryview | None
              ) -> list[str | None]:
    """One run: into ``into`` (payloads) or, for compaction, whole records into ``raw``."""
    heads = run.heads
    compressed = sum(padded(head.stored_len) for head in heads if head.flags & FLAG_LZ4)
    scratch = memoryview(mmap.mmap(-1, len(heads) * HEADER_BYTES + compressed + ALIGN))
    sink = scratch[-ALIGN:]
    iov: list[memoryview] = []
    targets: list[memoryview] = []  # iov buffers not in scratch or raw (page-aligned mmaps)
    raw_heads, payloads, at, start = [], [], len(heads) * HEADER_BYTES, 0
    for k, head in enumerate(heads):
        stored = head.stored_len
        if raw is not None:
            raw_heads.append(raw[start:start + HEADER_BYTES])
            payloads.append(raw[start + HEADER_BYTES:start + HEADER_BYTES + stored])
            start += head.size
            continue
        raw_heads.append(scratch[k * HEADER_BYTES:(k + 1) * HEADER_BYTES])
        iov.append(raw_heads[-1])
        if head.flags & FLAG_LZ4:
            payloads.append(scratch[at:at + stored])
            iov.append(scratch[at:at + padded(stored)])
            at += padded(stored)
        else:
            payloads.append(into[k])
            targets.append(into[k])
            iov.append(into[k])
            if head.size - HEADER_BYTES != stored:
                iov.append(sink[:head.size - HEADER_BYTES - stored])
    if raw is not None:
        iov = targets = [raw]
    total = sum(head.size for head in heads)
    direct = run.dfd is not None and all(_aligned(v) for v in targets)
    n = _pread_all(run.dfd if direct and run.dfd is not None else run.fd, iov, run.offset)
    if direct and n == -1:  # EINVAL: O_DIRECT wants more alignment here; go buffered
        direct, n = False, _pread_all(run.fd, iov, run.offset)
    if not direct:
        _advise(run.fd, run.offset, total, os.POSIX_FADV_DONTNEED)
    faults: list[str | None] = []
    end = 0
    for k, head in enumerate(heads):
        end += head.size
        if isinstance(n, str):
            faults.append(n)
        elif n < end:
            faults.append(f"{max(n, 0)} bytes read of a run of {total}: truncated")
        else:
            faults.append(_verify(head, raw_heads[k], payloads[k],
                                  into[k] if raw is None else None))
    return faults


def _verify(expected: RecordHeader, raw_head: memoryview, payload: memoryview,
            into: memoryview | None) -> str | None:
    """What is wrong with a record read back (None if intact): its header must be exactly the
    one the index expects (so it verifies and names the block), its payload decode (lz4) and
    match the header's checksum. ``into``: where a compressed payload is decompressed to (None:
    a scratch buffer, only to check it)."""
    if bytes(raw_head) != expected.pack():
        return _header_fault(expected, raw_head)
    if expected.flags & FLAG_LZ4:
        try:
            plain = lz4.block.decompress(payload, uncompressed_size=expected.payload_len)
        except (lz4.block.LZ4BlockError, ValueError) as exc:
            return f"lz4 payload corrupt: {exc}"
        if into is not None:
            into[:] = plain
        payload = memoryview(plain)
    if block_checksum(payload) != expected.checksum:
        return "payload checksum mismatch"
    return None


def _header_fault(expected: RecordHeader, raw_head: memoryview) -> str:
    """Why a header read back is not the one the index expects."""
    head = RecordHeader.unpack(raw_head)
    if head is None:
        return "bad header"
    if (head.namespace, head.block_hash) != (expected.namespace, expected.block_hash):
        return f"header names another block ({head.namespace.hex()}-{head.block_hash.hex()})"
    return "header disagrees with the index"


def _pad(stored_len: int) -> list[memoryview]:
    """The zeros written after a payload of ``stored_len`` bytes."""
    gap = padded(stored_len) - stored_len
    return [_ZEROS[:gap]] if gap else []


def _aligned(view: memoryview) -> bool:
    """Whether ``view`` may take part in an ``O_DIRECT`` transfer (512-byte aligned address
    and length; read-only buffers are treated as unaligned)."""
    if len(view) % ALIGN or view.readonly or not view.contiguous:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


def _advise(fd: int, offset: int, length: int, advice: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except OSError:
        pass  # only a hint


def _pwrite_all(fd: int, parts: list[memoryview], offset: int, piece: int, *, kick: bool) -> None:
    """Write ``parts`` at ``offset``, at most ``IOV_MAX`` buffers and about ``piece`` bytes a
    call; with ``kick``, after each call the written range's writeback starts (``DONTNEED`` on
    dirty pages starts it without waiting), so the disk works while the next bytes are copied."""
    start = offset
    while parts:
        take, size = 0, 0
        while take < min(len(parts), _IOV_MAX) and (take == 0 or size + len(parts[take]) <= piece):
            size += len(parts[take])
            take += 1
        n = os.pwritev(fd, parts[:take], offset)
        if kick:
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts = parts[1:]
        if parts and n:
            parts = [parts[0][n:], *parts[1:]]
    assert offset > start or not parts, "a write made no progress"


def _pread_all(fd: int, iov: list[memoryview], offset: int) -> int | str:
    """Bytes read into ``iov`` from ``offset`` (fewer at the end of the file); -1 for EINVAL
    (O_DIRECT refused the buffers), or the error as text."""
    done = 0
    try:
        for k in range(0, len(iov), _IOV_MAX):
            piece = iov[k:k + _IOV_MAX]
            want = sum(len(v) for v in piece)
            n = os.preadv(fd, piece, offset + done)
            done += n
            if n < want:
                break
    except OSError as exc:
        return -1 if exc.errno == errno.EINVAL else f"read failed: {exc}"
    return done
