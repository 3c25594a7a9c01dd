"""The SSD bound's arithmetic: compaction headroom inside a footprint, a full disk lowering the
bound and its growing back."""

from __future__ import annotations

from tierd.daemon.ssd.bound import Bound, segment_for

MIB = 1 << 20


def test_a_footprint_leaves_headroom_for_garbage_and_two_segments() -> None:
    """8 GiB of files with 64 MiB segments and 25% garbage hold 6.3 GiB of live records, and
    that live bound's footprint is the 8 GiB again; a small footprint gets smaller segments."""
    b = Bound(segment_for(8 << 30, 64 * MIB), 0.25, footprint_bytes=8 << 30)
    assert b.segment_bytes == 64 * MIB
    assert b.full == int((8192 - 128) * MIB / 1.25) // 512 * 512 == b.capacity
    assert b.full * 1.25 + 2 * 64 * MIB <= b.footprint == 8 << 30
    assert segment_for(16 * MIB, 64 * MIB) == MIB and segment_for(1000, 64 * MIB) == 512
    b.check_integrity()


def test_records_larger_than_a_segment_widen_the_headroom() -> None:
    """A footprint of 8 MiB (512 KiB segments) holding 2 MiB records: the headroom is two
    records, not two segments, so the live bound shrinks to 3.2 MiB."""
    b = Bound(segment_for(8 * MIB, 64 * MIB), 0.25, footprint_bytes=8 * MIB)
    assert b.full == int(7 * MIB / 1.25) // 512 * 512
    b.saw_record(2 * MIB + 512)
    assert b.full == int((8 * MIB - 2 * (2 * MIB + 512)) / 1.25) // 512 * 512
    b.check_integrity()


def test_a_live_bound_is_fixed_and_its_footprint_follows() -> None:
    """Given as live bytes, the bound stays put; its footprint adds garbage and two segments."""
    b = Bound(MIB, 0.25, live_bytes=100 * MIB)
    assert (b.full, b.footprint) == (100 * MIB, 125 * MIB + 2 * MIB)
    b.check_integrity()


def test_full_disk_lowers_once_and_regrows_within_free_space() -> None:
    """A full disk lowers the bound to 7/8 of the live bytes (True once per lowering, also when
    it fails again); growing back is capped by a sixteenth of the bound per write and by the
    live bytes plus half the free space; whole again, the lowering is over."""
    b = Bound(MIB, 0.25, live_bytes=160 * MIB)
    assert b.disk_full(80 * MIB) is True
    assert b.capacity == 70 * MIB
    assert b.disk_full(70 * MIB) is False and b.capacity == 70 * MIB * 7 // 8
    b.lowered = 60 * MIB
    assert b.regrow(60 * MIB, 0) is False and b.capacity == 60 * MIB  # a full disk: no growth
    assert b.regrow(60 * MIB, 8 * MIB) is False and b.capacity == 64 * MIB
    assert b.regrow(64 * MIB, 1 << 40) is False and b.capacity == 74 * MIB  # one step: 10 MiB
    steps = 1
    while not b.regrow(b.capacity, 1 << 40):
        steps += 1
    assert steps == 9 and b.lowered is None and b.capacity == 160 * MIB  # 74 MiB + 9 steps
    b.check_integrity()
