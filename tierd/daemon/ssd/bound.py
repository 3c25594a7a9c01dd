"""The SSD tier's byte bound: how many bytes of live records it may hold so that its files stay
within a footprint, and how a full disk lowers that bound for a while.

**Footprint.** The files hold the live records, garbage (dead records) and, during compaction,
copies of live records not yet unlinked at their old place. With records no larger than a
segment, ``SsdStore`` keeps

    files <= live * (1 + garbage_fraction) + 2 * max(segment, largest record)

(the sealed segments' garbage, at most ``garbage_fraction`` of the live bound once compaction
ran before an append; the current segment's garbage; one segment being copied). A bound given as
a footprint (``tierd serve``'s ``ssd_bytes``) is turned into the live bound that keeps this
inequality under it, so the files never pass ``ssd_bytes``: for 8 GiB, 64 MiB segments and 25%
garbage, 6.3 GiB of live records. The segment size is capped at a sixteenth of the footprint
so a small bound is not all headroom.

**A full disk.** The filesystem may hold less than the bound (other files, a quota). A write that
fails with ``ENOSPC`` or ``EDQUOT`` lowers the effective bound to 7/8 of the live bytes at that
moment; the node store then evicts its least recently used SSD blocks down to it before its next
write, old segments empty and are unlinked, and space comes back. Each later write first raises
the bound again, by at most a sixteenth of the full bound and to at most the live bytes plus half
the filesystem's free bytes, until it is whole: a disk that stays full keeps the bound low
instead of failing every write.

Pure bookkeeping (no I/O): the store asks the filesystem and tells this object.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierd.daemon.ssd.record import ALIGN

LOWER_TO = 7 / 8
"""A full disk lowers the bound to this fraction of the live bytes."""

REGROW_STEPS = 16
"""A lowered bound grows back by at most ``1 / REGROW_STEPS`` of the full bound per write."""


def segment_for(footprint_bytes: int, segment_bytes: int) -> int:
    """The segment size a store of ``footprint_bytes`` uses: ``segment_bytes``, capped at a
    sixteenth of the footprint (a multiple of ``ALIGN``, at least one)."""
    return max(ALIGN, min(segment_bytes, footprint_bytes // 16 // ALIGN * ALIGN))


@dataclass(slots=True)
class Bound:
    """The live-record bound of one store. Given as ``live_bytes`` (a fixed live bound; the
    footprint follows from it) or as ``footprint_bytes`` (the live bound follows, and shrinks
    if records turn out larger than a segment). ``lowered``: the effective bound while a full
    disk holds it down (None: not lowered)."""

    segment_bytes: int
    garbage_fraction: float
    live_bytes: int | None = None
    footprint_bytes: int | None = None
    largest_record: int = 0  # bytes of the largest record written or found
    lowered: int | None = None

    def __post_init__(self) -> None:
        assert (self.live_bytes is None) != (self.footprint_bytes is None), (
            "a bound is given either as live bytes or as a footprint")

    @property
    def full(self) -> int:
        """The bound without a full disk: what ``capacity`` returns to."""
        if self.live_bytes is not None:
            return self.live_bytes
        assert self.footprint_bytes is not None
        live = (self.footprint_bytes - self._headroom()) / (1 + self.garbage_fraction)
        return max(0, int(live) // ALIGN * ALIGN)

    @property
    def capacity(self) -> int:
        """The effective bound: the live bytes the store accepts now."""
        return self.full if self.lowered is None else min(self.lowered, self.full)

    @property
    def footprint(self) -> int:
        """The most bytes the files may take at the full bound."""
        if self.footprint_bytes is not None:
            return self.footprint_bytes
        return int(self.full * (1 + self.garbage_fraction)) + self._headroom()

    def saw_record(self, size: int) -> None:
        """A record of ``size`` bytes exists (written or found at start-up)."""
        self.largest_record = max(self.largest_record, size)

    def disk_full(self, live_bytes: int) -> bool:
        """A write failed for want of space with ``live_bytes`` of live records: lower the
        bound below them. True if this starts a lowering (the caller warns once)."""
        started = self.lowered is None
        target = int(live_bytes * LOWER_TO) // ALIGN * ALIGN
        self.lowered = min(target, self.capacity)
        return started

    def regrow(self, live_bytes: int, free_bytes: int) -> bool:
        """Before a write, with ``live_bytes`` of live records and ``free_bytes`` free on the
        filesystem: raise a lowered bound by at most a ``REGROW_STEPS``-th of the full bound,
        and to at most the live bytes plus half the free ones. True if it is whole again."""
        if self.lowered is None:
            return False
        step = max(self.full // REGROW_STEPS, self.largest_record)
        self.lowered = max(self.lowered, min(self.lowered + step, live_bytes + free_bytes // 2))
        if self.lowered < self.full:
            return False
        self.lowered = None
        return True

    def check_integrity(self) -> None:
        """Assert the bounds are consistent: the effective one within the full one."""
        assert 0 <= self.capacity <= self.full, (
            f"effective bound {self.capacity} outside [0, {self.full}]")
        assert self.lowered is None or self.lowered >= 0, f"lowered to {self.lowered}"
        assert self.segment_bytes > 0, f"segment of {self.segment_bytes} bytes"

    def _headroom(self) -> int:
        return 2 * max(self.segment_bytes, self.largest_record)
