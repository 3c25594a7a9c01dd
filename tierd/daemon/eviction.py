"""Which blocks leave a tier first: ``LruEviction``, the node's eviction policy.

It only chooses; ``TierIndex`` drops what it names. A DRAM block is evictable when nothing pins
it (a lease, an acquire in flight) and no SSD write is reading it (``demoting``); an SSD record
when no promotion is reading it. Among those, the least recently used go first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tierd.types import Namespace, NamespacedKey

if TYPE_CHECKING:
    from tierd.daemon.lru import DramBlock, LruIndex, SsdBlock


class LruEviction:
    """Least recently used first, never a pinned or demoting block. Stateless; every method is
    one pass over a tier from its LRU end and changes nothing."""

    @staticmethod
    def evictable(block: DramBlock) -> bool:
        """Whether a DRAM block may be dropped now."""
        return block.pins == 0 and not block.demoting

    def dram_victims(self, dram: LruIndex[DramBlock], slot_bytes: int,
                     count: int, owner: Namespace | None = None) -> list[NamespacedKey]:
        """Up to ``count`` evictable DRAM blocks of the ``slot_bytes`` size class, LRU first:
        dropping each frees one slot of that class. ``owner``: the namespace the freed slots
        are for (a policy with quotas weighs it; this one does not)."""
        victims: list[NamespacedKey] = []
        for key, block in dram.oldest_first():
            if len(victims) == count:
                break
            if block.slot_bytes == slot_bytes and self.evictable(block):
                victims.append(key)
        return victims

    def dram_victim_other_class(self, dram: LruIndex[DramBlock], slot_bytes: int,
                                owner: Namespace | None = None) -> NamespacedKey | None:
        """The LRU evictable DRAM block of another size class than ``slot_bytes`` (dropping
        enough of them frees a whole slab for the class), or None. ``owner``: as above."""
        return next((k for k, b in dram.oldest_first()
                     if b.slot_bytes != slot_bytes and self.evictable(b)), None)

    def demotion_order(self, dram: LruIndex[DramBlock]) -> Iterator[tuple[NamespacedKey,
                                                                           DramBlock]]:
        """DRAM blocks in the order the flusher considers them for demotion: LRU first."""
        return dram.oldest_first()

    def ssd_victims(self, disk: LruIndex[SsdBlock], need_bytes: int,
                    writers: Sequence[Namespace] = ()) -> list[NamespacedKey]:
        """Unpinned SSD records, LRU first, whose stored bytes add up to at least
        ``need_bytes`` (all of them if they do not). ``writers``: the namespaces of the records
        the room is for (weighed by a policy with quotas, not by this one)."""
        victims: list[NamespacedKey] = []
        for key, entry in disk.oldest_first():
            if need_bytes <= 0:
                break
            if entry.pins == 0:
                victims.append(key)
                need_bytes -= entry.stored_bytes
        return victims
