"""The node store's statistics and metrics over a real arena and SSD directory: hit and reuse
counts, the hit-ratio reading, the age histograms and the Prometheus registry of each node."""

from __future__ import annotations

import pytest
from node_rig import MakeRig, Rig, chain, payload  # noqa: E402

from tierd.daemon.metrics import NodeMetrics, NodeStats, TierStats
from tierd.events import BlockRemoved


@pytest.fixture
def rig(make_rig: MakeRig) -> Rig:
    return make_rig()


async def test_reuse_gap_idle_time_and_pool_too_small(rig: Rig) -> None:
    """Fake-clock timeline: a 10 s hit, an eviction after 70 s idle, a re-store 370 s after
    the last use (a ghost) evicting a block idle 370 s: reuse-gap P90 540 s > idle P50 120 s."""
    hashes = chain(8)
    rig.store(hashes)                                          # t = 1000
    rig.clock.advance(10)
    rig.node.release((await rig.node.acquire(rig.engine.engine_id, hashes[:1])).lease_id)
    rig.clock.advance(60)
    rig.store(chain(1, "b"))                                   # evicts 1 (idle 70 s)
    rig.clock.advance(300)
    rig.store(hashes[1:2])                                     # ghost: gap 370 s; evicts 2
    m = rig.node.metrics.registry.get_sample_value
    assert m("tierd_block_reuse_gap_seconds_sum") == 380.0
    assert m("tierd_block_idle_before_evict_seconds_sum") == 440.0
    assert m("tierd_block_lifetime_seconds_sum") == 440.0
    rig.node.lookup(rig.engine.engine_id, hashes[:1])          # a reading needs lookups
    stats = rig.node.stats()
    assert (stats.reuse_gap_p90, stats.idle_before_evict_p50) == (540.0, 120.0)
    assert stats.pool_too_small and stats.tiers["dram"].evictions == 2
    assert stats.reading() == ("hit ratio 1.00: healthy (multi-turn chat / fixed system "
                               "prompt); pool too small (reuse gap P90 > idle-before-evict P50)")
    rig.node.check_integrity()


async def test_a_chain_acquire_counts_each_block_and_touches_it_in_chain_order(rig: Rig) -> None:
    """Blocks 0-1 stored at t=1000 with 4 others, 2-3 at t=1100: acquiring 0-3 at t=1200
    counts reuse gaps 200, 200, 100, 100 and makes the chain newest in chain order, so 5 new
    blocks evict the 4 others, then block 0; the engine then holds a 3-block chain from 1."""
    hashes, others = chain(4), chain(4, "o")
    rig.store(hashes[:2])
    rig.store(others)
    rig.clock.advance(100)
    rig.store(hashes[2:])                                      # DRAM full: 8 blocks
    rig.clock.advance(100)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in hashes]
    rig.node.release(lease.lease_id)
    m = rig.node.metrics.registry.get_sample_value
    assert m("tierd_block_reuse_gap_seconds_sum") == 600.0
    assert m("tierd_block_reuse_gap_seconds_bucket", {"le": "120.0"}) == 2.0
    assert m("tierd_block_reuse_gap_seconds_bucket", {"le": "300.0"}) == 4.0
    rig.node.take_events()
    rig.store(chain(5, "n"))
    assert [e for e in rig.node.take_events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved((*others, hashes[0]), "dram")]  # in eviction order, one event per run
    assert rig.tiers(hashes) == [] and rig.tiers(hashes[1:]) == ["dram"] * 3
    rig.node.check_integrity()


async def test_metrics_live_in_the_nodes_own_registry(rig: Rig) -> None:
    """Counters and gauges carry the documented names; a second store's registry is separate."""
    hashes = chain(8)
    rig.store(hashes)
    rig.tiers(hashes + chain(2, "miss"))
    await rig.node.maintain()
    rig.node.release((await rig.node.acquire(rig.engine.engine_id, hashes[:1])).lease_id)
    rig.node.metrics.rpc_latency.labels("Lookup").observe(0.0004)
    m = rig.node.metrics.registry.get_sample_value
    assert m("tierd_prefix_cache_queries_total") == 10 * 16
    assert m("tierd_prefix_cache_hits_total", {"tier": "dram"}) == 8 * 16
    assert m("tierd_demotions_total") == 2.0 and m("tierd_promotions_total") == 1.0
    assert m("tierd_tier_used_blocks", {"tier": "dram"}) == 6.0       # as of maintain
    assert m("tierd_tier_occupancy_ratio", {"tier": "dram"}) == 0.75
    assert m("tierd_tier_used_blocks", {"tier": "ssd"}) == 2.0
    assert m("tierd_ssd_healthy") == 1.0
    assert m("tierd_rpc_latency_seconds_count", {"method": "Lookup"}) == 1.0
    assert m("tierd_block_reuse_gap_seconds_count") == 1.0
    assert rig.node.stats().hit_ratio == 0.8
    assert NodeMetrics().registry.get_sample_value("tierd_prefix_cache_queries_total") == 0.0
    rig.node.check_integrity()


async def test_prometheus_counters_read_the_stats_totals(rig: Rig) -> None:
    """The scraped counters are the node's one set of totals: after evictions, demotions,
    promotions and an expired lease, each equals what ``stats()`` reports."""
    hashes = chain(12)
    rig.store(hashes[:8])
    await rig.node.maintain()                                   # 0, 1 -> SSD
    rig.store(hashes[8:12])                                     # DRAM full: evicts
    lease = await rig.node.acquire(rig.engine.engine_id, hashes[:1])   # promotes 0
    rig.clock.advance(31)
    rig.node.stats()                                            # expires the lease
    stats = rig.node.stats()
    m = rig.node.metrics.registry.get_sample_value
    for tier in ("dram", "ssd"):
        assert m("tierd_evictions_total", {"tier": tier}) == stats.tiers[tier].evictions or (
            m("tierd_evictions_total", {"tier": tier}) is None
            and stats.tiers[tier].evictions == 0)
    assert m("tierd_demotions_total") == stats.tiers["dram"].demotions == 2
    assert m("tierd_promotions_total") == stats.tiers["ssd"].promotions == 1
    assert stats.tiers["dram"].evictions > 0
    assert m("tierd_lease_expiries_total", {"kind": "read"}) == stats.lease_expiries == 1
    assert lease.slot_ids
    rig.node.check_integrity()


def _stats(hit_ratio: float, queries: int = 160) -> NodeStats:
    tier = TierStats(0, 0, 0, 0, 0, 0, queries, 0, 0, 0)
    return NodeStats({"dram": tier}, {}, 0, 0, True, hit_ratio, None, None)


@pytest.mark.parametrize("ratio, words", [
    (0.8, "healthy"), (0.5, "check prompt template order"), (0.2, "low"),
    (0.05, "check routing"),
])
def test_reading_says_what_the_ratio_means(ratio: float, words: str) -> None:
    """> 0.7 healthy; 0.3-0.7 template order; < 0.1 routing, pool size, timestamps."""
    assert words in _stats(ratio).reading()
    assert _stats(0.0, queries=0).reading() == "no lookups yet"
    assert "timestamps" in _stats(0.05).reading() and "pool size" in _stats(0.05).reading()


def test_histogram_quantile_interpolates_within_a_bucket() -> None:
    """One 10 s observation: P50 7.5 (middle of (5, 10]); nothing observed: None."""
    metrics = NodeMetrics()
    assert metrics.reuse_gap.quantile(0.5) is None
    metrics.reuse_gap.observe(10)
    assert metrics.reuse_gap.quantile(0.5) == 7.5
    metrics.reuse_gap.observe(10 ** 6)                  # past the last finite bucket
    assert metrics.reuse_gap.quantile(0.99) == 86400
    m = metrics.registry.get_sample_value
    assert m("tierd_block_reuse_gap_seconds_bucket", {"le": "10.0"}) == 1.0
    assert m("tierd_block_reuse_gap_seconds_bucket", {"le": "+Inf"}) == 2.0
    assert m("tierd_block_reuse_gap_seconds_count") == 2.0


def test_histogram_observe_many_counts_like_one_observe_each() -> None:
    """A batch with runs of equal values and a negative one counts exactly as one observe per
    value, the negative as 0."""
    one, many = NodeMetrics(), NodeMetrics()
    values = [5.0, 5.0, 5.0, 100.0, -1.0, 100.0, 7200.5, 5.0]
    for value in values:
        one.reuse_gap.observe(max(0.0, value))
    many.reuse_gap.observe_many(values)
    assert (many.reuse_gap.counts, many.reuse_gap.sum) == (one.reuse_gap.counts, one.reuse_gap.sum)
    assert sum(many.reuse_gap.counts) == len(values)
