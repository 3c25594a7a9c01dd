"""Protobuf conversion at the edge: ``from_pb`` / ``to_pb`` for the daemon and its clients.

The core (``NodeStore``) never sees a protobuf type, and neither does a ``TierdClient`` caller:
the server converts requests into domain values here and results back; the client converts its
replies into the plain frozen dataclasses of ``replies``. Bad wire input (a hash of the wrong
length, an unknown tier) raises ``ValueError`` naming the fix, which the edge maps to
INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from tierd.types import HASH_LENGTHS, TIERS, BlockHash, Placement, Tier
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.geometry import SlotGeometry
from tierd.wire.layout import Layout
from tierd.wire.replies import (
    SCALES,
    AcquiredBlocks,
    Curve,
    DaemonStats,
    EngineHandle,
    EngineUsage,
    Located,
    ModelUsage,
    ReservedSlots,
    Saved,
    TenantUsage,
    TierUsage,
)

if TYPE_CHECKING:
    from tierd.daemon.metrics import NodeStats
    from tierd.daemon.node_types import EngineInfo
    from tierd.wire.layout import Dtype

TIER_TO_PB: dict[Tier, pb.Tier] = {
    "hbm": pb.TIER_HBM, "dram": pb.TIER_DRAM, "ssd": pb.TIER_SSD, "remote": pb.TIER_REMOTE,
}
TIER_FROM_PB: dict[int, Tier] = {int(v): k for k, v in TIER_TO_PB.items()}


# -- both sides ----------------------------------------------------------------------------

def hashes_from_pb(raw: Sequence[bytes]) -> list[BlockHash]:
    """Wire hashes (a repeated ``bytes`` field: its items are ``bytes`` already) ->
    ``BlockHash``es; ``ValueError`` unless all are 32 or all are 16 bytes."""
    hashes = cast("list[BlockHash]", list(raw))
    if not hashes:
        return hashes
    size = len(hashes[0])
    if size not in HASH_LENGTHS or len(set(map(len, hashes))) != 1:
        bad = next(i for i, h in enumerate(hashes) if len(h) not in HASH_LENGTHS or len(h) != size)
        raise ValueError(f"block hash {bad} is {len(hashes[bad])} bytes: every hash of a request "
                         "must be 32 bytes (sha256_cbor) or every hash 16 bytes (xxhash_cbor)")
    return hashes


def layout_to_pb(layout: Layout) -> pb.Layout:
    return pb.Layout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                     head_size=layout.head_size, dtype=layout.dtype,
                     block_size=layout.block_size, tp_rank=layout.tp_rank,
                     tp_size=layout.tp_size, kv_format=layout.kv_format,
                     model_id=layout.model_id)


def layout_from_pb(msg: pb.Layout) -> Layout:
    """Wire layout -> validated ``Layout`` (tp_size 0 means 1); ``ValueError`` naming the fix."""
    layout = Layout(num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
                    head_size=msg.head_size, dtype=cast("Dtype", msg.dtype),
                    block_size=msg.block_size, tp_rank=msg.tp_rank, tp_size=msg.tp_size or 1,
                    kv_format=msg.kv_format, model_id=msg.model_id)
    layout.validate()
    return layout


def geometry_to_pb(geometry: SlotGeometry) -> pb.SlotGeometry:
    return pb.SlotGeometry(slab_bytes=geometry.slab_bytes, slot_bytes=geometry.slot_bytes,
                           slots_per_slab=geometry.slots_per_slab)


def geometry_from_pb(msg: pb.SlotGeometry) -> SlotGeometry:
    return SlotGeometry(slab_bytes=msg.slab_bytes, slot_bytes=msg.slot_bytes,
                        slots_per_slab=msg.slots_per_slab)


def tiers_to_pb(tiers: Sequence[Tier]) -> list[pb.Tier]:
    return [TIER_TO_PB[t] for t in tiers]


def tiers_from_pb(raw: Sequence[int]) -> list[Tier]:
    if any(t not in TIER_FROM_PB for t in raw):
        raise ValueError(f"unknown tier value in {list(raw)}: regenerate the client stubs")
    return [TIER_FROM_PB[t] for t in raw]


def reserved_to_pb(slot_ids: Sequence[int | None],
                   already: Sequence[bool]) -> list[pb.ReservedSlot]:
    return [pb.ReservedSlot(already_stored=a) if s is None else
            pb.ReservedSlot(slot_id=s, already_stored=a) for s, a in zip(slot_ids, already)]


U64_MAX = (1 << 64) - 1
"""Counters past it are sent saturated (a uint64 field cannot carry more)."""


def _u64(value: int) -> int:
    return min(max(value, 0), U64_MAX)


def _u64_or_none(value: int | None) -> int | None:
    return None if value is None else _u64(value)


def stats_to_pb(stats: NodeStats, engines: Sequence[EngineInfo],
                models: Sequence[ModelUsage] = (),
                tenants: Sequence[TenantUsage] = ()) -> pb.StatsResponse:
    """A node snapshot as the Stats reply, tiers fastest first; ``engines``, ``models`` and
    ``tenants`` (the caller's tenant's) limit the per-engine, per-model and per-tenant rows, so
    a tenant never sees another's engine ids, models or usage. Counters saturate at 2^64 - 1
    rather than fail the reply."""
    tiers = [pb.TierStats(tier=TIER_TO_PB[cast(Tier, name)], used_blocks=t.used_blocks,
                          capacity_blocks=t.capacity_blocks, used_bytes=t.used_bytes,
                          capacity_bytes=t.capacity_bytes, pinned_blocks=t.pinned_blocks,
                          query_tokens=_u64(t.queries), hit_tokens=_u64(t.hits),
                          evictions=_u64(t.evictions), demotions=_u64(t.demotions),
                          promotions=_u64(t.promotions))
             for name, t in sorted(stats.tiers.items(), key=lambda kv: TIERS.index(kv[0]))]
    rows = [pb.EngineStats(engine_id=e.engine_id, engine_name=e.name,
                           hbm_blocks=stats.hbm_blocks.get(e.engine_id, 0),
                           block_size=e.layout.block_size, block_bytes=e.layout.block_bytes)
            for e in engines]
    queries = max((t.queries for t in stats.tiers.values()), default=0)
    hits = sum(t.hits for t in stats.tiers.values())
    per_model = [pb.ModelStats(model_id=m.model_id, dram_blocks=m.blocks["dram"],
                               dram_bytes=_u64(m.bytes["dram"]), ssd_blocks=m.blocks["ssd"],
                               ssd_bytes=_u64(m.bytes["ssd"]), hbm_blocks=m.blocks["hbm"],
                               hbm_bytes=_u64(m.bytes["hbm"]),
                               query_tokens=_u64(m.query_tokens), hit_tokens=_u64(m.hit_tokens),
                               engines=m.engines) for m in models]
    per_tenant = [pb.TenantStats(tenant=t.tenant, dram_bytes=_u64(t.dram_bytes),
                                 dram_quota_bytes=_u64_or_none(t.dram_quota),
                                 ssd_bytes=_u64(t.ssd_bytes),
                                 ssd_quota_bytes=_u64_or_none(t.ssd_quota),
                                 pinned_bytes=_u64(t.pinned_bytes),
                                 reserved_bytes=_u64(t.reserved_bytes),
                                 blank_bytes=_u64(t.blank_bytes),
                                 limited_requests=_u64(t.limited)) for t in tenants]
    reply = pb.StatsResponse(tiers=tiers, engines=rows, models=per_model, tenants=per_tenant,
                             query_tokens=_u64(queries),
                             hit_tokens=_u64(hits), hit_ratio=stats.hit_ratio,
                             reading=stats.reading(),
                             checksum_failures=_u64(stats.checksum_failures),
                             lease_expiries=_u64(stats.lease_expiries),
                             ssd_healthy=stats.ssd_healthy)
    if stats.reuse_gap_p90 is not None:
        reply.reuse_gap_p90_seconds = stats.reuse_gap_p90
    if stats.idle_before_evict_p50 is not None:
        reply.idle_before_evict_p50_seconds = stats.idle_before_evict_p50
    return reply


def locate_to_pb(placements: Sequence[Placement], stale: bool) -> pb.LocateResponse:
    return pb.LocateResponse(stale=stale, nodes=[pb.NodePlacement(
        node_id=p.node_id, address=p.address, prefix_blocks=p.prefix_blocks,
        tiers=tiers_to_pb(p.tiers), score=p.score, capacity_bytes=p.capacity_bytes,
        heartbeat_age_seconds=p.heartbeat_age_s) for p in placements])


# -- client side: replies -> plain values -------------------------------------------------------

def engine_handle_from_pb(msg: pb.RegisterEngineResponse) -> EngineHandle:
    return EngineHandle(engine_id=msg.engine_id, arena_name=msg.arena_name,
                        arena_directory=msg.arena_directory, arena_bytes=msg.arena_bytes,
                        geometry=geometry_from_pb(msg.geometry), lease_seconds=msg.lease_seconds,
                        max_blocks_per_request=msg.max_blocks_per_request,
                        presence_name=msg.presence_name, namespace=msg.namespace)


def acquired_from_pb(msg: pb.AcquireResponse) -> AcquiredBlocks:
    return AcquiredBlocks(lease_id=msg.lease_id, seconds_left=msg.seconds_left,
                          slot_ids=msg.slot_ids[:], checksums=msg.checksums[:],  # new lists
                          held_after=tiers_from_pb(msg.held_after))


def reserved_from_pb(msg: pb.ReserveResponse) -> ReservedSlots:
    return ReservedSlots(lease_id=msg.lease_id, seconds_left=msg.seconds_left,
                         slot_ids=[s.slot_id if s.HasField("slot_id") else None for s in msg.slots],
                         already_stored=[s.already_stored for s in msg.slots])


def located_from_pb(msg: pb.LocateResponse) -> Located:
    return Located(nodes=[Placement(
        node_id=n.node_id, address=n.address, prefix_blocks=n.prefix_blocks,
        tiers=tuple(tiers_from_pb(n.tiers)), score=n.score, capacity_bytes=n.capacity_bytes,
        heartbeat_age_s=n.heartbeat_age_seconds) for n in msg.nodes], stale=msg.stale)


def stats_from_pb(msg: pb.StatsResponse) -> DaemonStats:
    tiers = [TierUsage(tier=TIER_FROM_PB[t.tier], used_blocks=t.used_blocks,
                       capacity_blocks=t.capacity_blocks, used_bytes=t.used_bytes,
                       capacity_bytes=t.capacity_bytes, pinned_blocks=t.pinned_blocks,
                       query_tokens=t.query_tokens, hit_tokens=t.hit_tokens,
                       evictions=t.evictions, demotions=t.demotions, promotions=t.promotions)
             for t in msg.tiers]
    engines = [EngineUsage(engine_id=e.engine_id, engine_name=e.engine_name,
                           hbm_blocks=e.hbm_blocks, block_size=e.block_size,
                           block_bytes=e.block_bytes) for e in msg.engines]
    models = [ModelUsage(m.model_id, {"hbm": m.hbm_blocks, "dram": m.dram_blocks,
                                      "ssd": m.ssd_blocks},
                         {"hbm": m.hbm_bytes, "dram": m.dram_bytes, "ssd": m.ssd_bytes},
                         m.query_tokens, m.hit_tokens, m.engines) for m in msg.models]
    gap = msg.reuse_gap_p90_seconds if msg.HasField("reuse_gap_p90_seconds") else None
    idle = (msg.idle_before_evict_p50_seconds if msg.HasField("idle_before_evict_p50_seconds")
            else None)
    return DaemonStats(tiers=tiers, engines=engines, models=models, query_tokens=msg.query_tokens,
                       hit_tokens=msg.hit_tokens, hit_ratio=msg.hit_ratio, reading=msg.reading,
                       checksum_failures=msg.checksum_failures, lease_expiries=msg.lease_expiries,
                       ssd_healthy=msg.ssd_healthy, reuse_gap_p90_seconds=gap,
                       idle_before_evict_p50_seconds=idle,
                       tenants=[TenantUsage(
                           t.tenant, t.dram_bytes,
                           t.dram_quota_bytes if t.HasField("dram_quota_bytes") else None,
                           t.ssd_bytes, t.ssd_quota_bytes if t.HasField("ssd_quota_bytes")
                           else None, t.pinned_bytes, t.reserved_bytes, t.blank_bytes,
                           t.limited_requests) for t in msg.tenants],
                       savings=[Saved(s.tenant, s.model_id, TIER_FROM_PB[s.tier], s.tokens,
                                      s.seconds, s.prefill_tokens_per_second,
                                      "reported" if s.speed_reported else "planner")
                                for s in msg.savings],
                       what_if=[Curve(TIER_FROM_PB[c.tier], c.tenant, c.model_id,
                                      c.capacity_blocks, tuple(c.hit_ratios),
                                      c.flattens_at_scale if c.HasField("flattens_at_scale")
                                      else None, c.references) for c in msg.what_if])


def curves_to_pb(curves: Sequence[Curve]) -> list[pb.WhatIfCurve]:
    return [pb.WhatIfCurve(tier=TIER_TO_PB[c.tier], tenant=c.tenant,
                           model_id=c.model_id, capacity_blocks=c.capacity_blocks,
                           scales=SCALES, hit_ratios=c.hit_ratios,
                           flattens_at_scale=c.flattens_at, references=c.references)
            for c in curves]


def savings_to_pb(rows: Sequence[Saved]) -> list[pb.SavingsStats]:
    return [pb.SavingsStats(tenant=r.tenant, model_id=r.model_id, tier=TIER_TO_PB[r.tier],
                            tokens=_u64(r.tokens), seconds=r.seconds,
                            prefill_tokens_per_second=r.tokens_per_second,
                            speed_reported=r.speed_source == "reported") for r in rows]
