"""The eviction policy on real tier indexes: LRU first, never a pinned or demoting block, the
asked-for size class first; SSD victims add up to the bytes needed."""

from __future__ import annotations

from tierd.daemon.eviction import LruEviction
from tierd.daemon.lru import DramBlock, LruIndex, SsdBlock
from tierd.types import BlockHash, Namespace, NamespacedKey

NS = Namespace(bytes(16))


def key(i: int) -> NamespacedKey:
    return NamespacedKey(NS + bytes([i]) * 32)


def dram(*blocks: tuple[int, int, int, bool]) -> LruIndex[DramBlock]:
    """Blocks (id, slot bytes, pins, demoting), oldest first."""
    index: LruIndex[DramBlock] = LruIndex()
    for i, slot_bytes, pins, demoting in blocks:
        index.add(key(i), DramBlock(NS, BlockHash(bytes([i]) * 32), slot_bytes, i, 0, 0.0, 0.0,
                                    pins=pins, demoting=demoting))
    return index


def test_dram_victims_are_lru_of_the_class_and_skip_pinned_and_demoting() -> None:
    """Of 0 (pinned), 1, 2 (other class), 3 (demoting), 4, 5: two victims for class 1024 are 1
    and 4; asking for five gives the three there are; the other class's LRU victim is 2."""
    index = dram((0, 1024, 1, False), (1, 1024, 0, False), (2, 4096, 0, False),
                 (3, 1024, 0, True), (4, 1024, 0, False), (5, 1024, 0, False))
    policy = LruEviction()
    assert policy.dram_victims(index, 1024, 2) == [key(1), key(4)]
    assert policy.dram_victims(index, 1024, 5) == [key(1), key(4), key(5)]
    assert policy.dram_victim_other_class(index, 1024) == key(2)
    assert policy.dram_victim_other_class(index, 4096) == key(1)
    assert policy.dram_victims(dram((0, 1024, 2, False)), 1024, 1) == []


def test_ssd_victims_add_up_to_the_bytes_needed() -> None:
    """Records of 100, 200 (pinned), 300, 400 bytes, oldest first: 350 bytes take the first and
    third; 0 bytes take none; more than all take every unpinned one."""
    index: LruIndex[SsdBlock] = LruIndex()
    for i, (size, pins) in enumerate([(100, 0), (200, 1), (300, 0), (400, 0)]):
        index.add(key(i), SsdBlock(NS, BlockHash(bytes([i]) * 32), size, size, 0, 0.0, 0.0,
                                   pins=pins))
    policy = LruEviction()
    assert policy.ssd_victims(index, 350) == [key(0), key(2)]
    assert policy.ssd_victims(index, 0) == []
    assert policy.ssd_victims(index, 10_000) == [key(0), key(2), key(3)]
