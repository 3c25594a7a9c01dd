"""The SSD tier's in-memory index: which record of each block is live, in which segment at which
offset, and every segment's bytes (``SegmentTable``), with the entries it hands out (``SsdEntry``,
``RecordSpan``, re-exported by ``tierd.daemon.ssd``); plus how reads are grouped into runs and
tasks. ``SsdStore`` (``store``) runs the I/O and keeps this table on the event loop's thread;
segment files and their I/O are in ``segment``.

A segment's ``size`` is its file's bytes (records alive or dead, and any failed batch); its
``live`` bytes are those of its indexed records, and ``used_bytes`` is their sum over all
segments: what counts against the store's bound. A segment is unlinked as soon as it is sealed
(never appended to again) with no live record and no compaction copying it, and its file
descriptors are closed once no read or copy in flight (``busy``) uses them.

Not thread-safe: the store calls it from one thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tierd.daemon.ssd.record import RecordHeader
from tierd.daemon.ssd.scan import Opened, open_trusted, scan_segment
from tierd.daemon.ssd.segment import (
    Placed,
    Source,
    WriterReport,
    open_segment,
    segment_id,
    segment_name,
)
from tierd.types import BlockHash, Namespace

_log = logging.getLogger(__name__)

Key = tuple[Namespace, BlockHash]

_RECORD = r"[0-9a-f]{32}-(?:[0-9a-f]{32}|[0-9a-f]{64})\.kvb"
LEGACY_NAME = re.compile(rf"{_RECORD}|\.{_RECORD}\.[0-9a-f]{{8}}\.tmp")
"""Names of the former one-file-per-block format, deleted at load: a record
``<namespace hex>-<hash hex>.kvb`` and its temporary ``.<record>.<8 hex>.tmp``. Nothing else is
touched, whatever its suffix."""

READ_BATCH_BYTES = 2 << 20
"""About the bytes of one read task (at most ``io_threads`` of them), each on a thread of its own:
one ``preadv`` of a run already gives the disk a deep queue; each more task costs a hand-off
and GIL contention; fewer, larger tasks leave a longer verification after the last byte lands."""

RUN_BYTES = 2 << 20
"""Largest run of adjacent records read with one ``preadv``."""

RUN_RECORDS = 300
"""Most records in a run: up to 3 buffers each (header, payload, padding) within IOV_MAX."""


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


def _entry(head: RecordHeader) -> SsdEntry:
    return SsdEntry(head.namespace, head.block_hash, head.payload_len, head.size, head.checksum)


@dataclass(frozen=True, slots=True)
class Loaded:
    """What ``SegmentTable.load`` found besides the records: bytes cut off as torn tails (newest
    segment only), bytes of damaged spans and tails kept as garbage (records lost to damage),
    and the names skipped as not trusted."""

    torn_bytes: int
    damaged_bytes: int
    skipped: int


@dataclass(frozen=True, slots=True)
class Loc:
    """An indexed record; compared by identity to tell a moved or rewritten record apart."""

    segment: int
    offset: int
    head: RecordHeader


@dataclass(slots=True)
class Segment:
    """One segment file as the index knows it."""

    id: int
    path: str
    fd: int  # read fds, open until the segment is unlinked and no I/O uses them
    dfd: int | None  # O_DIRECT
    size: int = 0  # bytes in the file: records, dead or alive, and any failed batch
    live: int = 0  # bytes of indexed records
    busy: int = 0  # reads and copies in flight on the fds
    compacting: bool = False
    unlinked: bool = False


class SegmentTable:
    """key -> ``Loc`` of its live record, and the segments holding records. Every method runs on
    the caller's thread; only ``load`` and opening a new segment in ``absorb`` do file I/O
    (small, blocking), ``reap`` unlinks and closes files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.records: dict[Key, Loc] = {}
        self.segments: dict[int, Segment] = {}
        self.sealed_below = 0  # segments with smaller ids are never appended to again
        self.used_bytes = 0  # live records' bytes, all segments together
        self.skipped: set[str] = set()  # names like a segment's not trusted at load: never touched

    # -- building ------------------------------------------------------------------------------

    def load(self, direct: bool) -> Loaded:
        """Rebuild from the directory: delete files of the former one-file-per-block format (a
        cache in a format no longer read; one warning with their count and bytes), open the
        trusted segments (``scan``: regular files with one link, ours; anything else skipped and
        left untouched; ids renumbered if near 2^64), scan each one's headers in id order
        (resynchronising past damage; the newest one's torn tail cut off), index its records (a
        key found twice keeps its later record) and unlink segments left with none. Blocks for
        one small read per record. ``direct``: open an ``O_DIRECT`` fd too."""
        self._remove_legacy()
        listing = open_trusted(self.directory, direct)
        self.skipped = listing.skipped
        torn = damaged = 0
        for k, found in enumerate(listing.opened):
            cut, lost = self._load_segment(found, newest=k == len(listing.opened) - 1)
            torn, damaged = torn + cut, damaged + lost
        self.sealed_below = listing.next_id
        self.reap_all()
        return Loaded(torn, damaged, len(listing.skipped))

    def _remove_legacy(self) -> None:
        count = size = 0
        for d in os.scandir(self.directory):
            if LEGACY_NAME.fullmatch(d.name) and d.is_file(follow_symlinks=False):
                nbytes = d.stat(follow_symlinks=False).st_size
                try:
                    os.unlink(d.path)
                except OSError as exc:
                    _log.warning("SSD file %s of the old format not deleted: %s", d.path, exc)
                    continue
                count, size = count + 1, size + nbytes
        if count:
            _log.warning("SSD tier %s: deleted %d files (%d bytes) of the former one-file-per-"
                         "block format; the cache starts without them", self.directory, count,
                         size)

    def _load_segment(self, found: Opened, *, newest: bool) -> tuple[int, int]:
        """One segment at ``load``: index its records; cut its tail if ``newest`` (a torn batch),
        else keep it as garbage. Returns (bytes cut, bytes of damage kept)."""
        seg = self.segments[found.id] = Segment(found.id, found.path, found.fd, found.dfd,
                                                found.size)
        scan = scan_segment(found.fd, seg.size)
        tail = seg.size - scan.end
        damaged = sum(end - start for start, end in scan.damaged)
        if damaged:
            _log.warning("SSD segment %s: %d damaged bytes in %d spans (first at %d) skipped; "
                         "the %d records that verify are kept", found.path, damaged,
                         len(scan.damaged), scan.damaged[0][0], len(scan.records))
        if tail and newest:
            _log.warning("SSD segment %s: cutting a torn tail of %d bytes at %d", found.path,
                         tail, scan.end)
            os.ftruncate(found.fd, scan.end)
            os.fsync(found.fd)
            seg.size = scan.end
        elif tail:
            _log.warning("SSD segment %s (sealed): %d bytes at %d do not verify; kept as garbage",
                         found.path, tail, scan.end)
            damaged += tail
        for offset, head in scan.records:
            key = (head.namespace, head.block_hash)
            old = self.records.pop(key, None)
            if old is not None:
                self._drop(old, reap=False)
            self.records[key] = Loc(found.id, offset, head)
            seg.live += head.size
            self.used_bytes += head.size
        return (tail if newest else 0), damaged

    def absorb(self, report: WriterReport, direct: bool) -> list[tuple[str, OSError]]:
        """Take in a writer job's segments: new ones opened for reads (``O_DIRECT`` too with
        ``direct``), file sizes, what is now sealed. Returns (path, error) of each new segment
        that could not be opened: its records are lost to the index (``add`` refuses them) and
        left as garbage."""
        failed: list[tuple[str, OSError]] = []
        for sid, end in report.ends.items():
            seg = self.segments.get(sid)
            if seg is None:
                path = os.path.join(self.directory, segment_name(sid))
                try:
                    fd, dfd = open_segment(path, direct=direct)
                except OSError as exc:
                    failed.append((path, exc))
                    continue
                seg = self.segments[sid] = Segment(sid, path, fd, dfd)
            seg.size = end
        self.sealed_below = report.sealed_below
        return failed

    # -- records -------------------------------------------------------------------------------

    def add(self, key: Key, placed: Placed) -> Loc | None:
        """Index a record just written (its key not indexed); None if its segment is unknown."""
        assert key not in self.records, f"{key[1].hex()} indexed twice"
        seg = self.segments.get(placed.segment)
        if seg is None:
            return None
        loc = self.records[key] = Loc(placed.segment, placed.offset, placed.head)
        seg.live += placed.head.size
        self.used_bytes += placed.head.size
        return loc

    def move(self, key: Key, old: Loc, placed: Placed) -> None:
        """Point ``key``, still at ``old``, at its copy made by compaction."""
        assert self.records.get(key) is old, f"{key[1].hex()} moved from a stale location"
        self.records[key] = Loc(placed.segment, placed.offset, placed.head)
        self.segments[old.segment].live -= old.head.size
        self.segments[placed.segment].live += old.head.size

    def entry(self, key: Key) -> SsdEntry | None:
        """The key's indexed entry, or None."""
        loc = self.records.get(key)
        return _entry(loc.head) if loc else None

    def entries(self) -> list[SsdEntry]:
        """Every indexed entry, in index order (after ``load``: append order, oldest first)."""
        return [_entry(loc.head) for loc in self.records.values()]

    def locate(self, key: Key) -> RecordSpan | None:
        """Where the key's record lies on disk, or None."""
        loc = self.records.get(key)
        if loc is None:
            return None
        return RecordSpan(Path(self.segments[loc.segment].path), loc.offset, loc.head.size)

    def discard(self, key: Key) -> Loc | None:
        """Unindex the key's record (now garbage), reaping its segment; its Loc, or None."""
        loc = self.records.pop(key, None)
        if loc is not None:
            self._drop(loc)
        return loc

    def _drop(self, loc: Loc, *, reap: bool = True) -> None:
        seg = self.segments[loc.segment]
        seg.live -= loc.head.size
        self.used_bytes -= loc.head.size
        if reap:
            self.reap(seg)

    def source(self, run: Sequence[Read]) -> Source:
        """What a reader needs for a run (adjacent records of one segment, in order): the
        segment's fds, the first offset, the headers expected."""
        seg = self.segments[run[0].loc.segment]
        return Source(seg.fd, seg.dfd, run[0].loc.offset, [r.loc.head for r in run])

    def in_segments(self, ids: set[int]) -> list[tuple[Key, Loc]]:
        """The records in the segments ``ids``, by (segment, offset)."""
        return sorted(((k, loc) for k, loc in self.records.items() if loc.segment in ids),
                      key=lambda m: (m[1].segment, m[1].offset))

    # -- segments ------------------------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of the segment files: live records plus garbage. Safe to read from another
        thread (the metrics scrape): the segments are copied in one step first."""
        return sum(s.size for s in list(self.segments.values()) if not s.unlinked)

    def pin(self, sid: int) -> None:
        """Keep the segment's fds open for a read or copy in flight, until ``unpin``."""
        self.segments[sid].busy += 1

    def unpin(self, sid: int) -> None:
        seg = self.segments[sid]
        seg.busy -= 1
        self.reap(seg)

    def pick_victims(self, limit: float) -> list[Segment]:
        """If the sealed segments' garbage passes ``limit`` bytes: those with the most garbage,
        until the rest hold at most half of it, marked compacting and pinned (they stay until
        ``release_victims``); else []."""
        sealed = [s for s in self.segments.values()
                  if s.id < self.sealed_below and not (s.unlinked or s.compacting)]
        garbage = sum(s.size - s.live for s in sealed)
        if garbage <= limit:
            return []
        victims: list[Segment] = []
        for seg in sorted(sealed, key=lambda s: s.live - s.size):
            if garbage <= limit / 2:
                break
            victims.append(seg)
            garbage -= seg.size - seg.live
            seg.compacting, seg.busy = True, seg.busy + 1
        return victims

    def release_victims(self, victims: list[Segment]) -> None:
        """End a compaction's hold on its victims (reaped by the caller once settled)."""
        for v in victims:
            v.compacting, v.busy = False, v.busy - 1

    def reap(self, seg: Segment) -> None:
        """Unlink a sealed segment with no live record; close it once no I/O uses it."""
        if seg.live or seg.id >= self.sealed_below or seg.compacting:
            return
        if not seg.unlinked:
            seg.unlinked = True
            try:
                os.unlink(seg.path)
            except OSError as exc:
                _log.warning("SSD segment %s not unlinked: %s", seg.path, exc)
        if seg.busy == 0:
            _close(seg)
            del self.segments[seg.id]

    def reap_all(self) -> None:
        for seg in list(self.segments.values()):
            self.reap(seg)

    def close(self) -> None:
        """Close every segment's fds (call with no I/O in flight); the files stay."""
        for seg in self.segments.values():
            _close(seg)

    def check_integrity(self, *, disk: bool) -> None:
        """Assert ``used_bytes`` and each segment's live bytes equal the sum of their records,
        which lie inside their segments without overlapping; with ``disk`` also that the
        directory holds exactly the known segments at their recorded sizes."""
        total = sum(loc.head.size for loc in self.records.values())
        assert self.used_bytes == total, f"used_bytes {self.used_bytes} != entries' sum {total}"
        spans: dict[int, list[tuple[int, int]]] = {sid: [] for sid in self.segments}
        for (ns, bh), loc in self.records.items():
            assert (loc.head.namespace, loc.head.block_hash) == (ns, bh), f"{loc} filed wrongly"
            assert loc.segment in self.segments, f"{bh.hex()} in unknown segment {loc.segment}"
            spans[loc.segment].append((loc.offset, loc.offset + loc.head.size))
        for sid, seg in self.segments.items():
            ranges = sorted(spans[sid])
            assert seg.live == sum(e - s for s, e in ranges), f"segment {sid}: live bytes off"
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), f"{sid}: overlap"
            assert not ranges or ranges[-1][1] <= seg.size, f"segment {sid}: record past its end"
            assert not seg.unlinked or seg.live == 0, f"segment {sid} unlinked with live records"
            assert os.path.basename(seg.path) not in self.skipped, f"{seg.path} is not trusted"
        if not disk:
            return
        on_disk = {d.name: d.stat().st_size for d in os.scandir(self.directory)
                   if segment_id(d.name) is not None and d.name not in self.skipped
                   and d.is_file(follow_symlinks=False)}
        known = {segment_name(s.id): s.size for s in self.segments.values() if not s.unlinked}
        assert on_disk == known, f"disk and index disagree: {on_disk} vs {known}"


def _close(seg: Segment) -> None:
    for fd in (seg.fd, seg.dfd):
        if fd is not None and fd >= 0:
            os.close(fd)
    seg.fd, seg.dfd = -1, None


# -- grouping reads ------------------------------------------------------------------------------


@dataclass(slots=True)
class Read:
    """A record being read into ``into``; ``future`` gets the outcome (None: a compaction's copy,
    whose outcome comes in its ``WriterReport``)."""

    key: Key
    loc: Loc  # what the index held when the read started
    into: memoryview
    future: asyncio.Future[bool] | None


T = TypeVar("T")


def runs(reads: Iterable[Read]) -> list[list[Read]]:
    """``reads`` sorted by (segment, offset) and cut into runs of adjacent records, each of at
    most ``RUN_BYTES`` and ``RUN_RECORDS`` records (one ``preadv``)."""
    out: list[list[Read]] = []
    segment, end, size = -1, 0, 0
    for r in sorted(reads, key=_place):
        loc = r.loc
        record = loc.head.size
        if (loc.segment != segment or loc.offset != end or len(out[-1]) >= RUN_RECORDS
                or size + record > RUN_BYTES):
            out.append([])
            size = 0
        out[-1].append(r)
        segment, end, size = loc.segment, loc.offset + record, size + record
    return out


def _place(r: Read) -> tuple[int, int]:
    return r.loc.segment, r.loc.offset


def batches(items: list[T], sizes: list[int], least_bytes: int, most: int) -> list[list[T]]:
    """``items`` split, in order, into at most ``total / least_bytes`` groups (rounded up; at
    least one, at most ``most``) of about equal bytes, none empty: a group closes once the next
    item's middle byte would pass its share of the bytes left."""
    if not items:
        return []
    total = sum(sizes)
    count = max(1, min(most, len(items), -(-total // least_bytes)))
    out: list[list[T]] = [[]]
    left, group_bytes = total, 0
    for item, size in zip(items, sizes):
        share = left / (count - len(out) + 1)  # of the bytes left, for this group
        if out[-1] and len(out) < count and group_bytes + size / 2 > share:
            out.append([])
            left, group_bytes = left - group_bytes, 0
        out[-1].append(item)
        group_bytes += size
    return out
