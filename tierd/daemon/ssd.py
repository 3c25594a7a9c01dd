"""The SSD (cold) tier: append-only segment files in a directory with a byte bound.

Records (header, padding) are in ``tierd.daemon.ssdrecord``; segment files and the blocking I/O
on them in ``tierd.daemon.ssdsegment``. The index lives in memory: key -> (segment, offset,
header). A demotion pass (``write_many``) appends its records to the current segment with one
vectored write and one ``fdatasync`` (a directory ``fsync`` only when it creates a segment), on a
single writer thread, then acknowledges them. ``read_many`` sorts its records by (segment,
offset) and reads each run of adjacent records with one ``preadv`` straight into the targets.

Removal marks a record dead: ``used_bytes`` (what counts against the bound) is the live records'
bytes; the files also hold garbage. A segment whose records are all dead is unlinked at once;
before a batch is appended, if the sealed segments' garbage passes ``garbage_fraction`` of the
capacity, ``compact`` re-appends the live records of the segments with the most garbage (on the
writer thread, so it is ordered with appends) and unlinks them, until their garbage is at most
half that. Hence on disk, records no larger than a segment:

    physical bytes <= capacity * (1 + garbage_fraction) + 2 * segment_bytes

(the current segment's garbage, and the live bytes of a segment being copied), except after a
reopen with a smaller capacity until the caller has removed the excess.

Not thread-safe: call it from one thread (the daemon's event loop); only file I/O is offloaded.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tierd.daemon.rawdisk import o_direct_supported
from tierd.daemon.ssdrecord import Compression, RecordHeader, check_key, footprint
from tierd.daemon.ssdsegment import (
    SEGMENT_SUFFIX,
    AppendJob,
    Placed,
    SegmentWriter,
    Source,
    WriterReport,
    open_segment,
    read_runs,
    scan_segment,
    segment_id,
    segment_name,
)
from tierd.types import BlockHash, Namespace

_log = logging.getLogger(__name__)

_Key = tuple[Namespace, BlockHash]


@dataclass(frozen=True, slots=True)
class SsdEntry:
    """One block on the SSD, as the index knows it."""

    namespace: Namespace
    block_hash: BlockHash
    payload_len: int  # uncompressed block bytes
    stored_bytes: int  # the record's bytes in its segment: what counts against the bound
    checksum: int  # block_checksum of the uncompressed payload


@dataclass(frozen=True, slots=True)
class RecordSpan:
    """Where a record lies on disk (for tools and tests)."""

    path: Path
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class _Loc:
    """An indexed record; compared by identity to tell a moved or rewritten record apart."""

    segment: int
    offset: int
    head: RecordHeader


@dataclass(slots=True)
class _Segment:
    id: int
    path: str
    fd: int  # read fds, open until the segment is unlinked and no I/O uses them
    dfd: int | None  # O_DIRECT
    size: int = 0  # bytes in the file: records, dead or alive, and any failed batch
    live: int = 0  # bytes of indexed records
    busy: int = 0  # reads and copies in flight on the fds
    compacting: bool = False
    unlinked: bool = False


def _entry(head: RecordHeader) -> SsdEntry:
    return SsdEntry(head.namespace, head.block_hash, head.payload_len, head.size, head.checksum)


class SsdStore:
    """A directory with a byte bound, of append-only segments of crash-safe records (header:
    magic, version, namespace, hash, lengths, compression flag, payload checksum, header
    checksum). Reads and writes run in threads and never block the event loop. The store does
    not choose what to evict: the caller frees room (remove) before writing.

    Counters: ``checksum_failures`` (records found corrupt or mismatched on read or copy; each is
    dropped from the index), ``write_errors`` (OSErrors from the disk; each also sets ``healthy
    = False`` until a later write succeeds), ``torn_bytes`` (cut off torn tails at ``open``). A
    directory that cannot be opened leaves the store unhealthy and inert.
    """

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, *,
                 compression: Compression = "off", io_threads: int = 8,
                 segment_bytes: int = 64 << 20, garbage_fraction: float = 0.25,
                 direct_io: bool = True) -> None:
        """No I/O until ``open``. ValueError on a bound or segment size <= 0, an unknown
        compression, ``io_threads`` < 1 or ``garbage_fraction`` outside (0, 1]."""
        if capacity_bytes <= 0 or segment_bytes <= 0:
            raise ValueError(f"SSD capacity and segment size must be > 0 bytes, got "
                             f"{capacity_bytes} and {segment_bytes}")
        if compression not in ("off", "lz4", "auto"):
            raise ValueError(f"compression must be 'off', 'lz4' or 'auto', got {compression!r}")
        if io_threads < 1 or not 0 < garbage_fraction <= 1:
            raise ValueError(f"need io_threads >= 1 and 0 < garbage_fraction <= 1, got "
                             f"{io_threads} and {garbage_fraction}")
        self.directory = Path(directory)
        self.capacity_bytes, self.segment_bytes = capacity_bytes, segment_bytes
        self.garbage_fraction = garbage_fraction
        self.compression: Compression = compression
        self.used_bytes = 0
        self.healthy = False
        self.checksum_failures = self.write_errors = self.torn_bytes = 0
        self._io_threads, self._direct_io = io_threads, direct_io
        self._index: dict[_Key, _Loc] = {}
        self._segments: dict[int, _Segment] = {}
        self._sealed_below = 0  # segments with smaller ids are never appended to again
        self._pending: dict[_Key, bool] = {}  # key -> removed meanwhile
        self._reserved = 0  # record_bytes of writes in flight
        self._dir_fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None  # reads
        self._wpool: ThreadPoolExecutor | None = None  # the writer: appends and copies, in order
        self._writer: SegmentWriter | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def open(self) -> list[SsdEntry]:
        """Create the directory if needed, lock it (one daemon per directory) and rebuild the
        index by scanning every segment's headers in order. Blocks for one small read per record.

        A segment ends at its first header that does not verify or record that runs past the
        file (a torn batch from a crash): the tail is cut off and counted in ``torn_bytes``. A
        key found twice keeps its later record. Payload checksums are verified on read, not
        here. Returns the entries oldest first (append order: a fair starting LRU order). If
        the directory is unusable (not creatable, not a directory, locked by another daemon):
        logs a warning, leaves ``healthy`` False and returns []. ``used_bytes`` may exceed the
        bound if it shrank since the last run; the caller removes entries until it fits.
        """
        if self._dir_fd is not None:
            raise ValueError(f"SSD store {self.directory} is already open")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            _log.warning("SSD tier disabled, directory %s unusable: %s", self.directory, exc)
            return []
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(dir_fd)
            _log.warning("SSD tier disabled, %s is in use by another daemon: %s",
                         self.directory, exc)
            return []
        self._dir_fd = dir_fd
        direct = self._direct_io and o_direct_supported(self.directory)
        ids = sorted(i for i in map(segment_id, os.listdir(self.directory)) if i is not None)
        for sid in ids:
            path = os.path.join(self.directory, segment_name(sid))
            if os.path.isfile(path):
                self._load_segment(sid, path, direct)
        self._sealed_below = ids[-1] + 1 if ids else 0
        self._reap_all()
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="tierd-ssd")
        self._wpool = ThreadPoolExecutor(1, thread_name_prefix="tierd-ssd-writer")
        self._writer = SegmentWriter(str(self.directory), dir_fd, self.segment_bytes,
                                     self._sealed_below, direct)
        self.healthy = True
        _log.info("SSD tier %s: %d records, %d bytes of %d in %d segments (%d on disk); cut %d "
                  "torn bytes", self.directory, len(self._index), self.used_bytes,
                  self.capacity_bytes, len(self._segments), self.physical_bytes, self.torn_bytes)
        return [_entry(loc.head) for loc in self._index.values()]

    def close(self) -> None:
        """Wait for I/O in flight, close the segments, release the directory lock; reads then
        miss. Idempotent. Every acknowledged write is already durable; nothing is flushed
        here."""
        for pool in (self._pool, self._wpool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._wpool = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for seg in self._segments.values():
            _close(seg)
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        self.healthy = False

    # -- queries -------------------------------------------------------------------------------

    def record_bytes(self, payload_len: int) -> int:
        """Upper bound of ``stored_bytes`` for a block of ``payload_len`` bytes (compression is
        only kept when it is smaller)."""
        return footprint(payload_len)

    @property
    def physical_bytes(self) -> int:
        """Bytes of the segment files: live records plus garbage."""
        return sum(s.size for s in self._segments.values() if not s.unlinked)

    def contains(self, namespace: Namespace, block_hash: BlockHash) -> bool:
        """Whether an acknowledged record of the block is indexed (not yet verified)."""
        return (namespace, block_hash) in self._index

    def entry(self, namespace: Namespace, block_hash: BlockHash) -> SsdEntry | None:
        """The indexed entry of the block, or None."""
        loc = self._index.get((namespace, block_hash))
        return _entry(loc.head) if loc else None

    def locate(self, namespace: Namespace, block_hash: BlockHash) -> RecordSpan | None:
        """Where the block's record lies on disk, or None."""
        loc = self._index.get((namespace, block_hash))
        if loc is None:
            return None
        return RecordSpan(Path(self._segments[loc.segment].path), loc.offset, loc.head.size)

    def __len__(self) -> int:
        return len(self._index)

    # -- I/O -----------------------------------------------------------------------------------

    async def write(self, namespace: Namespace, block_hash: BlockHash, payload: memoryview,
                    checksum: int) -> SsdEntry | None:
        """``write_many`` of one block."""
        return (await self.write_many([(namespace, block_hash, payload, checksum)]))[0]

    async def write_many(self, blocks: Sequence[tuple[Namespace, BlockHash, memoryview, int]]
                         ) -> list[SsdEntry | None]:
        """Store blocks (namespace, hash, payload, checksum) durably: per block, in order, its
        entry once its record is on disk and indexed, or None. Runs ``compact`` if due, then
        appends the new records on the writer thread (one write, one sync per segment).

        Every payload stays unchanged until this returns (the caller keeps the DRAM slots
        pinned). A block already stored returns its entry. None, never raising, when: the
        payload does not match its checksum (counted in ``checksum_failures``: the DRAM copy is
        bad); the record would pass the bound (free room with ``remove`` first); the same block
        is being written now or earlier in the list; the store is not open; it was removed while
        being written; or the disk failed (``healthy`` False, warning, ``write_errors``).
        ValueError (nothing written) on a bad key or an empty payload."""
        for namespace, block_hash, payload, _ in blocks:
            check_key(namespace, block_hash)
            if len(payload) == 0:
                raise ValueError("an SSD record needs a non-empty payload")
        results: list[SsdEntry | None] = [None] * len(blocks)
        writes: list[tuple[int, _Key, int]] = []  # (index in blocks, key, bytes reserved)
        for i, (namespace, block_hash, payload, _) in enumerate(blocks):
            key = (namespace, block_hash)
            existing = self._index.get(key)
            if existing is not None:
                results[i] = _entry(existing.head)
                continue
            bound = self.record_bytes(len(payload))
            if (self._writer is None or key in self._pending
                    or self.used_bytes + self._reserved + bound > self.capacity_bytes):
                continue
            self._pending[key] = False
            self._reserved += bound
            writes.append((i, key, bound))
        if not writes:
            return results
        try:
            await self.compact()
        except BaseException:
            self._unreserve(writes)
            raise
        assert self._writer is not None, "the store was closed during compaction"
        done = self._submit(functools.partial(self._writer.append, [
            AppendJob(*blocks[i]) for i, _, _ in writes], self.compression))
        try:
            report = await asyncio.shield(done)
        except asyncio.CancelledError:  # the writer still finishes: its records become garbage
            done.add_done_callback(lambda _: self._abandon(writes, done))
            raise
        except BaseException:
            self._abandon(writes, done)
            raise
        self._absorb(report)
        for (i, key, bound), result in zip(writes, report.results):
            results[i] = self._written(key, bound, result)
        self._reap_all()
        return results

    async def read(self, namespace: Namespace, block_hash: BlockHash, into: memoryview) -> bool:
        """``read_many`` of one block."""
        return await self.read_many([(namespace, block_hash, into)])[0]

    def read_many(self, requests: Sequence[tuple[Namespace, BlockHash, memoryview]]
                  ) -> list[asyncio.Future[bool]]:
        """Start reading blocks (namespace, hash, target of exactly the payload length, e.g. a
        DRAM slot); one future each, in order, resolving True once the block is in its target
        and verified (header, lz4, payload checksum), False for a miss: not indexed (at once),
        or corrupt, truncated or mismatched (the record is dropped from the index and counted in
        ``checksum_failures``; the target holds garbage). Call it on the event loop's thread.

        Records are sorted by (segment, offset); adjacent ones form runs read with one
        ``preadv`` each, the runs shared among at most ``io_threads`` tasks of at least
        ``READ_BATCH_BYTES``. ValueError, nothing started, if a target's length differs from
        its block's payload length. Every target stays written to until its future resolves,
        even if the future is cancelled."""
        loop = asyncio.get_running_loop()
        for namespace, block_hash, into in requests:
            loc = self._index.get((namespace, block_hash))
            if loc is not None and len(into) != loc.head.payload_len:
                raise ValueError(f"read target of {len(into)} bytes for a block of "
                                 f"{loc.head.payload_len}: pass a view of exactly one slot")
        futures: list[asyncio.Future[bool]] = []
        reads: list[_Read] = []
        for namespace, block_hash, into in requests:
            futures.append(loop.create_future())
            loc = self._index.get((namespace, block_hash))
            if loc is None or self._pool is None:
                futures[-1].set_result(False)
            else:
                reads.append(_Read((namespace, block_hash), loc, into, futures[-1]))
        runs = _runs(reads)
        for task in _batches(runs, [sum(r.loc.head.size for r in run) for run in runs],
                             READ_BATCH_BYTES, self._io_threads):
            sources = [[self._source(r.loc) for r in run] for run in task]
            for run in task:
                self._segments[run[0].loc.segment].busy += 1
            done = loop.run_in_executor(self._pool, read_runs, sources,
                                        [[r.into for r in run] for run in task])
            done.add_done_callback(functools.partial(self._settle_reads, task))
        return futures

    def read_blocking(self, namespace: Namespace, block_hash: BlockHash) -> bytes | None:
        """The block's payload, read and verified on the calling thread (blocks); None if not
        indexed or it does not verify (the record is left to the caller)."""
        loc = self._index.get((namespace, block_hash))
        if loc is None or self._pool is None:
            return None
        into = bytearray(loc.head.payload_len)
        faults = read_runs([[self._source(loc)]], [[memoryview(into)]])[0]
        return bytes(into) if faults == [None] else None

    def remove(self, namespace: Namespace, block_hash: BlockHash) -> None:
        """Mark the block's record dead and free its bytes from ``used_bytes`` at once (its
        segment is unlinked when all its records are dead, else compacted later). No-op if
        absent; a write in flight for it is discarded when it completes. A removed record may
        come back after a crash and restart (its content is still that block's)."""
        key = (namespace, block_hash)
        if key in self._pending:
            self._pending[key] = True
        loc = self._index.pop(key, None)
        if loc is not None:
            self._drop(loc)

    async def compact(self) -> int:
        """If the sealed segments' garbage passes ``garbage_fraction`` of the capacity: copy the
        live records of those with the most garbage to the current segment (on the writer
        thread; reads of a moved record started earlier still read its old copy, whose segment
        stays open until they finish) and unlink them, until the garbage is at most half that.
        Returns the garbage bytes freed."""
        limit = self.garbage_fraction * self.capacity_bytes
        sealed = [s for s in self._segments.values()
                  if s.id < self._sealed_below and not (s.unlinked or s.compacting)]
        garbage = sum(s.size - s.live for s in sealed)
        if self._writer is None or garbage <= limit:
            return 0
        victims: list[_Segment] = []
        for seg in sorted(sealed, key=lambda s: s.live - s.size):
            if garbage <= limit / 2:
                break
            victims.append(seg)
            garbage -= seg.size - seg.live
            seg.compacting, seg.busy = True, seg.busy + 1
        ids = {v.id for v in victims}
        moves = sorted(((k, loc) for k, loc in self._index.items() if loc.segment in ids),
                       key=lambda m: (m[1].segment, m[1].offset))
        runs = _runs([_Read(k, loc, memoryview(b""), None) for k, loc in moves])
        assert self._writer is not None, "compaction needs the writer"
        done = self._submit(functools.partial(self._writer.copy, [
            [self._source(r.loc) for r in run] for run in runs]))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:  # the copy still finishes: settle it then
            done.add_done_callback(lambda _: self._compacted(victims, moves, done))
            raise
        return self._compacted(victims, moves, done)

    def _compacted(self, victims: list[_Segment], moves: list[tuple[_Key, _Loc]],
                   done: asyncio.Future[WriterReport]) -> int:
        """A compaction's copy finished: move the index entries, unlink the victims."""
        for v in victims:
            v.compacting, v.busy = False, v.busy - 1
        if done.cancelled() or done.exception() is not None:
            for v in victims:
                self._reap(v)
            return 0
        report = done.result()
        freed = sum(v.size - v.live for v in victims)
        self._absorb(report)
        for (key, loc), result in zip(moves, report.results):
            if self._index.get(key) is not loc:
                continue  # removed meanwhile: the copy, if any, is garbage
            if isinstance(result, Placed):
                self._index[key] = moved = _Loc(result.segment, result.offset, result.head)
                self._segments[loc.segment].live -= loc.head.size
                self._segments[moved.segment].live += loc.head.size
            elif isinstance(result, str):
                self._corrupt(key, loc, result)
            elif isinstance(result, OSError):
                self._note_write_error("compaction", result)
        self._reap_all()
        _log.info("SSD tier %s compacted %d segments, %d garbage bytes freed", self.directory,
                  len(victims), freed)
        return freed

    def check_integrity(self, *, disk: bool = False) -> None:
        """Assert the byte accounting equals the sum of the entries, per segment and in all, and
        records lie inside their segments without overlapping; with ``disk`` also that the
        directory holds exactly the known segments at their recorded sizes (call it with no
        write in flight)."""
        total = sum(loc.head.size for loc in self._index.values())
        assert self.used_bytes == total, f"used_bytes {self.used_bytes} != entries' sum {total}"
        assert self._reserved >= 0, f"negative reservation {self._reserved}"
        spans: dict[int, list[tuple[int, int]]] = {sid: [] for sid in self._segments}
        for (ns, bh), loc in self._index.items():
            assert (loc.head.namespace, loc.head.block_hash) == (ns, bh), f"{loc} filed wrongly"
            assert loc.segment in self._segments, f"{bh.hex()} in unknown segment {loc.segment}"
            spans[loc.segment].append((loc.offset, loc.offset + loc.head.size))
        for sid, seg in self._segments.items():
            ranges = sorted(spans[sid])
            assert seg.live == sum(e - s for s, e in ranges), f"segment {sid}: live bytes off"
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), f"{sid}: overlap"
            assert not ranges or ranges[-1][1] <= seg.size, f"segment {sid}: record past its end"
            assert not seg.unlinked or seg.live == 0, f"segment {sid} unlinked with live records"
        if not disk or self._dir_fd is None:
            return
        on_disk = {d.name: d.stat().st_size for d in os.scandir(self.directory)
                   if d.name.endswith(SEGMENT_SUFFIX) and d.is_file()}
        known = {segment_name(s.id): s.size for s in self._segments.values() if not s.unlinked}
        assert on_disk == known, f"disk and index disagree: {on_disk} vs {known}"

    # -- internals -----------------------------------------------------------------------------

    def _load_segment(self, sid: int, path: str, direct: bool) -> None:
        """``open``: scan one segment, cut a torn tail, index its records."""
        fd, dfd = open_segment(path, direct=direct)
        seg = self._segments[sid] = _Segment(sid, path, fd, dfd, os.fstat(fd).st_size)
        records, end = scan_segment(fd, seg.size)
        if end < seg.size:
            _log.warning("SSD segment %s: cutting a torn tail of %d bytes at %d", path,
                         seg.size - end, end)
            self.torn_bytes += seg.size - end
            os.ftruncate(fd, end)
            os.fsync(fd)
            seg.size = end
        for offset, head in records:
            old = self._index.pop((head.namespace, head.block_hash), None)
            if old is not None:
                self._drop(old, reap=False)
            self._index[(head.namespace, head.block_hash)] = _Loc(sid, offset, head)
            seg.live += head.size
            self.used_bytes += head.size

    def _submit(self, job: Callable[[], WriterReport]) -> asyncio.Future[WriterReport]:
        """Run a writer job on the writer thread, after those submitted before it."""
        assert self._wpool is not None, "store not open"
        return asyncio.get_running_loop().run_in_executor(self._wpool, job)

    def _absorb(self, report: WriterReport) -> None:
        """Take in a writer job's segments: new ones opened for reads, sizes, what is sealed."""
        for sid, end in report.ends.items():
            seg = self._segments.get(sid)
            if seg is None:
                path = os.path.join(self.directory, segment_name(sid))
                try:
                    fd, dfd = open_segment(path, direct=self._writer is not None
                                           and self._writer.direct)
                except OSError as exc:  # its records are lost to us: count them as garbage
                    self._note_write_error(f"open of {path}", exc)
                    continue
                seg = self._segments[sid] = _Segment(sid, path, fd, dfd)
            seg.size = end
        self._sealed_below = report.sealed_below

    def _reap_all(self) -> None:
        for seg in list(self._segments.values()):
            self._reap(seg)

    def _written(self, key: _Key, bound: int, result: Placed | int | OSError | str
                 ) -> SsdEntry | None:
        """Settle one finished write: index it or not."""
        self._reserved -= bound
        removed = self._pending.pop(key)
        if isinstance(result, OSError):
            self._note_write_error(f"write of {key[1].hex()}", result)
            return None
        if not isinstance(result, Placed):
            self.checksum_failures += 1
            _log.warning("SSD write of %s refused: payload does not match its checksum",
                         key[1].hex())
            return None
        seg = self._segments.get(result.segment)
        if removed or seg is None:
            return None
        self._index[key] = _Loc(result.segment, result.offset, result.head)
        seg.live += result.head.size
        self.used_bytes += result.head.size
        if not self.healthy:
            _log.warning("SSD tier %s healthy again after a successful write", self.directory)
            self.healthy = True
        return _entry(result.head)

    def _abandon(self, writes: list[tuple[int, _Key, int]],
                 done: asyncio.Future[WriterReport]) -> None:
        """A cancelled or failed ``write_many``'s writer job finished: end its reservations;
        what it wrote is garbage."""
        self._unreserve(writes)
        if not done.cancelled() and done.exception() is None:
            self._absorb(done.result())
            self._reap_all()

    def _unreserve(self, writes: list[tuple[int, _Key, int]]) -> None:
        for _, key, bound in writes:
            self._reserved -= bound
            self._pending.pop(key)

    def _settle_reads(self, task: list[list[_Read]],
                      done: asyncio.Future[list[list[str | None]]]) -> None:
        """A read task finished: drop the records that failed, resolve every future."""
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        for k, run in enumerate(task):
            faults = [None] * len(run) if error is not None else done.result()[k]
            for r, fault in zip(run, faults):
                if fault is not None and self._index.get(r.key) is r.loc:
                    self._corrupt(r.key, r.loc, fault)
                assert r.future is not None, "a read without a future"
                if r.future.done():
                    continue
                if error is not None:
                    r.future.set_exception(error)
                else:
                    r.future.set_result(fault is None)
            seg = self._segments[run[0].loc.segment]
            seg.busy -= 1
            self._reap(seg)

    def _source(self, loc: _Loc) -> Source:
        seg = self._segments[loc.segment]
        return Source(seg.fd, seg.dfd, loc.offset, loc.head)

    def _corrupt(self, key: _Key, loc: _Loc, fault: str) -> None:
        del self._index[key]
        self._drop(loc)
        self.checksum_failures += 1
        _log.warning("SSD record %s-%s dropped: %s", key[0].hex(), key[1].hex(), fault)

    def _drop(self, loc: _Loc, *, reap: bool = True) -> None:
        seg = self._segments[loc.segment]
        seg.live -= loc.head.size
        self.used_bytes -= loc.head.size
        if reap:
            self._reap(seg)

    def _reap(self, seg: _Segment) -> None:
        """Unlink a sealed segment with no live record; close it once no I/O uses it."""
        if seg.live or seg.id >= self._sealed_below or seg.compacting:
            return
        if not seg.unlinked:
            seg.unlinked = True
            try:
                os.unlink(seg.path)
            except OSError as exc:
                _log.warning("SSD segment %s not unlinked: %s", seg.path, exc)
        if seg.busy == 0:
            _close(seg)
            del self._segments[seg.id]

    def _note_write_error(self, what: str, exc: OSError) -> None:
        self.write_errors += 1
        if self.healthy:
            _log.warning("SSD tier %s unhealthy (serving DRAM only until a write succeeds): "
                         "%s failed: %s", self.directory, what, exc)
        self.healthy = False


@dataclass(slots=True)
class _Read:
    """A record being read into ``into``; ``future`` gets the outcome (None: a copy)."""

    key: _Key
    loc: _Loc  # what the index held when the read started
    into: memoryview
    future: asyncio.Future[bool] | None


def _close(seg: _Segment) -> None:
    for fd in (seg.fd, seg.dfd):
        if fd is not None and fd >= 0:
            os.close(fd)
    seg.fd, seg.dfd = -1, None


READ_BATCH_BYTES = 2 << 20
"""Smallest read task worth its own thread (at most ``io_threads`` of them): one ``preadv`` of a
run already gives the disk a deep queue; each more thread costs a hand-off and GIL contention."""

RUN_BYTES = 2 << 20
"""Largest run of adjacent records read with one ``preadv`` (at most 300 records: IOV_MAX)."""

T = TypeVar("T")


def _runs(reads: list[_Read]) -> list[list[_Read]]:
    """``reads`` sorted by (segment, offset) and cut into runs of adjacent records."""
    runs: list[list[_Read]] = []
    size = 0
    for r in sorted(reads, key=lambda r: (r.loc.segment, r.loc.offset)):
        last = runs[-1][-1].loc if runs else None
        if (last is None or last.segment != r.loc.segment or len(runs[-1]) >= 300
                or last.offset + last.head.size != r.loc.offset
                or size + r.loc.head.size > RUN_BYTES):
            runs.append([])
            size = 0
        runs[-1].append(r)
        size += r.loc.head.size
    return runs


def _batches(items: list[T], sizes: list[int], least_bytes: int, most: int) -> list[list[T]]:
    """``items`` split, in order, into at most ``most`` runs of about equal bytes, each of about
    ``least_bytes`` or more (one run if they add up to less)."""
    total = sum(sizes)
    count = max(1, min(most, len(items), total // least_bytes))
    runs: list[list[T]] = [[] for _ in range(count)]
    seen = 0
    for item, size in zip(items, sizes):
        runs[min(count - 1, seen * count // max(total, 1))].append(item)
        seen += size
    return [run for run in runs if run]
