"""What the node store takes and returns: its config, engine records and RPC results.

Plain frozen values, shared by ``tierd.daemon.node`` (which produces them) and the gRPC edge
(which converts them to protobuf). No behaviour beyond validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierd.daemon.quotas import TenantQuotas
from tierd.types import Namespace, Tier
from tierd.wire.geometry import SlotGeometry
from tierd.wire.layout import Layout


@dataclass(frozen=True, slots=True)
class EngineCaps:
    """Bounds of the engine table (each is a config key of `tierd serve`)."""

    idle_seconds: float = 600.0      # engine_idle_seconds: silent this long -> unregistered
    max_per_tenant: int = 256        # max_engines_per_tenant
    max_name_bytes: int = 256        # max_name_bytes: engine_name and other names

    def validate(self) -> None:
        """ValueError naming the key to fix."""
        if not self.idle_seconds > 0:
            raise ValueError(f"engine_idle_seconds must be > 0, got {self.idle_seconds}")
        for key, value in (("max_engines_per_tenant", self.max_per_tenant),
                           ("max_name_bytes", self.max_name_bytes)):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """The store's policy knobs (the daemon's TierdConfig passes these through)."""

    lease_seconds: float = 30.0
    dram_high_watermark: float = 0.90    # fraction of arena bytes; maintain demotes above it
    dram_low_watermark: float = 0.75     # ... until at or below this
    ssd_min_hits: int = 0                # acquires a block needs to be demoted (else evicted)
    max_blocks_per_request: int = 4096   # more: ResourceExhausted
    blank_fraction: float = 0.25         # most of the arena's bytes in blank slots, all engines
    hbm_max_blocks_per_engine: int = 1_000_000  # past it, the oldest reported hashes are dropped
    ghost_entries: int = 65_536          # evicted keys remembered to measure reuse gaps
    write_behind_seconds: float = 2.0    # committed blocks reach SSD within about this; 0 = off
    stop_flush_seconds: float = 10.0     # close(): budget for writing DRAM-only blocks to SSD
    write_batch_bytes: int = 8 << 20     # most bytes of one write-behind / flush SSD write
    event_log_events: int = 100_000      # ring of take_events(); 0 = keep none (nobody drains)
    max_models: int = 1024               # models.json entries (more only while engines hold them)
    max_leases_per_engine: int = 1024    # live leases of one engine; more: ResourceExhausted
    max_leases: int = 16_384             # live leases of all engines; more: ResourceExhausted
    max_lease_keys: int = 1 << 18        # blocks named by all live leases; more: ResourceExhausted
    min_block_bytes: int = 1024          # smaller layouts: ValueError at registration
    max_size_classes: int = 64           # block sizes in use at once; more: ResourceExhausted
    recompute_tokens_per_second: float = 10_000.0  # prefill speed where no engine reports one
    insight_hooks: bool = True           # feed the what-if sampler, savings, per-model counts
    engines: EngineCaps = field(default_factory=EngineCaps)  # idle lapse and registration caps
    tenant_quotas: TenantQuotas = field(default_factory=TenantQuotas)  # none: plain LRU

    def validate(self) -> None:
        """ValueError naming the field to fix."""
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")
        if self.engines.idle_seconds < self.lease_seconds:
            raise ValueError(f"engine_idle_seconds ({self.engines.idle_seconds}) must be >= "
                             f"lease_seconds ({self.lease_seconds}): unregistering an idle engine "
                             "ends its leases, and engines trust a lease until its deadline")
        if not 0.0 < self.dram_low_watermark <= self.dram_high_watermark <= 1.0:
            raise ValueError("watermarks need 0 < dram_low_watermark <= dram_high_watermark <= 1,"
                             f" got {self.dram_low_watermark} and {self.dram_high_watermark}")
        for name in ("max_blocks_per_request", "hbm_max_blocks_per_engine", "ghost_entries",
                     "max_models", "max_leases_per_engine", "max_leases", "min_block_bytes",
                     "max_size_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_lease_keys < self.max_blocks_per_request:
            raise ValueError(f"max_lease_keys ({self.max_lease_keys}) must be >= "
                             f"max_blocks_per_request ({self.max_blocks_per_request}): one "
                             "lease of a full request must fit")
        if not 0.0 <= self.blank_fraction <= 1.0:
            raise ValueError(f"blank_fraction must be in [0, 1], got {self.blank_fraction}")
        if self.ssd_min_hits < 0:
            raise ValueError(f"ssd_min_hits must be >= 0, got {self.ssd_min_hits}")
        for name in ("write_behind_seconds", "stop_flush_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.event_log_events < 0:
            raise ValueError(f"event_log_events must be >= 0, got {self.event_log_events}")
        if not self.recompute_tokens_per_second > 0:
            raise ValueError("recompute_tokens_per_second must be > 0, got "
                             f"{self.recompute_tokens_per_second}")
        if self.write_batch_bytes < 1:
            raise ValueError(f"write_batch_bytes must be >= 1, got {self.write_batch_bytes}")
        self.engines.validate()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """A registered engine: its namespace and where its blocks lie in the arena."""

    engine_id: str
    tenant: str
    namespace: Namespace
    layout: Layout
    geometry: SlotGeometry
    name: str = ""             # engine_name given at registration (shown by `tierd stats`)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Tier of each hash of the longest consecutive prefix held (fastest tier first: "hbm" if
    the calling engine reported it in its GPU pool)."""

    tiers: list[Tier]

    @property
    def num_hit_blocks(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True, slots=True)
class Lease:
    """A read lease: ``slot_ids[i]`` holds prefix block i in the arena, pinned until ``release``
    or ``deadline`` (the store's clock); ``ttl_seconds`` is the time left at issue (for the
    wire). Verify ``checksums[i]`` after copying out."""

    lease_id: str
    deadline: float
    slot_ids: list[int]
    checksums: list[int]
    ttl_seconds: float = 0.0
    held_after: list[Tier] = field(default_factory=list)  # probe: the held rest's tiers


@dataclass(frozen=True, slots=True)
class Reservation:
    """A write lease: copy block i into ``slot_ids[i]`` then ``commit``; None where nothing is to
    be written (``already_stored[i]``, or no room, or another engine is writing it now)."""

    lease_id: str
    deadline: float
    slot_ids: list[int | None]
    already_stored: list[bool]
    ttl_seconds: float = 0.0
