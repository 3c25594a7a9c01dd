"""Where each DRAM block lives in the arena: a slab allocator over size classes (metadata only).

The arena is cut into equal slabs. A slab is free, or taken by exactly one size class (one block
byte size) and cut into that class's slots. Several layouts (models, TP ranks) share one daemon
without a static partition: a class grows by taking any free slab, and a slab whose slots are all
free goes back to the pool at once, for any class to take. Layouts with the same block bytes share
a class. Waste is at most ``slab_bytes % slot_bytes`` per slab plus the free slots of partially
used slabs.

Each allocated slot is also charged ``block_overhead`` bytes, the daemon memory of its block's
index entry, against the arena's size: at most ``arena_bytes / (slot_bytes + block_overhead)``
slots of one size are allocated at once, so tiny blocks cannot make the daemon's memory a
multiple of the arena's (``allocate`` answers None past it, as when no slot is free).

Slot ids are per class and encode the slab: ``slot_id = slab * slots_per_slab + index``, so the
byte offset is a pure function of the id (``SlotGeometry.offset``) that engines compute too.
Allocation and free are O(1). No I/O, not thread-safe (the daemon calls it from its event loop).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tierd.wire.geometry import SlotGeometry


@dataclass(slots=True)
class _Slab:
    """One taken slab. Invariant: ``used == sum(taken) == fresh - len(free)``."""

    taken: bytearray  # taken[i] == 1 iff slot i of this slab is allocated
    free: list[int] = field(default_factory=list)  # freed indices below `fresh`, reused LIFO
    fresh: int = 0  # indices >= fresh were never handed out (lazy: no O(slots) set-up)
    used: int = 0


@dataclass(slots=True)
class _SizeClass:
    geometry: SlotGeometry
    slabs: dict[int, _Slab] = field(default_factory=dict)  # slab index -> slab
    # Slabs with at least one free slot, oldest first (a dict used as an ordered set).
    partial: dict[int, None] = field(default_factory=dict)
    used: int = 0


class SlabAllocator:
    """Carves one arena into slabs of ``slab_bytes``; each slab, once taken, holds slots of one
    size class (one block byte size; several layouts with the same block bytes share a class).
    A class grows by taking a free slab and returns a slab to the pool when all its slots are
    free. Slot ids are per class and encode the slab (see ``SlotGeometry.offset``).

    Order: a class fills its oldest partially used slab first; free slabs are taken lowest index
    first at start, then most recently returned first.
    """

    def __init__(self, arena_bytes: int, slab_bytes: int, block_overhead: int = 0) -> None:
        """ValueError unless ``0 < slab_bytes <= arena_bytes`` and ``block_overhead >= 0``.
        Bytes past the last whole slab are not used."""
        if block_overhead < 0:
            raise ValueError(f"block overhead must be >= 0, got {block_overhead}")
        if slab_bytes <= 0 or slab_bytes > arena_bytes:
            raise ValueError(
                f"slab size {slab_bytes} must be > 0 and <= the arena size {arena_bytes}: "
                "raise the DRAM size or lower the slab size"
            )
        self.arena_bytes = arena_bytes
        self.slab_bytes = slab_bytes
        self.num_slabs = arena_bytes // slab_bytes
        self._free_slabs: list[int] = list(range(self.num_slabs - 1, -1, -1))  # pop() -> lowest
        self._classes: dict[int, _SizeClass] = {}
        self.block_overhead = block_overhead
        self.charged = 0  # sum over allocated slots of slot_bytes + block_overhead


    def geometry(self, slot_bytes: int) -> SlotGeometry:
        """The geometry of the class of ``slot_bytes``. ValueError if ``slot_bytes`` is <= 0 or
        larger than a slab (raise the slab size)."""
        if slot_bytes <= 0 or slot_bytes > self.slab_bytes:
            raise ValueError(
                f"slot size {slot_bytes} must be > 0 and <= the slab size {self.slab_bytes}: "
                "raise the slab size to at least the largest block"
            )
        return SlotGeometry(self.slab_bytes, slot_bytes, self.slab_bytes // slot_bytes)

    def allocate(self, slot_bytes: int) -> int | None:
        """Take one slot of the class; None when the class has no free slot and no slab is free.
        O(1). The caller owns the slot until it calls ``free``."""
        cost = slot_bytes + self.block_overhead
        if self.charged + cost > self.arena_bytes:
            return None
        cls = self._class(slot_bytes)
        if cls.partial:
            slab_index = next(iter(cls.partial))
            slab = cls.slabs[slab_index]
        elif self._free_slabs:
            slab_index = self._free_slabs.pop()
            slab = _Slab(taken=bytearray(cls.geometry.slots_per_slab))
            cls.slabs[slab_index] = slab
            cls.partial[slab_index] = None
        else:
            return None
        index = slab.free.pop() if slab.free else slab.fresh
        if index == slab.fresh:
            slab.fresh += 1
        assert not slab.taken[index], f"slot {index} of slab {slab_index} handed out twice"
        slab.taken[index] = 1
        slab.used += 1
        cls.used += 1
        self.charged += cost
        if slab.used == cls.geometry.slots_per_slab:
            del cls.partial[slab_index]
        return slab_index * cls.geometry.slots_per_slab + index

    def allocate_many(self, slot_bytes: int, count: int) -> list[int]:
        """Up to ``count`` slots of the class: the ids ``allocate`` would hand out one call at a
        time, in that order (fewer when the charge or the slabs run out), each slab's share
        taken at once."""
        cost = slot_bytes + self.block_overhead
        count = min(count, (self.arena_bytes - self.charged) // cost)
        cls = self._class(slot_bytes)
        spp = cls.geometry.slots_per_slab
        out: list[int] = []
        while len(out) < count:
            if cls.partial:
                slab_index = next(iter(cls.partial))
                slab = cls.slabs[slab_index]
            elif self._free_slabs:
                slab_index = self._free_slabs.pop()
                slab = _Slab(taken=bytearray(spp))
                cls.slabs[slab_index] = slab
                cls.partial[slab_index] = None
            else:
                break
            want = count - len(out)
            reused = slab.free[:-want - 1:-1] if want < len(slab.free) else slab.free[::-1]
            del slab.free[len(slab.free) - len(reused):]
            fresh = min(want - len(reused), spp - slab.fresh)
            indices = reused + list(range(slab.fresh, slab.fresh + fresh))
            slab.fresh += fresh
            taken = slab.taken
            for index in indices:
                assert not taken[index], f"slot {index} of slab {slab_index} handed out twice"
                taken[index] = 1
            slab.used += len(indices)
            base = slab_index * spp
            out.extend(base + index for index in indices)
            if slab.used == spp:
                del cls.partial[slab_index]
        cls.used += len(out)
        self.charged += cost * len(out)
        return out

    def free_many(self, slot_bytes: int, slot_ids: Iterable[int]) -> None:
        """``free`` each of ``slot_ids``, in order, leaving the allocator as those calls would;
        ValueError as ``free`` raises it (or naming a slot twice), before any slot is freed."""
        ids = list(slot_ids)
        if not ids:
            return
        cls = self._classes.get(slot_bytes)
        spp = cls.geometry.slots_per_slab if cls else 1
        by_slab: dict[int, list[int]] = {}
        for slot_id in ids:
            slab_index, index = divmod(slot_id, spp)
            slab = cls.slabs.get(slab_index) if cls else None
            if slab is None or slot_id < 0 or not slab.taken[index]:
                raise ValueError(
                    f"slot {slot_id} of size class {slot_bytes} is not allocated (double "
                    "free, or an id from another size class)")
            by_slab.setdefault(slab_index, []).append(index)
        if len(set(ids)) < len(ids):
            raise ValueError(f"a slot of size class {slot_bytes} is freed twice in one call")
        assert cls is not None
        emptied: list[int] = []
        for slab_index, indices in by_slab.items():
            slab = cls.slabs[slab_index]
            for index in indices:
                slab.taken[index] = 0
            slab.used -= len(indices)
            if slab.used == 0:
                del cls.slabs[slab_index]
                cls.partial.pop(slab_index, None)
                emptied.append(slab_index)
            else:
                slab.free.extend(indices)
                cls.partial[slab_index] = None
        if len(emptied) > 1:  # back to the pool in the order their last slot was freed
            last = {divmod(slot_id, spp)[0]: i for i, slot_id in enumerate(ids)}
            emptied.sort(key=last.__getitem__)
        self._free_slabs.extend(emptied)
        cls.used -= len(ids)
        self.charged -= (slot_bytes + self.block_overhead) * len(ids)

    def free(self, slot_bytes: int, slot_id: int) -> None:
        """Give a slot back. O(1). A slab left empty returns to the pool. ValueError on a double
        free or an id this class never handed out."""
        cls = self._classes.get(slot_bytes)
        spp = cls.geometry.slots_per_slab if cls else 1
        slab_index, index = divmod(slot_id, spp)
        slab = cls.slabs.get(slab_index) if cls else None
        if slab is None or slot_id < 0 or not slab.taken[index]:
            raise ValueError(
                f"slot {slot_id} of size class {slot_bytes} is not allocated (double free, "
                "or an id from another size class)"
            )
        assert cls is not None
        slab.taken[index] = 0
        slab.used -= 1
        cls.used -= 1
        self.charged -= slot_bytes + self.block_overhead
        if slab.used == 0:
            del cls.slabs[slab_index]
            cls.partial.pop(slab_index, None)
            self._free_slabs.append(slab_index)
        else:
            slab.free.append(index)
            cls.partial[slab_index] = None

    def used_slots(self, slot_bytes: int) -> int:
        """Slots of this class allocated now."""
        cls = self._classes.get(slot_bytes)
        return cls.used if cls else 0

    def capacity_slots(self, slot_bytes: int) -> int:
        """Slots this class could hold if it took every free slab (used ones included), within
        the charge of ``block_overhead`` per slot."""
        spp = self.geometry(slot_bytes).slots_per_slab
        cls = self._classes.get(slot_bytes)
        slabs = (len(cls.slabs) if cls else 0) * spp + len(self._free_slabs) * spp
        return min(slabs, self.used_slots(slot_bytes) + self.room_slots(slot_bytes))

    def room_slots(self, slot_bytes: int) -> int:
        """Slots of ``slot_bytes`` the overhead charge still allows beside those allocated."""
        return max(0, self.arena_bytes - self.charged) // (slot_bytes + self.block_overhead)

    def classes(self) -> list[int]:
        """The slot sizes this allocator keeps a class for (``forget`` drops an unused one)."""
        return list(self._classes)

    def forget(self, slot_bytes: int) -> None:
        """Drop the class of ``slot_bytes`` (it must hold no slot): no memory stays behind for
        a block size no longer in use. A later ``allocate`` makes it again."""
        cls = self._classes.pop(slot_bytes, None)
        assert cls is None or cls.used == 0, f"forgetting class {slot_bytes} with slots in use"

    def free_slabs(self) -> int:
        """Slabs no class holds."""
        return len(self._free_slabs)

    def check_integrity(self) -> None:
        """Assert every slab is free or held by exactly one class, and every count adds up."""
        owners: dict[int, str] = {i: "pool" for i in self._free_slabs}
        assert len(owners) == len(self._free_slabs), "a slab is in the free pool twice"
        for slot_bytes, cls in self._classes.items():
            assert cls.geometry == self.geometry(slot_bytes), f"class {slot_bytes}: bad geometry"
            total = 0
            for slab_index, slab in cls.slabs.items():
                assert 0 <= slab_index < self.num_slabs, f"slab {slab_index} out of range"
                assert slab_index not in owners, (
                    f"slab {slab_index} held by class {slot_bytes} and by {owners[slab_index]}"
                )
                owners[slab_index] = f"class {slot_bytes}"
                spp = cls.geometry.slots_per_slab
                assert len(slab.taken) == spp, f"slab {slab_index}: bitmap of wrong length"
                assert slab.used == sum(slab.taken) == slab.fresh - len(slab.free) > 0, (
                    f"slab {slab_index}: used {slab.used}, bitmap {sum(slab.taken)}, "
                    f"fresh {slab.fresh} - free {len(slab.free)} disagree or the slab is empty"
                )
                assert len(set(slab.free)) == len(slab.free), f"slab {slab_index}: free list dup"
                assert all(i < slab.fresh and not slab.taken[i] for i in slab.free), (
                    f"slab {slab_index}: a free-listed slot is taken or never handed out"
                )
                assert not any(slab.taken[slab.fresh :]), f"slab {slab_index}: taken past fresh"
                assert (slab_index in cls.partial) == (slab.used < spp), (
                    f"slab {slab_index}: partial set disagrees with its use {slab.used}/{spp}"
                )
                total += slab.used
            assert set(cls.partial) <= set(cls.slabs), f"class {slot_bytes}: stray partial slab"
            assert total == cls.used, f"class {slot_bytes}: used {cls.used} != slabs' sum {total}"
        charged = sum(c.used * (size + self.block_overhead) for size, c in self._classes.items())
        assert charged == self.charged <= self.arena_bytes, (
            f"charged {self.charged} bytes, slots add up to {charged}, arena {self.arena_bytes}")
        assert len(owners) == self.num_slabs, (
            f"{self.num_slabs - len(owners)} slabs are neither free nor held by a class (leak)"
        )

    def _class(self, slot_bytes: int) -> _SizeClass:
        cls = self._classes.get(slot_bytes)
        if cls is None:
            cls = self._classes[slot_bytes] = _SizeClass(self.geometry(slot_bytes))
        return cls
