"""``Explainer`` (``NodeStore.why``): where each block of a chain lives and why the first missing
one misses: evicted (ghost list: when, tier, pressure), held under another namespace of the same
tenant (what differs), or never stored; never another tenant's blocks."""

from __future__ import annotations

from dataclasses import replace

from node_rig import LAYOUT, MakeRig, chain

from tierd.daemon.why import Variant


async def test_blocks_by_place_and_eviction_under_room(make_rig: MakeRig) -> None:
    """8 blocks fill the 8-slot arena; 8 more evict them for room 5 s later: the answer names
    DRAM for the held chain, HBM for the reported block, and for the first chain block 0
    evicted 2 s ago from DRAM, 5 s idle, pressure "room"."""
    rig = make_rig()
    first, second = chain(8, "a"), chain(8, "b")
    rig.store(first)
    rig.clock.advance(5)
    rig.store(second)
    rig.node.report_hbm(rig.engine.engine_id, second[:1], [])
    rig.clock.advance(2)
    held = rig.node.insight.why.explain("default", LAYOUT, second)
    assert held.first_miss == 8 and held.evicted is None and held.namespace_blocks == 9
    assert [(b.hbm_engines, b.dram, b.ssd) for b in held.blocks[:2]] == [
        ((rig.engine.engine_id,), True, False), ((), True, False)]
    gone = rig.node.insight.why.explain("default", LAYOUT, first)
    assert gone.first_miss == 0 and gone.evicted is not None and gone.elsewhere == []
    assert (gone.evicted.seconds_ago, gone.evicted.idle_seconds, gone.evicted.tier,
            gone.evicted.pressure) == (2.0, 5.0, "dram", "room")
    rig.node.check_integrity()


async def test_admission(make_rig: MakeRig) -> None:
    """With ssd_min_hits 1 a demotion of never-hit blocks keeps no SSD copy: "admission"."""
    rig = make_rig(ssd_min_hits=1, dram_high_watermark=0.5, dram_low_watermark=0.25)
    cold = chain(6, "cold")
    rig.store(cold)
    await rig.node.maintain()
    answer = rig.node.insight.why.explain("default", LAYOUT, cold)
    assert answer.first_miss == 0 and answer.evicted is not None
    assert (answer.evicted.tier, answer.evicted.pressure) == ("dram", "admission")
    assert answer.ssd_min_hits == 1
    rig.node.check_integrity()


async def test_ssd_room(make_rig: MakeRig) -> None:
    """Blocks that reached SSD and were pushed out of its 4 records: "ssd_room" from SSD."""
    rig = make_rig(dram_high_watermark=0.5, dram_low_watermark=0.25)
    old, new = chain(4, "old"), chain(4, "new")
    for hashes in (old, new):
        rig.store(hashes)
        await rig.node.write_behind()
        await rig.node.maintain()
    rig.store(chain(4, "newer"))
    await rig.node.write_behind()
    answer = rig.node.insight.why.explain("default", LAYOUT, old)
    assert answer.evicted is not None and answer.first_miss == 0
    assert (answer.evicted.tier, answer.evicted.pressure) == ("ssd", "ssd_room")
    rig.node.check_integrity()


async def test_other_model_and_other_hashing_of_the_same_tenant(make_rig: MakeRig) -> None:
    """The chain stored by an engine of another model is found there, naming its model id; a
    chain hashed another way (a variant) is found under the question's own namespace, naming
    the variant; the longest holding comes first."""
    rig = make_rig()
    tuned = rig.node.register_engine("default", replace(LAYOUT, model_id="tuned@1"), "tuned")
    prompt, salted = chain(3, "p"), chain(3, "salted")
    rig.store(prompt[:2], engine=tuned)
    rig.store(salted)
    answer = rig.node.insight.why.explain("default", LAYOUT, prompt,
                                  [Variant("no cache_salt", 16, salted)])
    assert answer.first_miss == 0 and answer.evicted is None
    assert [(e.model_id, e.differs, e.tokens) for e in answer.elsewhere] == [
        ("test-model@0", ("no cache_salt",), 48), ("tuned@1", ("model_id tuned@1",), 32)]
    rig.node.check_integrity()


async def test_another_tenant_is_never_searched(make_rig: MakeRig) -> None:
    """Tenant "b" stores the prompt under the same layout and another model: tenant "default"
    asking about it sees a plain never-stored miss (nothing in its namespace, nothing
    elsewhere), even with b's chain as a variant; "b" itself sees its blocks."""
    rig = make_rig()
    other = rig.node.register_engine("b", LAYOUT, "b")
    other_model = rig.node.register_engine("b", replace(LAYOUT, model_id="b-model@2"), "b2")
    prompt = chain(2, "p")
    rig.store(prompt, engine=other)
    rig.store(prompt, engine=other_model)
    answer = rig.node.insight.why.explain("default", LAYOUT, prompt,
                                          [Variant("algo x", 16, prompt)])
    assert (answer.first_miss, answer.evicted, answer.elsewhere, answer.namespace_blocks) == (
        0, None, [], 0)
    assert rig.node.insight.why.explain("b", LAYOUT, prompt).first_miss == 2
    rig.node.check_integrity()


async def test_ghost_list_is_bounded_and_forgets_a_restored_block(make_rig: MakeRig) -> None:
    """ghost_entries 4: after 8 evictions only the last 4 are remembered; a remembered block
    stored again is no longer a ghost."""
    rig = make_rig(ghost_entries=4)
    first = chain(8, "a")
    rig.store(first)
    rig.store(chain(8, "b"))
    assert len(rig.node.insight.why.explain("default", LAYOUT, first).blocks) == 8
    why = rig.node.insight.why
    evicted = [why.explain("default", LAYOUT, [h]).evicted is not None for h in first]
    assert evicted == [False] * 4 + [True] * 4
    rig.store(first[7:])
    assert rig.node.insight.why.explain("default", LAYOUT, first[7:]).evicted is None
    rig.node.check_integrity()
