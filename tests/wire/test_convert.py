"""Protobuf conversion at the edge: counters past uint64 saturate instead of failing Stats."""

from __future__ import annotations

from tierd.daemon.metrics import NodeStats, TierStats
from tierd.wire.convert import U64_MAX, stats_from_pb, stats_to_pb


def test_stats_counters_past_uint64_saturate() -> None:
    """A node whose query and hit counters passed 2^64 still answers Stats: they read
    2^64 - 1 and the reply round-trips."""
    big = 1 << 70
    tiers = {"dram": TierStats(1, 2, 3, 4, 0, big, big, big, 0, 0),
             "ssd": TierStats(0, 0, 0, 0, 0, 5, big, 0, 0, 0)}
    stats = NodeStats(tiers=tiers, hbm_blocks={}, checksum_failures=big, lease_expiries=0,
                      ssd_healthy=True, hit_ratio=1.0, reuse_gap_p90=None,
                      idle_before_evict_p50=None)
    reply = stats_from_pb(type(stats_to_pb(stats, [])).FromString(
        stats_to_pb(stats, []).SerializeToString()))
    assert (reply.query_tokens, reply.hit_tokens, reply.checksum_failures) == (U64_MAX,) * 3
    assert reply.tiers[0].query_tokens == reply.tiers[0].evictions == U64_MAX
    assert reply.tiers[1].hit_tokens == 5
