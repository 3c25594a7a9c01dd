"""``SlotGeometry``: how a slot id maps to a byte offset in the DRAM arena, computed alike by the
daemon's slab allocator (``tierd.daemon.slots``) and by every engine that copies a slot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """How one size class maps slot ids to arena offsets; sent to engines at registration."""

    slab_bytes: int
    slot_bytes: int
    slots_per_slab: int

    def offset(self, slot_id: int) -> int:
        """Byte offset of ``slot_id`` in the arena."""
        slab, index = divmod(slot_id, self.slots_per_slab)
        return slab * self.slab_bytes + index * self.slot_bytes
