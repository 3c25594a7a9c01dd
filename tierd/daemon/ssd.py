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
competing with it (and SSD numbers stay honest).

I/O runs in a ``ThreadPoolExecutor`` (``os.pwritev``/``os.preadv`` straight from and into the
caller's memoryview, no copy), never on the event loop. Measured on the project machines: one file
per block read by 8 threads ~1.6-1.8 GB/s (about raw disk); ``aiofiles`` (also a thread pool, plus
a copy through a bytes object) 0.4-1.2 GB/s.

Not thread-safe: call it from one thread (the daemon's event loop); only file I/O is offloaded.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tierd.daemon.layout import NAMESPACE_LEN
from tierd.daemon.ssdrecord import (
    FLAG_LZ4,
    HASH_LENS,
    HEADER_BYTES,
    RECORD_SUFFIX,
    TMP_SUFFIX,
    Compression,
    RecordHeader,
    read_record,
    record_name,
    write_record,
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
        key = (namespace, block_hash)
        _check_key(namespace, block_hash)
        if len(payload) == 0:
            raise ValueError("an SSD record needs a non-empty payload")
        existing = self._index.get(key)
        if existing is not None:
            return _entry(existing)
        bound = self.record_bytes(len(payload))
        if (self._pool is None or key in self._pending
                or self.used_bytes + self._reserved + bound > self.capacity_bytes):
            return None
        name = record_name(namespace, block_hash)
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".{name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        assert self._dir_fd is not None, "open store without a directory fd"
        self._pending[key] = False
        self._reserved += bound
        done = asyncio.get_running_loop().run_in_executor(
            self._pool, write_record, final, tmp, self._dir_fd, namespace, block_hash, payload,
            checksum, self.compression)
        try:
            result: int | None = await asyncio.shield(done)
        except asyncio.CancelledError:  # the thread still finishes: settle and drop it then
            done.add_done_callback(lambda fut: self._abandon(key, bound, final, fut))
            raise
        except OSError as exc:
            self._note_write_error(f"write of {name}", exc)
            result = None
        removed = self._settle(key, bound)
        if result is None:
            return None
        if result == -1:
            self.checksum_failures += 1
            _log.warning("SSD write of %s refused: payload does not match its checksum", name)
            return None
        if removed:
            self._unlink(final)
            return None
        stored_len = result - HEADER_BYTES
        flags = FLAG_LZ4 if stored_len < len(payload) else 0
        head = self._index[key] = RecordHeader(flags, namespace, block_hash, len(payload),
                                               stored_len, checksum)
        self.used_bytes += result
        if not self.healthy:
            _log.warning("SSD tier %s healthy again after a successful write", self.directory)
            self.healthy = True
        return _entry(head)

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
        key = (namespace, block_hash)
        head = self._index.get(key)
        if head is None or self._pool is None:
            return False
        if len(into) != head.payload_len:
            raise ValueError(f"read target of {len(into)} bytes for a block of "
                             f"{head.payload_len}: pass a view of exactly one slot")
        path = os.path.join(self.directory, record_name(namespace, block_hash))
        loop = asyncio.get_running_loop()
        fault = await loop.run_in_executor(self._pool, read_record, path, head, into)
        if fault is None:
            return True
        if self._index.get(key) is head:  # not removed or replaced meanwhile
            del self._index[key]
            self.used_bytes -= HEADER_BYTES + head.stored_len
            self.checksum_failures += 1
            self._unlink(path)
            _log.warning("SSD record %s dropped: %s", path, fault)
        return False

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

    def _settle(self, key: _Key, bound: int) -> bool:
        """End a write's reservation; whether the block was removed while it was written."""
        self._reserved -= bound
        return self._pending.pop(key)

    def _abandon(self, key: _Key, bound: int, final: str,
                 done: asyncio.Future[int]) -> None:
        """A cancelled write's thread finished: settle it and delete what it wrote."""
        self._settle(key, bound)
        if not done.cancelled() and done.exception() is None and done.result() > 0:
            self._unlink(final)

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


def _check_key(namespace: Namespace, block_hash: BlockHash) -> None:
    if len(namespace) != NAMESPACE_LEN or len(block_hash) not in HASH_LENS:
        raise ValueError(f"namespace must be {NAMESPACE_LEN} bytes and block hash 16 or 32 bytes, "
                         f"got {len(namespace)} and {len(block_hash)}")

