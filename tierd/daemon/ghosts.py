"""The ghost list: the blocks that recently left the node, when, from which tier and why.

``TierIndex`` remembers a block here when its last copy leaves the node (an eviction, or a copy
that failed its checksum) and forgets it when the block is stored again. Two readers: the
reuse-gap histogram (a re-store of a ghost observes the gap since its last access) and
``tierd why`` (a miss on a ghost is explained by its eviction). Bounded: past ``capacity`` the
oldest ghosts are forgotten, so a miss on a block evicted long ago reads as "never stored".
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from tierd.types import NamespacedKey, Tier

Pressure = Literal["room", "watermark", "admission", "ssd_room", "corrupt"]
"""What made a block's last copy leave:

- ``room``: a new block needed a DRAM slot and the arena was full (LRU; with ``tenant_quotas``,
  over-quota tenants' blocks first);
- ``watermark``: the flusher demoted it above ``dram_high_watermark`` and no SSD copy was kept
  (the SSD had no room for it, or is unhealthy);
- ``admission``: the same, because it had fewer than ``ssd_min_hits`` hits (SSD admission);
- ``ssd_room``: its SSD record was dropped to make room under ``ssd_bytes``;
- ``corrupt``: its bytes failed their checksum.
"""

PRESSURES: dict[Pressure, str] = {
    "room": "DRAM full: its slot went to a newer block (LRU)",
    "watermark": "DRAM above its high watermark: demoted, and the SSD kept no copy (no room "
                 "or unhealthy)",
    "admission": "DRAM above its high watermark: demoted with fewer hits than ssd_min_hits, "
                 "so the SSD did not admit it",
    "ssd_room": "SSD full: its record went to make room for newer ones (LRU)",
    "corrupt": "its bytes failed their checksum",
}
"""Each pressure in words, for an operator."""


@dataclass(frozen=True, slots=True)
class Ghost:
    """A block whose last copy left the node (times on the node store's clock)."""

    last_access: float      # its last commit or acquire hit
    left_at: float          # when its last copy left
    tier: Tier              # the tier that copy left from ("dram" or "ssd")
    pressure: Pressure


class GhostList:
    """Key -> ``Ghost``, oldest departure first, at most ``capacity`` entries. O(1) each."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ghost_entries must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ghosts: OrderedDict[NamespacedKey, Ghost] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ghosts)

    def remember(self, key: NamespacedKey, ghost: Ghost) -> None:
        """``key``'s last copy left: it becomes the newest ghost; the oldest past the bound go."""
        self._ghosts[key] = ghost
        self._ghosts.move_to_end(key)
        if len(self._ghosts) > self.capacity:
            self._ghosts.popitem(last=False)

    def forget(self, key: NamespacedKey) -> Ghost | None:
        """Remove and return ``key``'s ghost (it is being stored again), or None."""
        return self._ghosts.pop(key, None)

    def get(self, key: NamespacedKey) -> Ghost | None:
        """``key``'s ghost, or None if it never left or left before the oldest remembered."""
        return self._ghosts.get(key)

    def check_integrity(self) -> None:
        """Assert the bound and that each ghost left a tier of the node's own."""
        assert len(self._ghosts) <= self.capacity, "ghost list over its bound"
        assert all(g.tier in ("dram", "ssd") for g in self._ghosts.values()), \
            "a ghost left from a tier the node does not hold"
