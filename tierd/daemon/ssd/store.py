"""The SSD (cold) tier: append-only segment files in a directory with a byte bound, behind one
asynchronous facade, ``SsdStore``, which runs the file I/O on threads and settles its outcomes.

Records are in ``record``, segment files and their blocking I/O in ``segment``, the in-memory
index in ``index``. ``write_many`` appends a batch with one vectored write and one
``fdatasync`` on a single writer thread; ``read_many`` reads each run of adjacent records with
one ``preadv`` straight into the targets. Removal marks a record dead (``used_bytes``, what
counts against the bound, is the live bytes); a segment with no live record is unlinked, and
``compact`` re-appends the live records of the segments with the most garbage once it passes
``garbage_fraction``, so on disk ``physical bytes <= full bound * (1 + garbage_fraction) +
2 * segment_bytes`` (``bound`` turns a ``footprint_bytes`` into that capacity). ``ENOSPC`` or
``EDQUOT`` lowers the effective bound (``capacity_bytes``) instead of failing the store.

Not thread-safe: call it from one thread (the daemon's event loop); only file I/O is offloaded.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierd.daemon.ssd.bound import Bound, segment_for
from tierd.daemon.ssd.index import (
    READ_BATCH_BYTES,
    Key,
    Loc,
    Read,
    Segment,
    SegmentTable,
    batches,
    runs,
)
from tierd.daemon.ssd.index import RecordSpan as RecordSpan
from tierd.daemon.ssd.index import SsdEntry as SsdEntry
from tierd.daemon.ssd.rawdisk import o_direct_supported
from tierd.daemon.ssd.record import Compression, check_key, footprint
from tierd.daemon.ssd.segment import AppendJob, Placed, SegmentWriter, WriterReport, read_runs
from tierd.daemon.ssd.statefile import PRIVATE_DIR, tighten
from tierd.types import BlockHash, Namespace

_log = logging.getLogger(__name__)


class SsdStore:
    """A directory with a byte bound, of append-only segments of crash-safe records (each with
    its checksummed header and payload checksum: ``record``). Reads and writes run in threads
    and never block the event loop. The store does not choose what to evict: the caller frees
    room (remove) before writing.

    Counters: ``checksum_failures`` (records found corrupt or mismatched on read or copy; each is
    dropped from the index), ``write_errors`` (OSErrors from the disk; each also sets ``healthy
    = False`` until a later write succeeds, except ``no_space_errors``: ``ENOSPC`` or ``EDQUOT``,
    which lower the effective bound instead), ``torn_bytes`` (torn tails cut off at ``open``),
    ``damaged_bytes`` (damage skipped at ``open``, kept as garbage), ``skipped_files`` (names like a
    segment's that ``open`` did not trust, left untouched). A directory that cannot be opened
    leaves the store unhealthy and inert.
    """

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int | None = None, *,
                 footprint_bytes: int | None = None, compression: Compression = "off",
                 io_threads: int = 32, segment_bytes: int = 64 << 20,
                 garbage_fraction: float = 0.25, direct_io: bool = True) -> None:
        """No I/O until ``open``. The bound is either ``capacity_bytes`` (live records) or
        ``footprint_bytes`` (the files, compaction headroom included: ``tierd serve``'s
        ``ssd_bytes``; the segment size is then capped at a sixteenth of it). ValueError unless
        exactly one is given, on a bound or segment size <= 0, an unknown compression,
        ``io_threads`` < 1 or ``garbage_fraction`` outside (0, 1]."""
        if (capacity_bytes is None) == (footprint_bytes is None):
            raise ValueError("give the SSD bound as capacity_bytes (live records) or as "
                             "footprint_bytes (the files), not both or neither")
        bound = capacity_bytes if capacity_bytes is not None else footprint_bytes
        if bound is None or bound <= 0 or segment_bytes <= 0:
            raise ValueError(f"SSD bound and segment size must be > 0 bytes, got "
                             f"{bound} and {segment_bytes}")
        if compression not in ("off", "lz4", "auto"):
            raise ValueError(f"compression must be 'off', 'lz4' or 'auto', got {compression!r}")
        if io_threads < 1 or not 0 < garbage_fraction <= 1:
            raise ValueError(f"need io_threads >= 1 and 0 < garbage_fraction <= 1, got "
                             f"{io_threads} and {garbage_fraction}")
        self.directory = Path(directory)
        if footprint_bytes is not None:
            segment_bytes = segment_for(footprint_bytes, segment_bytes)
        self.segment_bytes, self.garbage_fraction = segment_bytes, garbage_fraction
        self._bound = Bound(segment_bytes, garbage_fraction, capacity_bytes, footprint_bytes)
        self.compression: Compression = compression
        self.healthy = False
        self.checksum_failures = self.write_errors = self.torn_bytes = 0
        self.damaged_bytes = self.skipped_files = self.no_space_errors = 0
        self._io_threads, self._direct_io = io_threads, direct_io
        self._table = SegmentTable(self.directory)
        self._pending: dict[Key, bool] = {}  # key -> removed meanwhile
        self._reserved = 0  # record_bytes of writes in flight
        self._dir_fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None  # reads
        self._wpool: ThreadPoolExecutor | None = None  # the writer: appends and copies, in order
        self._writer: SegmentWriter | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def open(self) -> list[SsdEntry]:
        """Create the directory if needed, lock it (one daemon per directory) and rebuild the
        index by scanning every segment's headers in order. Blocks for one small read per record.
        Files of the former one-file-per-block format (named as tierd named them:
        ``<namespace hex>-<hash hex>.kvb`` and ``.<that>.<8 hex>.tmp``) are deleted, with one
        warning naming their count and bytes: the cache starts without them. Other files are
        never touched.

        Only regular files with one link owned by the daemon are opened; anything else named
        like a segment is skipped with a warning and never touched (``scan``). A header that
        does not verify, or a record that runs past the file, is damage: the scan resumes at the
        next header that verifies, losing only the damaged bytes (``damaged_bytes``). After the
        last header that verifies, the newest segment's tail (a torn batch from a crash) is cut
        off (``torn_bytes``); a sealed segment is never truncated. A key found twice keeps its
        later record. Payload checksums are verified on read, not here. Returns the entries
        oldest first (append order: a fair starting LRU order). If the directory is unusable
        (not creatable, not a directory, locked by another daemon, a disk error during the
        scan): logs a warning, leaves ``healthy`` False and returns []. ``used_bytes`` may
        exceed the bound if it shrank since the last run; the caller removes entries until it
        fits. Warns once if the filesystem cannot hold ``footprint_bytes``.
        """
        if self._dir_fd is not None:
            raise ValueError(f"SSD store {self.directory} is already open")
        try:
            self.directory.mkdir(PRIVATE_DIR, parents=True, exist_ok=True)
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
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
        self._make_private()
        direct = self._direct_io and o_direct_supported(self.directory)
        try:
            loaded = self._table.load(direct)
        except OSError as exc:
            self.close()
            _log.warning("SSD tier disabled, scanning %s failed: %s", self.directory, exc)
            return []
        self.torn_bytes += loaded.torn_bytes
        self.damaged_bytes += loaded.damaged_bytes
        self.skipped_files += loaded.skipped
        entries = self._table.entries()
        self._bound.saw_record(max((e.stored_bytes for e in entries), default=0))
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="tierd-ssd")
        self._wpool = ThreadPoolExecutor(1, thread_name_prefix="tierd-ssd-writer")
        self._writer = SegmentWriter(str(self.directory), dir_fd, self.segment_bytes,
                                     self._table.sealed_below, direct)
        self.healthy = True
        _log.info("SSD tier %s: %d records, %d bytes of %d in %d segments (%d on disk); cut %d "
                  "torn bytes, skipped %d damaged bytes and %d untrusted files", self.directory,
                  len(self._table.records), self.used_bytes, self.capacity_bytes,
                  len(self._table.segments), self.physical_bytes, self.torn_bytes,
                  self.damaged_bytes, self.skipped_files)
        self._warn_if_filesystem_small()
        return entries

    def state_directory(self) -> int | None:
        """The directory's descriptor while this store holds its lock (from a successful
        ``open`` to ``close``), for the daemon's own state files (``statefile``); None
        otherwise: a daemon locked out writes nothing there. The caller must not close it and
        must be done with it before ``close``."""
        return self._dir_fd

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
        self._table.close()
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
    def capacity_bytes(self) -> int:
        """The effective bound of the live records: the full bound, or less while a full disk
        holds it down. The caller evicts to fit under it before writing."""
        return self._bound.capacity

    @property
    def full_bytes(self) -> int:
        """The bound of the live records when the disk has room (``capacity_bytes`` returns to
        it)."""
        return self._bound.full

    @property
    def footprint_bytes(self) -> int:
        """The most bytes the segment files take at the full bound (see ``bound``)."""
        return self._bound.footprint

    @property
    def used_bytes(self) -> int:
        """Bytes of the live (indexed) records: what counts against the bound."""
        return self._table.used_bytes

    @property
    def physical_bytes(self) -> int:
        """Bytes of the segment files: live records plus garbage."""
        return self._table.physical_bytes

    def contains(self, namespace: Namespace, block_hash: BlockHash) -> bool:
        """Whether an acknowledged record of the block is indexed (not yet verified)."""
        return (namespace, block_hash) in self._table.records

    def entry(self, namespace: Namespace, block_hash: BlockHash) -> SsdEntry | None:
        """The indexed entry of the block, or None."""
        return self._table.entry((namespace, block_hash))

    def locate(self, namespace: Namespace, block_hash: BlockHash) -> RecordSpan | None:
        """Where the block's record lies on disk, or None."""
        return self._table.locate((namespace, block_hash))

    def __len__(self) -> int:
        return len(self._table.records)

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
        being written; or the disk failed (``write_errors``; for want of space the bound is
        lowered, else ``healthy`` is False; a warning either way). First, a bound lowered by a
        full disk grows back as far as the filesystem has room. ValueError (nothing written) on
        a bad key or an empty payload."""
        for namespace, block_hash, payload, _ in blocks:
            check_key(namespace, block_hash)
            if len(payload) == 0:
                raise ValueError("an SSD record needs a non-empty payload")
        self._regrow()
        results: list[SsdEntry | None] = [None] * len(blocks)
        writes: list[tuple[int, Key, int]] = []  # (index in blocks, key, bytes reserved)
        for i, (namespace, block_hash, payload, _) in enumerate(blocks):
            key = (namespace, block_hash)
            results[i] = self._table.entry(key)
            if results[i] is not None:
                continue
            bound = self.record_bytes(len(payload))
            self._bound.saw_record(bound)
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
        self._table.reap_all()
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
        ``preadv`` each, the runs shared among at most ``io_threads`` tasks of about
        ``READ_BATCH_BYTES``. ValueError, nothing started, if a target's length differs from
        its block's payload length. Every target stays written to until its future resolves,
        even if the future is cancelled."""
        loop = asyncio.get_running_loop()
        records = self._table.records
        locs = [records.get((namespace, block_hash)) for namespace, block_hash, _ in requests]
        for (_, _, into), loc in zip(requests, locs):
            if loc is not None and len(into) != loc.head.payload_len:
                raise ValueError(f"read target of {len(into)} bytes for a block of "
                                 f"{loc.head.payload_len}: pass a view of exactly one slot")
        futures = [loop.create_future() for _ in requests]
        reads: list[Read] = []
        for (namespace, block_hash, into), loc, future in zip(requests, locs, futures):
            if loc is None or self._pool is None:
                future.set_result(False)
            else:
                reads.append(Read((namespace, block_hash), loc, into, future))
        grouped = runs(reads)
        for task in batches(grouped, [sum(r.loc.head.size for r in run) for run in grouped],
                            READ_BATCH_BYTES, self._io_threads):
            for run in task:
                self._table.pin(run[0].loc.segment)
            done = loop.run_in_executor(self._pool, read_runs,
                                        [self._table.source(run) for run in task],
                                        [[r.into for r in run] for run in task])
            done.add_done_callback(functools.partial(self._settle_reads, task))
        return futures

    def remove(self, namespace: Namespace, block_hash: BlockHash) -> None:
        """Mark the block's record dead and free its bytes from ``used_bytes`` at once (its
        segment is unlinked when all its records are dead, else compacted later). No-op if
        absent; a write in flight for it is discarded when it completes. A removed record may
        come back after a crash and restart (its content is still that block's)."""
        key = (namespace, block_hash)
        if key in self._pending:
            self._pending[key] = True
        self._table.discard(key)

    async def compact(self) -> int:
        """If the sealed segments' garbage passes ``garbage_fraction`` of the full bound: copy
        the live records of those with the most garbage to the current segment (on the writer
        thread; reads of a moved record started earlier still read its old copy, whose segment
        stays open until they finish) and unlink them, until the garbage is at most half that.
        Segments are copied in groups of at most a segment's live bytes, each group unlinked
        before the next is copied, so the copies never take more than a segment of room.
        Returns the garbage bytes freed."""
        if self._writer is None:
            return 0
        victims = self._table.pick_victims(self.garbage_fraction * self._bound.full)
        groups = _groups(victims, self.segment_bytes)
        freed = 0
        try:
            while groups:
                freed += await self._compact_group(groups.pop(0))
        finally:
            for group in groups:  # not started (cancelled, or the copy before it failed)
                self._table.release_victims(group)
                for v in group:
                    self._table.reap(v)
        if victims:
            _log.info("SSD tier %s compacted %d segments, %d garbage bytes freed",
                      self.directory, len(victims), freed)
        return freed

    async def _compact_group(self, victims: list[Segment]) -> int:
        """Copy one group of victims' live records and settle it; the garbage bytes freed."""
        assert self._writer is not None, "the store was closed during compaction"
        moves = self._table.in_segments({v.id for v in victims})
        copies = runs([Read(k, loc, memoryview(b""), None) for k, loc in moves])
        done = self._submit(functools.partial(self._writer.copy, [
            self._table.source(run) for run in copies]))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:  # the copy still finishes: settle it then
            done.add_done_callback(lambda _: self._compacted(victims, moves, done))
            raise
        return self._compacted(victims, moves, done)

    def _compacted(self, victims: list[Segment], moves: list[tuple[Key, Loc]],
                   done: asyncio.Future[WriterReport]) -> int:
        """A compaction's copy finished: move the index entries, unlink the victims."""
        self._table.release_victims(victims)
        if done.cancelled() or done.exception() is not None:
            for v in victims:
                self._table.reap(v)
            return 0
        report = done.result()
        freed = sum(v.size - v.live for v in victims)
        self._absorb(report)
        for (key, loc), result in zip(moves, report.results):
            if self._table.records.get(key) is not loc:
                continue  # removed meanwhile: the copy, if any, is garbage
            if isinstance(result, Placed):
                self._table.move(key, loc, result)
            elif isinstance(result, str):
                self._corrupt(key, result)
            elif isinstance(result, OSError):
                self._note_write_error("compaction", result)
        self._table.reap_all()
        return freed

    def check_integrity(self, *, disk: bool = False) -> None:
        """Assert the byte accounting equals the sum of the entries, per segment and in all, and
        records lie inside their segments without overlapping; with ``disk`` also that the
        directory holds exactly the known segments at their recorded sizes (call it with no
        write in flight)."""
        assert self._reserved >= 0, f"negative reservation {self._reserved}"
        self._bound.check_integrity()
        self._table.check_integrity(disk=disk and self._dir_fd is not None)

    # -- internals -----------------------------------------------------------------------------

    def _submit(self, job: Callable[[], WriterReport]) -> asyncio.Future[WriterReport]:
        """Run a writer job on the writer thread, after those submitted before it."""
        assert self._wpool is not None, "store not open"
        return asyncio.get_running_loop().run_in_executor(self._wpool, job)

    def _absorb(self, report: WriterReport) -> None:
        """Take in a writer job's segments; one that cannot be opened counts as a write error."""
        direct = self._writer is not None and self._writer.direct
        for path, exc in self._table.absorb(report, direct):
            self._note_write_error(f"open of {path}", exc)

    def _written(self, key: Key, bound: int, result: Placed | int | OSError | str
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
        if removed or self._table.add(key, result) is None:
            return None
        if not self.healthy:
            _log.warning("SSD tier %s healthy again after a successful write", self.directory)
            self.healthy = True
        return self._table.entry(key)

    def _abandon(self, writes: list[tuple[int, Key, int]],
                 done: asyncio.Future[WriterReport]) -> None:
        """A cancelled or failed ``write_many``'s writer job finished: end its reservations;
        what it wrote is garbage."""
        self._unreserve(writes)
        if not done.cancelled() and done.exception() is None:
            self._absorb(done.result())
            self._table.reap_all()

    def _regrow(self) -> None:
        """Before a write: raise a bound lowered by a full disk as the filesystem has room."""
        if self._bound.lowered is None or self._dir_fd is None:
            return
        try:
            st = os.fstatvfs(self._dir_fd)
        except OSError:
            return
        if self._bound.regrow(self.used_bytes, st.f_bavail * st.f_frsize):
            _log.warning("SSD tier %s: the disk has room again, bound back to %d bytes",
                         self.directory, self.capacity_bytes)

    def _make_private(self) -> None:
        """At ``open``: take group and other access off the directory, with one warning saying
        what changed (segments are made 0600 by the scan)."""
        assert self._dir_fd is not None
        try:
            was = tighten(self._dir_fd)
        except OSError as exc:
            _log.warning("SSD tier %s: cannot make the directory private (%s): other local "
                         "users may read the cached KV; chmod 700 it", self.directory, exc)
            return
        if was is not None:
            _log.warning("SSD tier %s: directory mode %04o changed to %04o (it holds every "
                         "tenant's KV)", self.directory, was, was & ~0o077)

    def _warn_if_filesystem_small(self) -> None:
        """One warning at ``open`` if the filesystem cannot hold the footprint of the bound."""
        assert self._dir_fd is not None
        try:
            st = os.fstatvfs(self._dir_fd)
        except OSError:
            return
        room = st.f_bavail * st.f_frsize + self.physical_bytes
        if room < self.footprint_bytes:
            _log.warning("SSD tier %s: the filesystem has room for %d bytes (free plus this "
                         "tier's files), less than the %d its bound needs: set ssd_bytes to at "
                         "most %d or free space there (until then a full disk lowers the bound)",
                         self.directory, room, self.footprint_bytes, room)

    def _unreserve(self, writes: list[tuple[int, Key, int]]) -> None:
        for _, key, bound in writes:
            self._reserved -= bound
            self._pending.pop(key)

    def _settle_reads(self, task: list[list[Read]],
                      done: asyncio.Future[list[list[str | None]]]) -> None:
        """A read task finished: drop the records that failed, resolve every future."""
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        for k, run in enumerate(task):
            faults = [None] * len(run) if error is not None else done.result()[k]
            for r, fault in zip(run, faults):
                if fault is not None and self._table.records.get(r.key) is r.loc:
                    self._corrupt(r.key, fault)
                assert r.future is not None, "a read without a future"
                if r.future.done():
                    continue
                if error is not None:
                    r.future.set_exception(error)
                else:
                    r.future.set_result(fault is None)
            self._table.unpin(run[0].loc.segment)

    def _corrupt(self, key: Key, fault: str) -> None:
        self._table.discard(key)
        self.checksum_failures += 1
        _log.warning("SSD record %s-%s dropped: %s", key[0].hex(), key[1].hex(), fault)

    def _note_write_error(self, what: str, exc: OSError) -> None:
        """Count a failed write. No space (``ENOSPC``, ``EDQUOT``): lower the bound, one warning
        per lowering, the store stays healthy; anything else: unhealthy until a write works."""
        self.write_errors += 1
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.no_space_errors += 1
            before = self.capacity_bytes
            if self._bound.disk_full(self.used_bytes):
                _log.warning("SSD tier %s: the disk is full (%s failed: %s): bound lowered from "
                             "%d to %d bytes, evicting to fit; it grows back as the filesystem "
                             "has room (free space there, or lower ssd_bytes)", self.directory,
                             what, exc.strerror, before, self.capacity_bytes)
            return
        if self.healthy:
            _log.warning("SSD tier %s unhealthy (serving DRAM only until a write succeeds): "
                         "%s failed: %s", self.directory, what, exc)
        self.healthy = False


def _groups(victims: list[Segment], most_bytes: int) -> list[list[Segment]]:
    """``victims`` in order, in groups of at most ``most_bytes`` live bytes (at least one each)."""
    groups: list[list[Segment]] = []
    size = 0
    for v in victims:
        if not groups or size + v.live > most_bytes:
            groups.append([])
            size = 0
        groups[-1].append(v)
        size += v.live
    return groups
