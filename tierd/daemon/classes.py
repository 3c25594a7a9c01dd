"""The size classes in use: one per block size that a registered engine has or a DRAM slot holds.

A class joins when the first engine of its block size registers and is pruned the moment both
its last engine has left and its last slot is freed (a committed block outlives its engine
until evicted), so the walks over classes (Stats, every maintain pass, ``dram_used_bytes``) cost
what is in use now, not every size ever registered, and the allocator keeps no class that holds
nothing. At most ``max_classes`` are in use at once: a registration that would add one more is
RESOURCE_EXHAUSTED naming ``max_size_classes``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from tierd.daemon.errors import ResourceExhausted
from tierd.daemon.slots import SlabAllocator


class SizeClasses:
    """Slot size -> engines registered with it, for the sizes in use. Not thread-safe."""

    def __init__(self, allocator: SlabAllocator, max_classes: int) -> None:
        self._alloc, self.max_classes = allocator, max_classes
        self._engines: dict[int, int] = {}  # slot bytes -> engines registered (may be 0)

    def __iter__(self) -> Iterator[int]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def __contains__(self, slot_bytes: object) -> bool:
        return slot_bytes in self._engines

    def check_room(self, slot_bytes: int) -> None:
        """ResourceExhausted if an engine of ``slot_bytes`` would add a class past the cap."""
        if slot_bytes not in self._engines and len(self._engines) >= self.max_classes:
            raise ResourceExhausted(
                f"{len(self._engines)} block sizes are in use, the cap (max_size_classes = "
                f"{self.max_classes}): a block of {slot_bytes} bytes would add one; unregister "
                "engines of unused layouts, or raise TIERD_MAX_SIZE_CLASSES")

    def join(self, slot_bytes: int) -> None:
        """An engine of ``slot_bytes`` registered (``check_room`` first)."""
        self.check_room(slot_bytes)
        self._engines[slot_bytes] = self._engines.get(slot_bytes, 0) + 1

    def leave(self, slot_bytes: int) -> None:
        """An engine of ``slot_bytes`` left: the class goes if it holds no slot either."""
        assert self._engines.get(slot_bytes, 0) > 0, f"class {slot_bytes}: no engine to leave"
        self._engines[slot_bytes] -= 1
        self.freed(slot_bytes)

    def freed(self, slot_bytes: int) -> None:
        """A slot of ``slot_bytes`` was freed: the class goes if no engine and no slot is left."""
        if self._engines.get(slot_bytes) == 0 and not self._alloc.used_slots(slot_bytes):
            del self._engines[slot_bytes]
            self._alloc.forget(slot_bytes)

    def check_integrity(self, engines: Counter[int]) -> None:
        """Assert ``engines`` (registered engines per slot size) matches, every class is in use
        (an engine or an allocated slot), the allocator keeps no other class, and the cap
        holds."""
        assert Counter({c: n for c, n in self._engines.items() if n}) == engines, (
            f"class engine counts {self._engines} disagree with the engine table {engines}")
        for c, n in self._engines.items():
            assert n or self._alloc.used_slots(c), f"class {c} has no engine and no slot"
        assert set(self._alloc.classes()) <= set(self._engines), "allocator class not in use"
        assert len(self._engines) <= self.max_classes, "more size classes than max_size_classes"
