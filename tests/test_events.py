"""The event log: drained in order, bounded."""

from __future__ import annotations

from tierd.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog
from tierd.types import BlockHash, Namespace, make_key, split_key


def test_take_events_drains_in_order() -> None:
    """Events come back oldest first, and a second take is empty."""
    log = EventLog()
    h = BlockHash(b"\x01" * 32)
    log.append(BlockStored((h,), None, "dram"))
    log.append(BlockRemoved((h,), "dram"))
    log.append(AllBlocksCleared("ssd"))
    assert log.take_events() == [
        BlockStored((h,), None, "dram"),
        BlockRemoved((h,), "dram"),
        AllBlocksCleared("ssd"),
    ]
    assert log.take_events() == []


def test_event_log_is_bounded() -> None:
    """Past max_events the oldest are dropped and counted."""
    log = EventLog(max_events=3)
    for tier in ("hbm", "dram", "ssd", "remote", "hbm"):
        log.append(AllBlocksCleared(tier))  # type: ignore[arg-type]
    assert [e.tier for e in log.take_events()] == ["ssd", "remote", "hbm"]  # type: ignore[union-attr]
    assert log.dropped == 2


def test_namespaced_key_round_trip() -> None:
    """make_key and split_key are inverse for a fixed-length namespace."""
    ns, h = Namespace(b"n" * 16), BlockHash(bytes(range(32)))
    assert split_key(make_key(ns, h), 16) == (ns, h)


def test_a_full_ring_drops_the_oldest_in_order() -> None:
    """200,000 appends into a ring of 100,000: the newest 100,000 come back in order and the
    other 100,000 are counted as dropped (each append O(1): a deque, not a list shift)."""
    log = EventLog(max_events=100_000)
    hashes = [BlockHash(i.to_bytes(32, "big")) for i in range(200_000)]
    for h in hashes:
        log.append(BlockRemoved((h,), "dram"))
    assert len(log) == 100_000 and log.dropped == 100_000
    events = log.take_events()
    assert [e.block_hashes[0] for e in events] == hashes[100_000:]  # type: ignore[union-attr]
    assert len(log) == 0


def test_a_log_of_size_zero_keeps_nothing() -> None:
    """max_events=0: appends are only counted, take_events is always empty."""
    log = EventLog(max_events=0)
    log.append(AllBlocksCleared("ssd"))
    assert (log.take_events(), log.dropped) == ([], 1)
