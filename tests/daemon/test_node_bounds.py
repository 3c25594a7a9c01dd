"""The node store's tables stay within their stated bounds (docs/daemon.md, "Bounds"): live
leases per engine and in total, blocks named by leases, size classes, the smallest block;
reservations that hold no slot keep nothing; each test ends with ``check_integrity``."""

from __future__ import annotations

import pytest
from node_rig import BLOCK, LAYOUT, MakeRig, Rig, chain, payload  # noqa: E402

from tierd.checksum import block_checksum
from tierd.daemon.errors import ResourceExhausted
from tierd.daemon.node import EMPTY_LEASE, EngineInfo
from tierd.wire.layout import Layout

WIDE = Layout(num_layers=1, num_kv_heads=2, head_size=16, dtype="float16", block_size=16,
              model_id="test-model@0")   # 2048-byte blocks: 2 per slab
WIDEST = Layout(num_layers=1, num_kv_heads=4, head_size=16, dtype="float16", block_size=16,
                model_id="test-model@0")  # 4096-byte blocks: one slab each


async def test_abandoned_acquires_stop_at_max_leases_per_engine(make_rig: MakeRig) -> None:
    """An engine that never releases gets RESOURCE_EXHAUSTED naming max_leases_per_engine at
    its fourth lease (pinning nothing more); another engine still acquires; once the leases
    expire the engine acquires again."""
    rig = make_rig(max_leases_per_engine=3)
    hashes = chain(2)
    rig.store(hashes)
    for _ in range(3):
        await rig.node.acquire(rig.engine.engine_id, hashes, dram_run_only=True)
    with pytest.raises(ResourceExhausted, match="max_leases_per_engine = 3"):
        await rig.node.acquire(rig.engine.engine_id, hashes, dram_run_only=True)
    with pytest.raises(ResourceExhausted, match="TIERD_MAX_LEASES_PER_ENGINE"):
        rig.node.reserve(rig.engine.engine_id, chain(1, "new"))
    rig.node.check_integrity()                                   # 3 pins each, no more
    other = rig.node.register_engine("default", LAYOUT, "other")
    lease = await rig.node.acquire(other.engine_id, hashes)
    rig.node.release(lease.lease_id)
    assert (await rig.node.acquire(rig.engine.engine_id, chain(1, "miss"))).lease_id == ""
    rig.clock.advance(31)                                        # all three expire
    lease = await rig.node.acquire(rig.engine.engine_id, hashes, dram_run_only=True)
    assert len(lease.slot_ids) == 2
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_leases_of_all_engines_stop_at_max_leases(make_rig: MakeRig) -> None:
    """Two engines holding two leases in all: a third, of either, is RESOURCE_EXHAUSTED naming
    max_leases; a release makes room."""
    rig = make_rig(max_leases=2)
    other = rig.node.register_engine("default", LAYOUT, "other")
    hashes = chain(1)
    rig.store(hashes)
    first = await rig.node.acquire(rig.engine.engine_id, hashes)
    await rig.node.acquire(other.engine_id, hashes)
    for engine in (rig.engine, other):
        with pytest.raises(ResourceExhausted, match="max_leases = 2"):
            await rig.node.acquire(engine.engine_id, hashes)
    rig.node.release(first.lease_id)
    await rig.node.acquire(other.engine_id, hashes)
    rig.node.check_integrity()


async def test_blocks_named_by_leases_stop_at_max_lease_keys(make_rig: MakeRig) -> None:
    """Leases naming 8 blocks in all (the cap): a read or write lease naming more is
    RESOURCE_EXHAUSTED naming max_lease_keys and takes nothing; a miss still answers."""
    rig = make_rig(max_lease_keys=8, max_blocks_per_request=4)
    hashes = chain(4)
    rig.store(hashes)
    await rig.node.acquire(rig.engine.engine_id, hashes)
    held = await rig.node.acquire(rig.engine.engine_id, hashes)
    with pytest.raises(ResourceExhausted, match="max_lease_keys = 8"):
        await rig.node.acquire(rig.engine.engine_id, hashes[:1])
    with pytest.raises(ResourceExhausted, match="TIERD_MAX_LEASE_KEYS"):
        rig.node.reserve(rig.engine.engine_id, chain(1, "new"))
    assert rig.node.stats().tiers["dram"].used_blocks == 4      # no slot taken
    assert (await rig.node.acquire(rig.engine.engine_id, chain(1, "miss"))).lease_id == ""
    rig.node.release(held.lease_id)
    assert len((await rig.node.acquire(rig.engine.engine_id, hashes[:3])).slot_ids) == 3
    rig.node.check_integrity()


async def test_a_refused_ssd_acquire_reads_and_pins_nothing(make_rig: MakeRig) -> None:
    """At its lease cap, an acquire whose prefix is on SSD is refused before any read: the SSD
    blocks stay on SSD and no pin is left."""
    rig = make_rig(max_leases_per_engine=1)
    rig.store(chain(8))
    await rig.node.maintain()                                    # the oldest two -> SSD only
    cold = chain(2)
    assert rig.tiers(cold) == ["ssd", "ssd"]
    await rig.node.acquire(rig.engine.engine_id, chain(8)[7:])
    with pytest.raises(ResourceExhausted, match="max_leases_per_engine"):
        await rig.node.acquire(rig.engine.engine_id, cold)
    assert rig.tiers(cold) == ["ssd", "ssd"]
    rig.node.check_integrity()


async def test_blank_reserve_past_the_budget_keeps_no_lease(make_rig: MakeRig) -> None:
    """With the blank budget (2 slots) spent, Reserve(blank_slots=4096) grants nothing and
    keeps nothing: the empty lease id, whose commit and abort do nothing; a partial grant keeps
    only its granted slots, and a written flag past them is INVALID_ARGUMENT."""
    rig = make_rig(blank_fraction=0.25, max_lease_keys=4096)
    spent = rig.node.reserve_blank(rig.engine.engine_id, 2)
    assert None not in spent.slot_ids
    res = rig.node.reserve_blank(rig.engine.engine_id, 4096)
    assert res.lease_id == EMPTY_LEASE
    assert res.slot_ids == [None] * 4096 and res.already_stored == [False] * 4096
    assert rig.node.commit(res.lease_id, [None] * 4096) == 0
    rig.node.abort(res.lease_id)
    rig.node.abort(spent.lease_id)
    part = rig.node.reserve_blank(rig.engine.engine_id, 4000)   # 2 granted, 3998 not
    assert part.lease_id != EMPTY_LEASE and part.slot_ids[2:] == [None] * 3998
    sums: list[int | None] = [None] * 4000
    sums[2] = 0
    with pytest.raises(ValueError, match="slot #2 is flagged written but the Reserve granted"):
        rig.node.commit(part.lease_id, sums, names=chain(3))
    name = chain(1, "n")[0]
    rig.arena.view(rig.engine.geometry.offset(part.slot_ids[0]), BLOCK)[:] = payload(name)
    sums[2] = None
    sums[0] = block_checksum(payload(name))
    rig.node.check_integrity()
    assert rig.node.commit(part.lease_id, sums, names=[name]) == 1
    rig.node.check_integrity()


async def test_a_reserve_of_nothing_is_the_empty_lease(rig_default: Rig) -> None:
    """A Reserve of no hashes, or of 0 blank slots, holds nothing: the empty lease id, no
    slots; committing (no flags) or aborting it does nothing."""
    rig = rig_default
    for res in (rig.node.reserve(rig.engine.engine_id, []),
                rig.node.reserve_blank(rig.engine.engine_id, 0)):
        assert (res.lease_id, res.slot_ids, res.already_stored) == (EMPTY_LEASE, [], [])
        assert rig.node.written_spans(res.lease_id, []) == []
        assert rig.node.commit(res.lease_id, []) == 0
        rig.node.abort(res.lease_id)
    with pytest.raises(ValueError, match="slot #0 is flagged written"):
        rig.node.written_spans(EMPTY_LEASE, [True])
    rig.node.check_integrity()


async def test_a_written_flag_for_a_slot_never_granted_is_invalid(rig_default: Rig) -> None:
    """A named Reserve whose second hash is stored already grants it no slot: flagging that
    slot written (or sending a checksum for it) is INVALID_ARGUMENT, and the lease still
    commits the right flags."""
    rig = rig_default
    hashes = chain(2)
    rig.store(hashes[1:])
    res = rig.node.reserve(rig.engine.engine_id, hashes)
    assert res.slot_ids[1] is None and res.already_stored == [False, True]
    with pytest.raises(ValueError, match="slot #1 is flagged written"):
        rig.node.written_spans(res.lease_id, [True, True])
    with pytest.raises(ValueError, match="slot #1 is flagged written"):
        rig.node.commit(res.lease_id, [None, 7])
    assert res.slot_ids[0] is not None
    rig.arena.view(rig.engine.geometry.offset(res.slot_ids[0]), BLOCK)[:] = payload(hashes[0])
    assert rig.node.commit(res.lease_id, [block_checksum(payload(hashes[0])), None]) == 1
    rig.node.check_integrity()


async def test_blank_commit_stores_a_block_hidden_on_an_unhealthy_ssd(rig_default: Rig) -> None:
    """With the SSD unhealthy, a block whose only copy is on SSD is a miss; a blank slot named
    after it is stored in DRAM (as a named Reserve's would be), not dropped."""
    rig = rig_default
    held = chain(8, "held")
    rig.store(held)
    await rig.node.maintain()                                    # held[0] -> SSD only
    assert rig.tiers(held[:1]) == ["ssd"]
    rig.ssd.healthy = False
    assert rig.tiers(held[:1]) == []
    res = rig.node.reserve_blank(rig.engine.engine_id, 1)
    assert res.slot_ids[0] is not None
    rig.arena.view(rig.engine.geometry.offset(res.slot_ids[0]), BLOCK)[:] = payload(held[0])
    assert rig.node.commit(res.lease_id, [block_checksum(payload(held[0]))],
                           names=held[:1]) == 1
    assert rig.tiers(held[:1]) == ["dram"]
    lease = await rig.node.acquire(rig.engine.engine_id, held[:1])
    assert rig.copy_out(lease.slot_ids) == [payload(held[0])]
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


def test_a_block_under_min_block_bytes_is_refused_at_registration(rig_default: Rig) -> None:
    """A 512-byte layout under the default minimum (1024) is a ValueError naming
    min_block_bytes; nothing is registered."""
    rig = rig_default
    tiny = Layout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float16", block_size=16,
                  model_id="test-model@0")
    assert tiny.block_bytes == 512
    with pytest.raises(ValueError, match=r"under min_block_bytes \(1024\)"):
        rig.node.register_engine("default", tiny)
    assert [e.name for e in rig.node.engines_of("default")] == ["eng"]
    rig.node.check_integrity()


def test_a_size_class_is_pruned_when_its_last_engine_and_block_leave(make_rig: MakeRig) -> None:
    """Classes are bounded (max_size_classes = 2): a wider layout's class stays while its block
    is held after its engine left (a third size is RESOURCE_EXHAUSTED naming the cap), and is
    pruned once the block is evicted: the third size registers, and DRAM capacity is counted
    without the gone class."""
    rig = make_rig(max_size_classes=2)
    assert rig.node.stats().tiers["dram"].capacity_blocks == 8
    wide = rig.node.register_engine("default", WIDE, "wide")
    res = rig.node.reserve(wide.engine_id, chain(1, "w"))
    rig.node.commit(res.lease_id, [None])                        # written nothing: freed
    _store_one(rig, wide)
    rig.node.unregister_engine(wide.engine_id)
    with pytest.raises(ResourceExhausted, match="max_size_classes = 2"):
        rig.node.register_engine("default", WIDEST, "widest")
    rig.store(chain(8))                                           # evicts the wide block
    assert rig.tiers(chain(8)) == ["dram"] * 8
    assert rig.node.stats().tiers["dram"].capacity_blocks == 8
    widest = rig.node.register_engine("default", WIDEST, "widest")
    rig.node.unregister_engine(widest.engine_id)
    assert rig.node.stats().tiers["dram"].capacity_blocks == 8
    rig.node.check_integrity()


def test_register_unregister_cycles_of_many_sizes_keep_classes_bounded(
        make_rig: MakeRig) -> None:
    """300 register/unregister cycles, each of a new block size, under max_size_classes = 2:
    every one registers (the last class was pruned) and capacity stays right."""
    rig = make_rig(max_size_classes=2)
    for i in range(300):
        layout = Layout(num_layers=1, num_kv_heads=1, head_size=128 + i, dtype="float32",
                        block_size=1, model_id="test-model@0")     # 1024 + 8i bytes
        engine = rig.node.register_engine("default", layout, f"e{i}")
        rig.node.unregister_engine(engine.engine_id)
    assert rig.node.stats().tiers["dram"].capacity_blocks == 8
    rig.node.check_integrity()


def _store_one(rig: Rig, engine: EngineInfo) -> None:
    """Store one block of ``engine``'s layout."""
    name = chain(1, engine.engine_id)[0]
    size = engine.geometry.slot_bytes
    res = rig.node.reserve(engine.engine_id, [name])
    assert res.slot_ids[0] is not None
    data = payload(name, size)
    rig.arena.view(engine.geometry.offset(res.slot_ids[0]), size)[:] = data
    assert rig.node.commit(res.lease_id, [block_checksum(data)]) == 1


async def test_default_caps_stop_abandoned_leases(rig_default: Rig) -> None:
    """With the default caps, an engine that abandons 1024 one-block leases gets
    RESOURCE_EXHAUSTED at the next (max_leases_per_engine = 1024)."""
    rig = rig_default
    hashes = chain(1)
    rig.store(hashes)
    for _ in range(1024):
        await rig.node.acquire(rig.engine.engine_id, hashes, dram_run_only=True)
    with pytest.raises(ResourceExhausted, match="max_leases_per_engine = 1024"):
        await rig.node.acquire(rig.engine.engine_id, hashes, dram_run_only=True)
    rig.clock.advance(31)
    assert rig.node.stats().tiers["dram"].pinned_blocks == 0
    rig.node.check_integrity()


def test_capacity_is_right_after_a_wider_layout_leaves(rig_default: Rig) -> None:
    """A wider layout registers and leaves holding nothing: its class is pruned and DRAM
    capacity is the 8 slots of the rig's layout again (not 4 of the wider one)."""
    rig = rig_default
    wide = rig.node.register_engine("default", WIDE, "wide")
    assert rig.node.stats().tiers["dram"].capacity_blocks == 4
    rig.node.unregister_engine(wide.engine_id)
    assert rig.node.stats().tiers["dram"].capacity_blocks == 8
    rig.node.check_integrity()


@pytest.fixture
def rig_default(make_rig: MakeRig) -> Rig:
    return make_rig()
