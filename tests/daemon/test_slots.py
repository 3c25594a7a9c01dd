"""The slab allocator: order, exhaustion, empty slabs returning, size classes sharing an arena."""

from __future__ import annotations

import random

import pytest

from tierd.daemon.slots import SlabAllocator
from tierd.wire.geometry import SlotGeometry


def test_geometry_offsets() -> None:
    """Slot ids encode the slab: id // slots_per_slab picks the slab, the rest the slot in it."""
    alloc = SlabAllocator(arena_bytes=4096 + 100, slab_bytes=1024)
    geo = alloc.geometry(300)
    assert geo == SlotGeometry(slab_bytes=1024, slot_bytes=300, slots_per_slab=3)
    assert [geo.offset(i) for i in range(7)] == [0, 300, 600, 1024, 1324, 1624, 2048]
    assert alloc.num_slabs == 4  # the 100 bytes past the last whole slab are unused
    alloc.check_integrity()


def test_allocation_order_and_exhaustion() -> None:
    """One class fills slab 0 then slab 1 ..., returns None when every slab is full."""
    alloc = SlabAllocator(arena_bytes=4 * 1024, slab_bytes=1024)
    got = [alloc.allocate(256) for _ in range(16)]
    assert got == list(range(16))
    assert alloc.allocate(256) is None
    assert (alloc.used_slots(256), alloc.capacity_slots(256), alloc.free_slabs()) == (16, 16, 0)
    alloc.check_integrity()


def test_freed_slot_reused_and_empty_slab_returned() -> None:
    """A freed slot is reused first; a slab whose slots are all free goes back to the pool and
    is taken next by whichever class needs one."""
    alloc = SlabAllocator(arena_bytes=3 * 1024, slab_bytes=1024)
    ids = [alloc.allocate(256) for _ in range(6)]  # slab 0 full, slab 1 half
    assert ids == [0, 1, 2, 3, 4, 5]
    alloc.free(256, 5)
    assert alloc.allocate(256) == 5
    for slot in (0, 1, 2, 3):
        alloc.free(256, slot)
    assert (alloc.free_slabs(), alloc.used_slots(256)) == (2, 2)
    alloc.check_integrity()
    assert alloc.allocate(512) == 0  # class 512 takes slab 0, just returned: id 0 = offset 0
    assert alloc.allocate(512) == 1
    assert alloc.allocate(512) == 4  # slab 2 (2 slots per slab)
    assert (alloc.free_slabs(), alloc.capacity_slots(256), alloc.capacity_slots(512)) == (0, 4, 4)
    alloc.check_integrity()


def test_two_size_classes_share_the_arena_without_overlap() -> None:
    """Random interleaved allocations of two classes never overlap in bytes, exhaust together,
    and free back to an empty pool."""
    alloc = SlabAllocator(arena_bytes=8 * 4096, slab_bytes=4096)
    rng = random.Random(7)
    live: dict[tuple[int, int], tuple[int, int]] = {}
    for step in range(2000):
        size = rng.choice((1000, 1536))
        if live and rng.random() < 0.45:
            key = rng.choice(sorted(live))
            alloc.free(*key)
            del live[key]
        else:
            slot = alloc.allocate(size)
            if slot is None:
                continue
            start = alloc.geometry(size).offset(slot)
            span = (start, start + size)
            assert span[1] <= 8 * 4096
            assert all(span[1] <= a or b <= span[0] for a, b in live.values()), f"step {step}"
            live[(size, slot)] = span
        if step % 100 == 0:
            alloc.check_integrity()
    assert alloc.used_slots(1000) + alloc.used_slots(1536) == len(live)
    for key in sorted(live):
        alloc.free(*key)
    assert (alloc.free_slabs(), alloc.used_slots(1000), alloc.used_slots(1536)) == (8, 0, 0)
    alloc.check_integrity()


def test_bad_input() -> None:
    """Double free, unknown ids, ids of another class and bad sizes raise ValueError."""
    with pytest.raises(ValueError, match="slab size"):
        SlabAllocator(arena_bytes=1000, slab_bytes=1024)
    alloc = SlabAllocator(arena_bytes=2048, slab_bytes=1024)
    for bad in (0, 1025):
        with pytest.raises(ValueError, match="slot size"):
            alloc.allocate(bad)
    slot = alloc.allocate(256)
    assert slot == 0
    alloc.free(256, slot)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(256, slot)
    assert alloc.allocate(256) == 0
    assert alloc.allocate(512) == 2  # slab 1
    for size, bad_id in [(256, 1), (256, 4), (256, -1), (512, 0), (128, 0)]:
        with pytest.raises(ValueError, match="not allocated"):
            alloc.free(size, bad_id)
    alloc.check_integrity()


def test_block_overhead_is_charged_against_the_arena() -> None:
    """Each slot also costs ``block_overhead`` bytes of the arena's size: 4 KiB slots with
    4 KiB of overhead fill half of an 8-slot arena; freeing one makes room for one; the class
    of a size no longer used is forgotten."""
    alloc = SlabAllocator(arena_bytes=8 * 4096, slab_bytes=4 * 4096, block_overhead=4096)
    got = [alloc.allocate(4096) for _ in range(5)]
    assert got == [0, 1, 2, 3, None]
    assert (alloc.capacity_slots(4096), alloc.room_slots(4096), alloc.charged) == (4, 0, 8 * 4096)
    alloc.free(4096, 2)
    assert alloc.allocate(4096) == 2
    for slot in range(4):
        alloc.free(4096, slot)
    assert alloc.classes() == [4096]
    alloc.forget(4096)
    assert alloc.classes() == [] and alloc.capacity_slots(4096) == 4
    alloc.check_integrity()


def _state(alloc: SlabAllocator) -> object:
    """Everything that decides the allocator's next answers."""
    return (list(alloc._free_slabs), alloc.charged,
            {size: (cls.used, list(cls.partial),
                    {i: (bytes(s.taken), list(s.free), s.fresh, s.used)
                     for i, s in cls.slabs.items()})
             for size, cls in alloc._classes.items()})


def test_bulk_calls_match_one_slot_at_a_time() -> None:
    """``allocate_many`` hands out the ids ``allocate`` would, in its order, and ``free_many``
    leaves the allocator as ``free`` of each would (the free lists, the partial slabs and the
    pool in the same order), through random runs that fill, drain and refill slabs of two
    classes and hit the arena's charge."""
    rng = random.Random(7)
    one = SlabAllocator(arena_bytes=8 * 1024 + 500, slab_bytes=1024, block_overhead=24)
    bulk = SlabAllocator(arena_bytes=8 * 1024 + 500, slab_bytes=1024, block_overhead=24)
    held: dict[int, list[int]] = {100: [], 300: []}
    for _ in range(400):
        size = rng.choice((100, 300))
        if rng.random() < 0.55:
            count = rng.randrange(0, 20)
            singles = []
            for _ in range(count):
                slot = one.allocate(size)
                if slot is None:
                    break
                singles.append(slot)
            assert bulk.allocate_many(size, count) == singles
            held[size] += singles
        elif held[size]:
            rng.shuffle(held[size])
            cut = rng.randrange(1, len(held[size]) + 1)
            freed, held[size] = held[size][:cut], held[size][cut:]
            for slot in freed:
                one.free(size, slot)
            bulk.free_many(size, freed)
        assert _state(bulk) == _state(one)
        bulk.check_integrity()
    assert held[100] or held[300], "the run ended empty: it exercised nothing at the end"


def test_free_many_refuses_a_bad_id_before_freeing_any() -> None:
    """A slot not allocated, or named twice, is a ValueError and nothing of the call is freed."""
    alloc = SlabAllocator(arena_bytes=2 * 1024, slab_bytes=1024)
    ids = alloc.allocate_many(256, 6)
    assert ids == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free_many(256, [0, 1, 7])
    with pytest.raises(ValueError, match="twice"):
        alloc.free_many(256, [2, 3, 2])
    assert alloc.used_slots(256) == 6
    alloc.free_many(256, ids)
    assert (alloc.used_slots(256), alloc.free_slabs()) == (0, 2)
    alloc.check_integrity()
