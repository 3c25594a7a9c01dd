"""The SSD (cold) tier: one crash-safe file per block in a directory with a byte bound.

Records (header layout, write and read paths) are in ``tierd.daemon.ssdrecord``. A write goes to
``.<name>.<random>.tmp``, is renamed into place, then the file is fdatasync'ed and the directory
fsync'ed before the write is acknowledged, so an acknowledged block survives ``kill -9`` and a
power cut. A crash mid-write leaves a ``.tmp`` file (``open`` deletes it) or, before the syncs, a
torn record that the header checksum and size check at ``open`` or the payload checksum at
``read`` drops. One file per block rather than append-only segments because the tier's unit of
eviction is one block: removal is an ``unlink`` that frees its bytes at once, with no compaction
pass and no segment index to persist, and a torn write cannot damage its neighbours.

After a write or a read the file's pages are dropped from the page cache (``POSIX_FADV_DONTNEED``):
the shared-memory arena is the DRAM tier; the page cache must not become a second, unbounded one
competing with it (and SSD numbers stay honest). A read batch holds at most its read-ahead window
(``ssdrecord.PREFETCH_BYTES``) in the page cache at a time.

I/O runs in a ``ThreadPoolExecutor`` (``os.pwritev``/``os.preadv`` straight from and into the
caller's memoryview, no copy in Python), never on the event loop, in batches: ``read_many`` and
``write_many`` hand a few tasks to the pool, not one per block. Per-block tasks were the cost of
small blocks: 128 reads of 64 KiB as 128 tasks took 19-24 ms on 2 shared cores (thread hand-offs,
GIL handovers, a queue only as deep as the thread count), as 4 batches that ask the kernel to
read ahead 8-10 ms, against 4-5 ms of raw sequential disk for the same bytes. Writes share one
directory sync per batch.

Not thread-safe: call it from one thread (the daemon's event loop); only file I/O is offloaded.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tierd.daemon.layout import NAMESPACE_LEN
from tierd.daemon.ssdrecord import (
    FLAG_LZ4,
    HASH_LENS,
    HEADER_BYTES,
    RECORD_SUFFIX,
    TMP_SUFFIX,
    Compression,
    RecordHeader,
    WriteJob,
    read_records,
    record_name,
    write_records,
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
    stored_bytes: int  # bytes on disk (file size), header included: what counts against the bound
    checksum: int  # block_checksum of the uncompressed payload


def _entry(head: RecordHeader) -> SsdEntry:
    return SsdEntry(head.namespace, head.block_hash, head.payload_len,
                    HEADER_BYTES + head.stored_len, head.checksum)


class SsdStore:
    """A directory with a byte bound. One record per block, crash safe (temporary name, fsync,
    rename), header: magic, version, namespace, hash, payload length, compression flag, checksum.
    Reads and writes run in a thread pool and never block the event loop. The store does not
    choose what to evict: the caller frees room (remove) before writing.

    Counters: ``checksum_failures`` (records found corrupt, truncated, mismatched or missing, on
    read or by ``open``; each is deleted), ``write_errors`` (OSErrors from the disk; each also sets
    ``healthy = False`` until a later write succeeds). A directory that cannot be opened leaves
    the store unhealthy and inert: writes return None, reads False.
    """

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, *,
                 compression: Compression = "off", io_threads: int = 8) -> None:
        """No I/O until ``open``. ValueError on a bound <= 0, an unknown compression or
        ``io_threads`` < 1."""
        if capacity_bytes <= 0:
            raise ValueError(f"SSD capacity must be > 0 bytes, got {capacity_bytes}")
        if compression not in ("off", "lz4", "auto"):
            raise ValueError(f"compression must be 'off', 'lz4' or 'auto', got {compression!r}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.compression: Compression = compression
        self.used_bytes = 0
        self.healthy = False
        self.checksum_failures = 0
        self.write_errors = 0
        self._io_threads = io_threads
        self._index: dict[_Key, RecordHeader] = {}  # what each record must say
        self._pending: dict[_Key, bool] = {}  # key -> removed meanwhile
        self._reserved = 0  # record_bytes of writes in flight
        self._dir_fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def open(self) -> list[SsdEntry]:
        """Create the directory if needed, lock it (one daemon per directory) and rebuild the
        index from the records on disk. Blocks for one small read per record.

        Temporary files of torn writes are deleted; records with a bad header, a size that
        disagrees with it, or a name that disagrees with it are deleted and counted in
        ``checksum_failures``. Payload checksums are verified on read, not here. Returns the
        intact entries oldest first (by modification time: a fair starting LRU order). If the
        directory is unusable (not creatable, not a directory, locked by another daemon): logs a
        warning, leaves ``healthy`` False and returns []. ``used_bytes`` may exceed the bound
        if it shrank since the last run; the caller removes entries until it fits.
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
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="tierd-ssd")
        found: list[tuple[int, RecordHeader]] = []
        dropped = torn = 0
        with os.scandir(self.directory) as it:
            for dirent in it:
                if dirent.name.endswith(TMP_SUFFIX) and dirent.is_file(follow_symlinks=False):
                    torn += self._unlink(dirent.path)
                elif dirent.name.endswith(RECORD_SUFFIX) and dirent.is_file(follow_symlinks=False):
                    head = self._scan_record(dirent)
                    if head is None:
                        dropped += self._unlink(dirent.path)
                    else:
                        found.append((dirent.stat().st_mtime_ns, head))
        found.sort(key=lambda pair: pair[0])
        for _, head in found:
            self._index[(head.namespace, head.block_hash)] = head
            self.used_bytes += HEADER_BYTES + head.stored_len
        self.checksum_failures += dropped
        self.healthy = True
        _log.info("SSD tier %s: %d records, %d bytes of %d; dropped %d corrupt, %d torn",
                  self.directory, len(found), self.used_bytes, self.capacity_bytes, dropped, torn)
        return [_entry(head) for _, head in found]

    def close(self) -> None:
        """Wait for I/O in flight, release the directory lock. Idempotent. Every acknowledged
        write is already durable; nothing is flushed here."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        self.healthy = False

    # -- queries -------------------------------------------------------------------------------

    def record_bytes(self, payload_len: int) -> int:
        """Upper bound of ``stored_bytes`` for a block of ``payload_len`` bytes (compression is
        only kept when it is smaller)."""
        return HEADER_BYTES + payload_len

    def contains(self, namespace: Namespace, block_hash: BlockHash) -> bool:
        """Whether an acknowledged record of the block is indexed (not yet verified)."""
        return (namespace, block_hash) in self._index

    def entry(self, namespace: Namespace, block_hash: BlockHash) -> SsdEntry | None:
        """The indexed entry of the block, or None."""
        head = self._index.get((namespace, block_hash))
        return _entry(head) if head else None

    def __len__(self) -> int:
        return len(self._index)

    # -- I/O -----------------------------------------------------------------------------------

    async def write(self, namespace: Namespace, block_hash: BlockHash, payload: memoryview,
                    checksum: int) -> SsdEntry | None:
        """Store one block durably; the entry once the record is on disk and indexed.

        Runs in the I/O pool; ``payload`` must stay unchanged until this returns (the caller
        keeps the DRAM slot pinned). Returns the existing entry if the block is already stored.
        None, never raising, when: ``block_checksum(payload) != checksum`` (counted in
        ``checksum_failures``: the DRAM copy is bad); the record would pass the bound (free room
        with ``remove`` first); the same block is being written now; the store is not open; it
        was removed while being written; or the disk failed (``healthy`` False, warning logged,
        ``write_errors`` counted). ValueError on a namespace or hash of the wrong length.
        """
        return (await self.write_many([(namespace, block_hash, payload, checksum)]))[0]

    async def write_many(self, blocks: Sequence[tuple[Namespace, BlockHash, memoryview, int]]
                         ) -> list[SsdEntry | None]:
        """``write`` of several blocks (namespace, hash, payload, checksum) at once: one entry or
        None each, in order, on the same terms. The blocks are split, in order, into batches of
        about ``WRITE_BATCH_BYTES`` (a large block is a batch of its own); each batch is one task
        in the I/O pool that syncs the directory once for all its records (group commit). Every
        payload stays unchanged until this returns. ValueError (nothing written) on a bad key
        or an empty payload. A block later in the list than a copy of itself gets None."""
        for namespace, block_hash, payload, _ in blocks:
            _check_key(namespace, block_hash)
            if len(payload) == 0:
                raise ValueError("an SSD record needs a non-empty payload")
        results: list[SsdEntry | None] = [None] * len(blocks)
        writes: list[_Write] = []
        for i, (namespace, block_hash, payload, checksum) in enumerate(blocks):
            key = (namespace, block_hash)
            existing = self._index.get(key)
            if existing is not None:
                results[i] = _entry(existing)
                continue
            bound = self.record_bytes(len(payload))
            if (self._pool is None or key in self._pending
                    or self.used_bytes + self._reserved + bound > self.capacity_bytes):
                continue
            name = record_name(namespace, block_hash)
            tmp = f".{name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
            job = WriteJob(os.path.join(self.directory, name), os.path.join(self.directory, tmp),
                           namespace, block_hash, payload, checksum)
            self._pending[key] = False
            self._reserved += bound
            writes.append(_Write(i, key, bound, job))
        if not writes:
            return results
        assert self._pool is not None and self._dir_fd is not None, "open store without a pool"
        loop = asyncio.get_running_loop()
        batches = _batches(writes, [w.bound for w in writes], WRITE_BATCH_BYTES, len(writes))
        done = asyncio.gather(*(loop.run_in_executor(
            self._pool, write_records, [w.job for w in batch], self._dir_fd, self.compression)
            for batch in batches), return_exceptions=True)
        try:
            outcomes: list[list[int | OSError] | BaseException] = await asyncio.shield(done)
        except asyncio.CancelledError:  # the threads still finish: settle and drop them then
            done.add_done_callback(lambda _: self._abandon(batches, done))
            raise
        unexpected: BaseException | None = None
        for batch, outcome in zip(batches, outcomes):
            for w, result in zip(batch, _per_job(outcome, len(batch))):
                if not isinstance(result, OSError) and isinstance(result, BaseException):
                    unexpected = result  # a bug, not the disk: raised once all are settled
                    result = OSError(repr(result))
                results[w.index] = self._written(w, result, len(w.job.payload))
        if unexpected is not None:
            raise unexpected
        return results

    async def read(self, namespace: Namespace, block_hash: BlockHash, into: memoryview) -> bool:
        """Copy one block into ``into`` (exactly its payload length; e.g. a DRAM slot) and verify
        it. Runs in the I/O pool; ``into`` must stay reserved for it until this returns.

        True only if the record exists, is intact and its checksum verifies. A record that is
        corrupt, truncated, missing or names another block is deleted, counted in
        ``checksum_failures``, and the read returns False (a miss; ``into`` holds garbage).
        ValueError if ``len(into)`` differs from the block's payload length. If the caller is
        cancelled, the copy into ``into`` still completes on its thread: keep the slot reserved
        until the store is closed, or do not cancel reads.
        """
        return await self.read_many([(namespace, block_hash, into)])[0]

    def read_many(self, requests: Sequence[tuple[Namespace, BlockHash, memoryview]]
                  ) -> list[asyncio.Future[bool]]:
        """Start ``read`` of several blocks (namespace, hash, target); one future each, in
        order, resolving to ``read``'s outcome when the batch holding it is done (a block not
        indexed resolves False at once). Call it on the event loop's thread.

        The requests are split, in order, into at most ``io_threads`` batches of about
        ``READ_BATCH_BYTES`` or more; each batch is one task in the I/O pool that reads its records
        with the kernel fetching ahead (``read_records``). A 128-block prefix thus costs a few
        thread hand-offs instead of 128, and the disk sees a deep queue. ValueError, nothing
        started, if a target's length differs from its block's payload length. Every target
        stays written to until its future resolves, even if the future is cancelled.
        """
        loop = asyncio.get_running_loop()
        reads: list[_Read] = []
        futures: list[asyncio.Future[bool]] = []
        for namespace, block_hash, into in requests:
            head = self._index.get((namespace, block_hash))
            if head is not None and len(into) != head.payload_len:
                raise ValueError(f"read target of {len(into)} bytes for a block of "
                                 f"{head.payload_len}: pass a view of exactly one slot")
        for namespace, block_hash, into in requests:
            future: asyncio.Future[bool] = loop.create_future()
            futures.append(future)
            head = self._index.get((namespace, block_hash))
            if head is None or self._pool is None:
                future.set_result(False)
                continue
            path = os.path.join(self.directory, record_name(namespace, block_hash))
            reads.append(_Read((namespace, block_hash), head, path, into, future))
        for batch in _batches(reads, [HEADER_BYTES + r.head.stored_len for r in reads],
                              READ_BATCH_BYTES, self._io_threads):
            done = loop.run_in_executor(self._pool, read_records, [r.path for r in batch],
                                        [r.head for r in batch], [r.into for r in batch])
            done.add_done_callback(functools.partial(self._settle_reads, batch))
        return futures

    def remove(self, namespace: Namespace, block_hash: BlockHash) -> None:
        """Delete the block's record and free its bytes at once (an ``unlink`` on the calling
        thread). No-op if absent; a write in flight for it is discarded when it completes."""
        key = (namespace, block_hash)
        if key in self._pending:
            self._pending[key] = True
        head = self._index.pop(key, None)
        if head is not None:
            self.used_bytes -= HEADER_BYTES + head.stored_len
            self._unlink(os.path.join(self.directory, record_name(namespace, block_hash)))

    def check_integrity(self, *, disk: bool = False) -> None:
        """Assert the byte accounting equals the sum of the entries; with ``disk`` also that the
        directory holds exactly the indexed records at their recorded sizes and no temporary file
        (call it with no write in flight)."""
        total = sum(HEADER_BYTES + head.stored_len for head in self._index.values())
        assert self.used_bytes == total, f"used_bytes {self.used_bytes} != entries' sum {total}"
        assert self._reserved >= 0, f"negative reservation {self._reserved}"
        for (ns, bh), head in self._index.items():
            assert (head.namespace, head.block_hash) == (ns, bh), f"{head} filed under {bh.hex()}"
            assert 0 < head.stored_len <= head.payload_len, f"{head}: stored bytes out of range"
            assert bool(head.flags & FLAG_LZ4) == (head.stored_len < head.payload_len), (
                f"{head}: compression flag disagrees with its size")
        if not disk or self._dir_fd is None:
            return
        on_disk: dict[str, int] = {}
        with os.scandir(self.directory) as it:
            for d in it:
                assert not d.name.endswith(TMP_SUFFIX) or self._pending, f"stray temp {d.name}"
                if d.name.endswith(RECORD_SUFFIX):
                    on_disk[d.name] = d.stat().st_size
        expected = {record_name(ns, bh): HEADER_BYTES + head.stored_len
                    for (ns, bh), head in self._index.items()}
        assert on_disk == expected, (
            f"disk and index disagree: only on disk {sorted(set(on_disk) - set(expected))}, "
            f"only indexed {sorted(set(expected) - set(on_disk))}, or sizes differ")

    # -- internals -----------------------------------------------------------------------------

    def _written(self, w: _Write, result: int | OSError, payload_len: int) -> SsdEntry | None:
        """Settle one finished write (``write_records``'s result for it): index it or not."""
        removed = self._settle(w.key, w.bound)
        name = os.path.basename(w.job.final)
        if isinstance(result, OSError):
            self._note_write_error(f"write of {name}", result)
            return None
        if result == -1:
            self.checksum_failures += 1
            _log.warning("SSD write of %s refused: payload does not match its checksum", name)
            return None
        if removed:
            self._unlink(w.job.final)
            return None
        stored_len = result - HEADER_BYTES
        flags = FLAG_LZ4 if stored_len < payload_len else 0
        head = self._index[w.key] = RecordHeader(flags, w.key[0], w.key[1], payload_len,
                                                 stored_len, w.job.checksum)
        self.used_bytes += result
        if not self.healthy:
            _log.warning("SSD tier %s healthy again after a successful write", self.directory)
            self.healthy = True
        return _entry(head)

    def _settle(self, key: _Key, bound: int) -> bool:
        """End a write's reservation; whether the block was removed while it was written."""
        self._reserved -= bound
        return self._pending.pop(key)

    def _abandon(self, batches: list[list[_Write]],
                 done: asyncio.Future[list[list[int | OSError] | BaseException]]) -> None:
        """A cancelled ``write_many``'s threads finished: settle them and delete what they
        wrote."""
        outcomes = done.result()
        for batch, outcome in zip(batches, outcomes):
            for w, result in zip(batch, _per_job(outcome, len(batch))):
                self._settle(w.key, w.bound)
                if isinstance(result, int) and result > 0:
                    self._unlink(w.job.final)

    def _settle_reads(self, batch: list[_Read], done: asyncio.Future[list[str | None]]) -> None:
        """A read batch finished: drop the records that failed, resolve every future."""
        if done.cancelled() or done.exception() is not None:
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(done.exception() or asyncio.CancelledError())
            return
        for r, fault in zip(batch, done.result()):
            if fault is not None and self._index.get(r.key) is r.head:  # not replaced meanwhile
                del self._index[r.key]
                self.used_bytes -= HEADER_BYTES + r.head.stored_len
                self.checksum_failures += 1
                self._unlink(r.path)
                _log.warning("SSD record %s dropped: %s", r.path, fault)
            if not r.future.done():
                r.future.set_result(fault is None)

    def _scan_record(self, dirent: os.DirEntry[str]) -> RecordHeader | None:
        """The header of a record found by ``open``, or None if it cannot be trusted."""
        try:
            size = dirent.stat(follow_symlinks=False).st_size
            with open(dirent.path, "rb", buffering=0) as f:
                head = RecordHeader.unpack(f.read(HEADER_BYTES))
        except OSError:
            return None
        if (head is None or size != HEADER_BYTES + head.stored_len
                or dirent.name != record_name(head.namespace, head.block_hash)):
            _log.warning("SSD record %s has a bad header or size; dropping it", dirent.path)
            return None
        return head

    def _unlink(self, path: str) -> int:
        """Delete ``path``: 1 if it was there, 0 if not; an OSError marks the store unhealthy."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            self._note_write_error(f"unlink of {path}", exc)
            return 0
        return 1

    def _note_write_error(self, what: str, exc: OSError) -> None:
        self.write_errors += 1
        if self.healthy:
            _log.warning("SSD tier %s unhealthy (serving DRAM only until a write succeeds): "
                         "%s failed: %s", self.directory, what, exc)
        self.healthy = False


@dataclass(slots=True)
class _Write:
    """A record ``write_many`` is writing, for the block at ``index`` of its list."""

    index: int
    key: _Key
    bound: int  # bytes reserved against the bound until it settles
    job: WriteJob


@dataclass(slots=True)
class _Read:
    """A record ``read_many`` is reading into ``into``; ``future`` gets the outcome."""

    key: _Key
    head: RecordHeader  # what the index expected when the read started
    path: str
    into: memoryview
    future: asyncio.Future[bool]


READ_BATCH_BYTES = 2 << 20
"""Smallest read batch worth its own I/O task (and at most ``io_threads`` of them): a batch reads
ahead, so one thread already keeps the disk busy; each more thread costs a hand-off and GIL
contention (measured on 2 cores: 128 x 64 KiB in 8-10 ms as 4 batches, 19-24 ms as 128 tasks)."""

WRITE_BATCH_BYTES = 1 << 20
"""Write batches hold about this many bytes, as many batches as that makes: small records share
one directory sync (64 KiB: 128 records 1.4-2x faster), large ones each get their own task so
their syncs overlap (2 MiB: batches of 16 were 0.31 of raw disk against 0.52-0.56 alone)."""

T = TypeVar("T")


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


def _per_job(outcome: list[int | OSError] | BaseException, n: int
             ) -> list[int | OSError] | list[BaseException]:
    """One batch's results, one per job (the batch's exception for each if it raised)."""
    return [outcome] * n if isinstance(outcome, BaseException) else outcome


def _check_key(namespace: Namespace, block_hash: BlockHash) -> None:
    if len(namespace) != NAMESPACE_LEN or len(block_hash) not in HASH_LENS:
        raise ValueError(f"namespace must be {NAMESPACE_LEN} bytes and block hash 16 or 32 bytes, "
                         f"got {len(namespace)} and {len(block_hash)}")

