"""``Pin``: what the scheduler side holds for a request's reported hit, until it is released.

The leases (one per TP rank) that keep the hit's blocks in the daemon's DRAM, each rank's
Acquire answer that its worker loads under (``PinnedRun`` in the step's metadata), and the
load's outcome as the workers report it: how many blocks were served, and from which one a
load failed. ``SchedulerSide`` owns the pins; this module only keeps their books.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierd.connector.core.lease import Lease
from tierd.types import BlockHash, Tier
from tierd.wire.replies import AcquiredBlocks

from .metadata import PinnedRun


@dataclass(slots=True)
class Pin:
    """The leases (one per TP rank) that hold a request's reported hit in the daemon's DRAM."""

    start: int                     # block position of the first hit
    hashes: list[BlockHash]        # the hit blocks, chain order
    tiers: list[Tier]              # where each was when looked up
    leases: list[tuple[int, str]]  # (rank, lease id)
    reports: int = 0               # workers that reported the load done
    block_ids: list[int] = field(default_factory=list)  # where vLLM loads it (once planned)
    failed_from: int | None = None  # first hit block some worker failed to load
    stream: bool = False           # loaded asynchronously, the workers acquire it (no leases)
    skipped: int = 0               # leading leased blocks dropped since (the local hit grew)
    fresh_until: float = float("inf")  # clock time after which the answer is asked again
    runs: list[tuple[str, AcquiredBlocks, float]] = field(default_factory=list)
    """Per rank: (arena, its Acquire, deadline), what its worker loads under; empty: the workers
    acquire the blocks themselves."""
    handed: bool = False           # the workers were told to load under ``runs``
    probed: bool = False           # answered from the presence filter: no leases, the
    #                                worker pins it by a Probe as it loads it

    @property
    def deadline(self) -> float:
        """Clock time until which every rank's lease surely holds."""
        return min((deadline for _, _, deadline in self.runs), default=float("inf"))

    def pinned_runs(self, count: int) -> list[PinnedRun]:
        """Each rank's part of the first ``count`` held blocks, for its worker to load under."""
        first = self.skipped
        return [PinnedRun(arena, got.slot_ids[first:first + count],
                          got.checksums[first:first + count], deadline)
                for arena, got, deadline in self.runs]

    def served(self, ranks: int) -> int | None:
        """Blocks loaded under the pin, as its release reports them (None: the workers did not
        load under it, or not all ``ranks`` of them reported the load)."""
        if not self.handed or self.reports < ranks:
            return None
        return len(self.block_ids) if self.failed_from is None else self.failed_from


def kept_under_pin(lease: Lease, corrupt_from: int | None) -> None:
    """The ``Release`` of a load under the scheduler's pin: none here (the scheduler releases
    the pin, naming a failed block, once every worker has reported), so the lease's deadline
    alone decides whether the copy counts (``core.load``)."""
