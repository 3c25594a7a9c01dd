"""The plain values a ``TierdClient`` caller receives (frozen dataclasses, no protobuf): what
RegisterEngine, Acquire, Reserve, Locate and Stats answered. The daemon builds the Stats rows
(``ModelUsage``, ``TenantUsage``, ``Saved``, ``Curve``) from these same types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tierd.types import Placement, Tier
from tierd.wire.geometry import SlotGeometry

SCALES: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Sizes the curves are given at, as multiples of each tier's current size."""


@dataclass(frozen=True, slots=True)
class EngineHandle:
    """What RegisterEngine returned: the engine's id and how to reach its blocks in the arena."""

    engine_id: str
    arena_name: str             # file name to ShmArena.attach
    arena_directory: str        # directory of that file
    arena_bytes: int
    geometry: SlotGeometry      # slot id -> arena offset for this layout's block size
    lease_seconds: float        # lifetime of leases and reservations
    max_blocks_per_request: int
    presence_name: str = ""     # presence filter file in arena_directory ("" = none)
    namespace: bytes = b""      # this engine's key prefix in the presence filter


@dataclass(frozen=True, slots=True)
class Located:
    """What Locate answered: the nodes holding a prefix of the chain, best first, and whether
    the directory was stale (Redis unreachable: ``nodes`` is then empty and means nothing)."""

    nodes: list[Placement]
    stale: bool


@dataclass(frozen=True, slots=True)
class AcquiredBlocks:
    """A pinned prefix: copy each slot out, verify its checksum, then ``release`` the lease
    before ``seconds_left`` runs out (after that the blocks may be evicted under you)."""

    lease_id: str
    seconds_left: float
    slot_ids: list[int]         # DRAM slot of each block of the prefix, chain order
    checksums: list[int]        # block_checksum of each block
    held_after: list[Tier] = field(default_factory=list)  # dram_run_only: the rest held

    @property
    def num_blocks(self) -> int:
        """Blocks of the acquired prefix (0: a miss)."""
        return len(self.slot_ids)


@dataclass(frozen=True, slots=True)
class ReservedSlots:
    """Slots to write blocks into; ``commit`` (or ``abort``) before ``seconds_left`` runs out."""

    lease_id: str
    seconds_left: float
    slot_ids: list[int | None]  # per requested hash: where to write, or None (see already_stored)
    already_stored: list[bool]  # True: the node holds it already; None slot + False: no room


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Occupancy and counters of one tier."""

    tier: Tier
    used_blocks: int
    capacity_blocks: int
    used_bytes: int
    capacity_bytes: int
    pinned_blocks: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    demotions: int
    promotions: int


@dataclass(frozen=True, slots=True)
class EngineUsage:
    """One engine of the caller's tenant and its GPU-pool (HBM) occupancy."""

    engine_id: str
    engine_name: str
    hbm_blocks: int
    block_size: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class DaemonStats:
    """The reply of Stats, as plain values."""

    tiers: list[TierUsage]
    engines: list[EngineUsage]
    models: list[ModelUsage]
    """The caller's tenant's models, most bytes first."""
    query_tokens: int
    hit_tokens: int
    hit_ratio: float
    reading: str
    checksum_failures: int
    lease_expiries: int
    ssd_healthy: bool
    reuse_gap_p90_seconds: float | None
    idle_before_evict_p50_seconds: float | None
    tenants: list[TenantUsage] = field(default_factory=list)
    """Use against quota: the caller's tenant's row (every tenant's for the admin token)."""
    savings: list[Saved] = field(default_factory=list)
    """Prefill served per tenant, model and tier (the caller's tenant's; all for the admin)."""
    what_if: list[Curve] = field(default_factory=list)
    """What-if curves per tier: every lookup's, then per model (as ``savings``)."""

    @property
    def pool_too_small(self) -> bool:
        """True when blocks are reused later than they typically survive unused: the reuse-gap
        P90 exceeds the idle-before-evict P50, so a bigger pool would turn misses into hits."""
        gap, idle = self.reuse_gap_p90_seconds, self.idle_before_evict_p50_seconds
        return gap is not None and idle is not None and gap > idle


@dataclass(frozen=True, slots=True)
class ModelUsage:
    """One model's share of the node (its tenant's namespaces of that model id, summed)."""

    model_id: str
    blocks: dict[Tier, int]
    """Blocks per tier ("hbm": summed over the engines that report them)."""
    bytes: dict[Tier, int]
    query_tokens: int
    hit_tokens: int
    engines: int
    """Engines of this model registered now."""


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's row of ``tierd stats``: what it uses and holds against its quota. Bytes;
    ``*_quota`` None where it has no bound."""

    tenant: str
    dram_bytes: int
    dram_quota: int | None
    ssd_bytes: int
    ssd_quota: int | None
    pinned_bytes: int
    reserved_bytes: int
    """Slots of its write leases, blank ones included (counted in ``dram_bytes`` too)."""
    blank_bytes: int
    limited: int
    """Requests the quota cut short or refused since start-up."""


# -- the ledger -----------------------------------------------------------------------------------


SpeedSource = Literal["reported", "planner"]
"""Where a prefill speed comes from: an engine's report, or ``recompute_tokens_per_second``."""


@dataclass(frozen=True, slots=True)
class Saved:
    """One (tenant, model, tier) row: prefill tokens served from the tier, seconds saved, and
    the prefill speed (tokens per second) its latest tokens were counted at, with its source."""

    tenant: str
    model_id: str
    tier: Tier
    tokens: int
    seconds: float
    tokens_per_second: float = 0.0
    speed_source: SpeedSource = "planner"


@dataclass(frozen=True, slots=True)
class Curve:
    """One tier's (and label's) what-if curve: ``hit_ratios[i]`` at ``SCALES[i]`` times the
    tier's ``capacity_blocks``; ``flattens_at``: the smallest of the scales under 8x past
    which the curve gains less than one percentage point up to 8x (None: it still climbs
    between 4x and 8x)."""

    tier: Tier
    tenant: str
    model_id: str
    capacity_blocks: int
    hit_ratios: tuple[float, ...]
    flattens_at: float | None
    references: float           # estimated block references behind it (sampled / rate)
