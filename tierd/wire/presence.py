"""The engine's read-only look at a daemon's presence filter (``PresenceView``), and the cell a
filter key maps to, which the daemon's counters (``tierd.daemon.presence``) use alike."""

from __future__ import annotations

import xxhash

from tierd.wire.arena import ShmArena

SSD_WEIGHT = 16
"""What an SSD copy adds to its cell (a DRAM copy adds 1): a cell whose count is not a multiple
of it, or is ``SATURATED``, may hold a DRAM copy."""

SATURATED = 255
"""A counter that would pass 254 stays here: "maybe", in DRAM too."""


def cell_of(filter_key: bytes, cells: int) -> int:
    """The counter of a filter key (``prefix || block hash``) among ``cells`` (a power of two)."""
    return xxhash.xxh3_64_intdigest(filter_key) & (cells - 1)


def check_cells(cells: int) -> None:
    """ValueError unless ``cells`` is a power of two of at least 1024."""
    if cells < 1024 or cells & (cells - 1):
        raise ValueError(f"presence filter cells={cells} must be a power of two >= 1024")


class PresenceView:
    """Engine side: a read-only look at a daemon's filter (``EngineHandle.presence_name``)."""

    def __init__(self, name: str, directory: str) -> None:
        """Map the filter file; OSError if it is gone, ValueError if it is not a filter."""
        self._shm = ShmArena.attach(name, directory=directory)
        check_cells(self._shm.size)
        self.cells = self._shm.size
        self._counts = self._shm.view(0, self._shm.size)

    def may_hold(self, filter_key: bytes) -> bool:
        """False only if the node held no DRAM or SSD copy of the block when last counted.
        ``filter_key``: the engine's ``namespace`` from RegisterEngine (its filter prefix)
        followed by the block hash."""
        return self._counts[xxhash.xxh3_64_intdigest(filter_key) & (self.cells - 1)] != 0

    def may_be_in_dram(self, filter_key: bytes) -> bool:
        """False if the node held no DRAM copy of the block when last counted (it may still
        hold an SSD copy): ``may_hold`` narrowed to DRAM."""
        count = self._counts[xxhash.xxh3_64_intdigest(filter_key) & (self.cells - 1)]
        return count % SSD_WEIGHT != 0 or count == SATURATED

