"""The insight hooks queue on the request path and are tallied off it: per-model lookup counts
and savings appear at a tally (maintenance, Stats, or the queue's bound); with the hooks off
nothing is queued or counted."""

from __future__ import annotations

from node_rig import MakeRig, chain

from tierd.daemon.insight import TALLY_BLOCKS


async def test_lookups_are_counted_at_the_tally_or_the_bound(make_rig: MakeRig) -> None:
    """A 4-block lookup is not counted until the maintenance pass; lookups of TALLY_BLOCKS
    blocks more tally themselves (the last one included)."""
    rig = make_rig()
    hashes = chain(4)
    rig.store(hashes)
    rig.node.lookup(rig.engine.engine_id, hashes)
    assert rig.node.models.lookups() == {("default", "test-model@0"): (0, 0)}
    await rig.node.maintain()
    assert rig.node.models.lookups() == {("default", "test-model@0"): (64, 64)}
    for _ in range(TALLY_BLOCKS // 4):
        rig.node.lookup(rig.engine.engine_id, hashes)
    assert rig.node.models.lookups() == {
        ("default", "test-model@0"): (64 * (1 + TALLY_BLOCKS // 4),) * 2}
    rig.node.check_integrity()


async def test_hooks_off_count_nothing(make_rig: MakeRig) -> None:
    """insight_hooks=False: an acquire with count_lookup counts the node's hit ratio but no
    per-model lookup, saving or sampled block; turned on, the next one is counted."""
    rig = make_rig(insight_hooks=False)
    hashes = chain(2)
    rig.store(hashes)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes, count_lookup=True)
    rig.node.release(lease.lease_id)
    await rig.node.maintain()
    assert rig.node.stats().hit_ratio == 1.0
    assert rig.node.models.lookups() == {("default", "test-model@0"): (0, 0)}
    assert rig.node.insight.savings.rows() == []
    assert rig.node.insight.shards.sampled_blocks == 0
    rig.node.set_insight_hooks(True)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes, count_lookup=True)
    rig.node.release(lease.lease_id)
    await rig.node.maintain()
    assert [r.tokens for r in rig.node.insight.savings.rows()] == [32]
    assert rig.node.insight.shards.sampled_blocks == 2
    rig.node.check_integrity()
