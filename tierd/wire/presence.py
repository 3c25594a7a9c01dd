"""The engine's read-only look at a daemon's presence filter (``PresenceView``), and the two
cells a filter key maps to, which the daemon's counters (``tierd.daemon.presence``) use alike.

A key counts in two cells (the low and the high half of its xxh3-64, each cut to the cell
count): a key absent from the node reads "maybe" only where both of its cells count other keys,
so with a share ``f`` of cells in use a false "maybe" comes about ``f * f`` of the time, not
``f``."""

from __future__ import annotations

import xxhash

from tierd.wire.arena import ShmArena

SSD_WEIGHT = 16
"""What an SSD copy adds to its cell (a DRAM copy adds 1): a cell whose count is not a multiple
of it, or is ``SATURATED``, may hold a DRAM copy."""

SATURATED = 255
"""A counter that would pass 254 stays here: "maybe", in DRAM too."""


def cells_of(filter_key: bytes, cells: int) -> tuple[int, int]:
    """The two counters of a filter key (``prefix || block hash``) among ``cells`` (a power of
    two, at most 2**32); they may be one and the same."""
    digest = xxhash.xxh3_64_intdigest(filter_key)
    return digest & (cells - 1), (digest >> 32) & (cells - 1)


def check_cells(cells: int) -> None:
    """ValueError unless ``cells`` is a power of two from 1024 to 2**32."""
    if cells < 1024 or cells > 1 << 32 or cells & (cells - 1):
        raise ValueError(f"presence filter cells={cells} must be a power of two >= 1024 "
                         "and <= 2**32")


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
        first, second = cells_of(filter_key, self.cells)
        return self._counts[first] != 0 and self._counts[second] != 0

    def may_be_in_dram(self, filter_key: bytes) -> bool:
        """False if the node held no DRAM copy of the block when last counted (it may still
        hold an SSD copy): ``may_hold`` narrowed to DRAM."""
        first, second = cells_of(filter_key, self.cells)
        return _dram(self._counts[first]) and _dram(self._counts[second])


def _dram(count: int) -> bool:
    """Whether a cell's count may include a DRAM copy."""
    return count % SSD_WEIGHT != 0 or count == SATURATED

