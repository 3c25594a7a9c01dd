"""The node store over a real shared-memory arena, slab allocator and SSD directory: store,
look up, acquire and copy out bit-exact from DRAM and SSD; demotion and promotion order; leases;
namespaces; bad input. Each test ends with ``check_integrity``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from node_rig import BLOCK, LAYOUT, MakeRig, Rig, chain, payload  # noqa: E402

from tierd.checksum import block_checksum
from tierd.daemon.errors import FailedPrecondition, NotFound, ResourceExhausted
from tierd.daemon.node import EMPTY_LEASE
from tierd.daemon.node_types import EngineCaps
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.events import BlockRemoved, BlockStored
from tierd.types import BlockHash, make_key


@pytest.fixture
def rig(make_rig: MakeRig) -> Rig:
    return make_rig()


async def test_store_lookup_acquire_copy_out_from_dram(rig: Rig) -> None:
    """Three stored blocks are DRAM hits, pinned by acquire and copied out bit-exact."""
    hashes = chain(3)
    res = rig.store(hashes)
    assert res.already_stored == [False, False, False]
    assert rig.node.take_events() == [BlockStored(tuple(hashes), None, "dram", 16)]
    assert rig.tiers(hashes + chain(1, "x")) == ["dram", "dram", "dram"]
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert lease.slot_ids == [s for s in res.slot_ids if s is not None]
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in hashes]
    assert lease.checksums == [block_checksum(payload(h)) for h in hashes]
    assert rig.node.stats().tiers["dram"].pinned_blocks == 3
    rig.node.release(lease.lease_id)
    assert rig.node.stats().tiers["dram"].pinned_blocks == 0
    rig.node.check_integrity()


async def test_lookup_is_the_longest_consecutive_prefix(rig: Rig) -> None:
    """Blocks 0, 1 and 3 stored: lookup and acquire of 0..3 stop at the gap (2 blocks)."""
    hashes = chain(4)
    rig.store([hashes[0], hashes[1], hashes[3]])
    assert rig.tiers(hashes) == ["dram", "dram"]
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert len(lease.slot_ids) == 2
    stats = rig.node.stats()
    assert stats.tiers["dram"].queries == 4 * 16 and stats.tiers["dram"].hits == 2 * 16
    assert stats.hit_ratio == 0.5
    rig.node.check_integrity()


async def test_commit_events_split_runs_and_name_the_parent(rig: Rig) -> None:
    """A reservation whose middle block is already stored commits as two runs; a None
    checksum frees its slot and breaks the run too."""
    hashes = chain(5)
    rig.store([hashes[2]])
    rig.node.take_events()
    res = rig.node.reserve(rig.engine.engine_id, hashes)
    assert res.already_stored == [False, False, True, False, False]
    sums: list[int | None] = [1, 2, None, 4, None]
    assert rig.node.commit(res.lease_id, sums) == 3
    assert rig.node.take_events() == [
        BlockStored((hashes[0], hashes[1]), None, "dram", 16),
        BlockStored((hashes[3],), hashes[2], "dram", 16)]
    assert rig.tiers(hashes) == ["dram"] * 4
    assert rig.node.stats().tiers["dram"].used_blocks == 4
    rig.node.check_integrity()


async def test_demotion_takes_lru_blocks_to_low_watermark_then_promotion(rig: Rig) -> None:
    """A full arena (8/8 > 0.90) demotes its 2 least recently used blocks (to 6/8 = 0.75) in LRU
    order; acquiring one reads it back bit-exact into DRAM and keeps the SSD copy."""
    hashes = chain(8)
    rig.store(hashes)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes[:2])   # 0, 1 become MRU
    rig.node.release(lease.lease_id)
    rig.node.take_events()
    await rig.node.maintain()
    demoted = [hashes[2], hashes[3]]
    assert rig.node.take_events() == [
        BlockStored((demoted[0],), None, "ssd"), BlockStored((demoted[1],), None, "ssd"),
        BlockRemoved((demoted[0],), "dram"), BlockRemoved((demoted[1],), "dram")]
    assert rig.tiers(hashes) == ["dram", "dram", "ssd", "ssd"] + ["dram"] * 4
    stats = rig.node.stats()
    assert (stats.tiers["dram"].used_blocks, stats.tiers["ssd"].used_blocks) == (6, 2)
    assert stats.tiers["dram"].demotions == 2 and stats.tiers["dram"].evictions == 0
    rig.ssd.check_integrity(disk=True)

    lease = await rig.node.acquire(rig.engine.engine_id, hashes[:4])
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in hashes[:4]]
    landed = sorted(rig.node.take_events(), key=lambda e: e.block_hashes[0])  # type: ignore
    assert landed == sorted([BlockStored((h,), None, "dram") for h in demoted],
                            key=lambda e: e.block_hashes[0])
    assert rig.tiers(hashes[:4]) == ["dram"] * 4
    stats = rig.node.stats()
    assert stats.tiers["ssd"].promotions == 2 and stats.tiers["ssd"].used_blocks == 2
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_demoting_a_block_with_an_ssd_copy_writes_nothing(rig: Rig) -> None:
    """A promoted block (SSD copy kept) that is LRU again only loses its DRAM copy: no write."""
    hashes = chain(8)
    rig.store(hashes)
    await rig.node.maintain()                                  # 0, 1 -> SSD
    rig.node.release((await rig.node.acquire(rig.engine.engine_id, hashes[:1])).lease_id)
    for h in hashes[2:]:                                       # LRU order: 0, 2..7
        rig.node.release((await rig.node.acquire(rig.engine.engine_id, [h])).lease_id)
    rig.store(chain(1, "b"))                                   # 8/8
    rig.node.take_events()
    await rig.node.maintain()
    assert rig.node.take_events() == [BlockStored((hashes[2],), None, "ssd"),
                                      BlockRemoved((hashes[0],), "dram"),
                                      BlockRemoved((hashes[2],), "dram")]
    assert rig.tiers(hashes[:3]) == ["ssd", "ssd", "ssd"]
    stats = rig.node.stats()
    assert stats.tiers["dram"].demotions == 4 and stats.tiers["ssd"].used_blocks == 3
    rig.node.check_integrity()


async def test_an_eviction_batch_reports_one_removal_per_namespace_run(rig: Rig) -> None:
    """Two models' blocks interleaved in LRU order (2 of A, 2 of B, 4 of A) and 8 new blocks
    of A: all 8 are evicted in LRU order, reported as three removals, one per run of a
    namespace, so no event names a hash under another model's namespace."""
    other = rig.node.register_engine("default", dataclasses.replace(LAYOUT, model_id="m2@1"),
                                     "other")
    a, b = chain(6, "a"), chain(2, "b")
    rig.store(a[:2])
    rig.store(b, engine=other)
    rig.store(a[2:])
    rig.node.take_events()
    rig.store(chain(8, "new"))
    removed = [e for e in rig.node.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(tuple(a[:2]), "dram"), BlockRemoved(tuple(b), "dram"),
                       BlockRemoved(tuple(a[2:]), "dram")]
    assert rig.node.stats().tiers["dram"].evictions == 8
    rig.node.check_integrity()


async def test_forced_eviction_on_reserve_is_lru_and_skips_pins(rig: Rig) -> None:
    """A full arena with blocks 0 and 1 pinned: reserving 8 new blocks evicts the 6 unpinned in
    LRU order and leaves the last 2 without a slot; the pinned blocks survive intact."""
    old = chain(8)
    rig.store(old)
    lease = await rig.node.acquire(rig.engine.engine_id, old[:2])
    rig.node.take_events()
    new = chain(8, "b")
    res = rig.store(new)
    assert [s is not None for s in res.slot_ids] == [True] * 6 + [False] * 2
    assert rig.node.take_events() == [BlockRemoved(tuple(old[2:]), "dram"),  # one per run
                                      BlockStored(tuple(new[:6]), None, "dram", 16)]
    assert rig.tiers(old[:2]) == ["dram", "dram"] and rig.tiers(old[2:3]) == []
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in old[:2]]
    assert rig.node.stats().tiers["dram"].evictions == 6
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_ssd_min_hits_evicts_cold_blocks_instead(make_rig: MakeRig) -> None:
    """With ssd_min_hits=1, of the two LRU victims only the one acquired once goes to SSD."""
    rig = make_rig(ssd_min_hits=1)
    hashes = chain(8)
    rig.store(hashes)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes[:1])
    rig.node.release(lease.lease_id)
    for h in hashes[2:]:                      # make 0 and 1 the two LRU blocks again
        rig.node.release((await rig.node.acquire(rig.engine.engine_id, [h])).lease_id)
    rig.node.take_events()
    await rig.node.maintain()
    assert rig.node.take_events() == [BlockStored((hashes[0],), None, "ssd"),
                                      BlockRemoved((hashes[1],), "dram"),
                                      BlockRemoved((hashes[0],), "dram")]
    assert rig.tiers(hashes[:2]) == ["ssd"]
    stats = rig.node.stats()
    assert (stats.tiers["dram"].demotions, stats.tiers["dram"].evictions) == (1, 1)
    rig.node.check_integrity()


async def test_read_lease_expires_on_the_fake_clock(rig: Rig) -> None:
    """An acquire lease past its 30 s deadline unpins its blocks; release then fails."""
    hashes = chain(2)
    rig.store(hashes)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert lease.deadline == 1030.0 and lease.ttl_seconds == 30.0
    rig.clock.advance(29)
    await rig.node.maintain()
    assert rig.node.stats().tiers["dram"].pinned_blocks == 2
    rig.clock.advance(1)
    await rig.node.maintain()
    stats = rig.node.stats()
    assert stats.tiers["dram"].pinned_blocks == 0 and stats.lease_expiries == 1
    with pytest.raises(NotFound, match="already expired"):      # NOT_FOUND, as the proto says
        rig.node.release(lease.lease_id)
    assert rig.node.metrics.registry.get_sample_value(
        "tierd_lease_expiries_total", {"kind": "read"}) == 1.0
    rig.node.check_integrity()


async def test_reservation_expiry_frees_slots_and_commit_fails(rig: Rig) -> None:
    """A reservation past its deadline frees its slots (no maintain needed); commit is then
    FailedPrecondition and abort is a no-op."""
    res = rig.node.reserve(rig.engine.engine_id, chain(3))
    assert rig.node.stats().tiers["dram"].used_blocks == 3
    assert rig.tiers(chain(3)) == []                           # reserved: not visible
    rig.clock.advance(30.0)
    with pytest.raises(FailedPrecondition, match="expired"):
        rig.node.commit(res.lease_id, [1, 2, 3])
    rig.node.abort(res.lease_id)
    stats = rig.node.stats()
    assert stats.tiers["dram"].used_blocks == 0 and stats.lease_expiries == 1
    assert rig.node.metrics.registry.get_sample_value(
        "tierd_lease_expiries_total", {"kind": "write"}) == 1.0
    rig.node.check_integrity()


async def test_abort_frees_and_a_second_reserve_of_a_pending_block_gets_no_slot(rig: Rig) -> None:
    """While one reservation holds a hash, another gets no slot for it; after abort it does."""
    hashes = chain(2)
    first = rig.node.reserve(rig.engine.engine_id, hashes)
    second = rig.node.reserve(rig.engine.engine_id, hashes + hashes[:1])
    assert second.slot_ids == [None, None, None] and second.already_stored == [False] * 3
    rig.node.abort(first.lease_id)
    rig.node.abort(first.lease_id)                             # idempotent
    rig.node.abort(second.lease_id)
    third = rig.node.reserve(rig.engine.engine_id, hashes + hashes[:1])
    assert [s is not None for s in third.slot_ids] == [True, True, False]
    rig.node.abort(third.lease_id)
    assert rig.node.stats().tiers["dram"].used_blocks == 0
    rig.node.check_integrity()


async def test_reserve_skips_blocks_stored_in_dram_or_ssd(rig: Rig) -> None:
    """Blocks held in DRAM or only on SSD are already stored: no slot for them."""
    hashes = chain(8)
    rig.store(hashes)
    await rig.node.maintain()                                  # 0, 1 -> SSD only
    res = rig.node.reserve(rig.engine.engine_id, [hashes[0], hashes[5], *chain(1, "new")])
    assert res.already_stored == [True, True, False]
    assert res.slot_ids[:2] == [None, None] and res.slot_ids[2] is not None
    rig.node.abort(res.lease_id)
    rig.node.check_integrity()


async def test_lease_and_input_errors(rig: Rig) -> None:
    """Double commit, unknown lease, wrong-kind lease, bad hash length, oversize request,
    unknown engine and a wrong checksum count each raise their precise error."""
    hashes = chain(2)
    res = rig.node.reserve(rig.engine.engine_id, hashes)
    with pytest.raises(ValueError, match="one checksum"):
        rig.node.commit(res.lease_id, [1])
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        rig.node.commit(res.lease_id, [1, -1])
    with pytest.raises(FailedPrecondition, match="commit or abort"):
        rig.node.release(res.lease_id)
    assert rig.node.commit(res.lease_id, [1, 2]) == 2
    with pytest.raises(FailedPrecondition, match="already committed"):
        rig.node.commit(res.lease_id, [1, 2])
    with pytest.raises(FailedPrecondition, match="already committed"):
        rig.node.abort(res.lease_id)
    with pytest.raises(NotFound, match="unknown lease"):
        rig.node.commit("nope", [])
    with pytest.raises(NotFound, match="unknown lease"):
        rig.node.release("nope")
    with pytest.raises(ValueError, match="has 31 bytes"):
        rig.node.lookup(rig.engine.engine_id, [BlockHash(bytes(31))])
    with pytest.raises(ValueError, match="has 31 bytes"):
        rig.node.reserve(rig.engine.engine_id, [BlockHash(bytes(31))])
    assert rig.tiers([BlockHash(bytes(16))]) == []           # xxhash_cbor length is fine
    not_bytes: Any = "x" * 32
    with pytest.raises(ValueError, match="#1 has str bytes"):
        rig.node.lookup(rig.engine.engine_id, [hashes[0], not_bytes])
    with pytest.raises(ResourceExhausted, match="at most 4096"):
        rig.node.lookup(rig.engine.engine_id, chain(4097))
    with pytest.raises(NotFound, match="unknown engine"):
        rig.node.lookup("ghost", hashes)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    with pytest.raises(FailedPrecondition, match="read lease"):
        rig.node.commit(lease.lease_id, [1, 2])
    rig.node.release(lease.lease_id)
    with pytest.raises(NotFound, match="already released"):
        rig.node.release(lease.lease_id)
    too_big = dataclasses.replace(LAYOUT, num_layers=64)       # 64 KiB > the 4 KiB slab
    with pytest.raises(ResourceExhausted, match="cannot fit"):
        rig.node.register_engine("default", too_big)
    with pytest.raises(ValueError, match="tp_rank"):
        rig.node.register_engine("default", dataclasses.replace(LAYOUT, tp_rank=1))
    rig.node.check_integrity()


async def test_tenants_layouts_and_tp_ranks_never_share_entries(rig: Rig) -> None:
    """Another tenant, or another TP rank of the same tenant, sending the exact hashes misses
    and may store its own copy; the first tenant's blocks are untouched."""
    hashes = chain(3)
    rig.store(hashes)
    other = rig.node.register_engine("tenant-b", LAYOUT)
    rank1 = rig.node.register_engine("default", dataclasses.replace(LAYOUT, tp_rank=1, tp_size=2))
    twin = rig.node.register_engine("default", LAYOUT)          # same namespace: shares
    for engine in (other, rank1):
        assert rig.node.lookup(engine.engine_id, hashes).tiers == []
        lease = await rig.node.acquire(engine.engine_id, hashes)
        assert lease.slot_ids == []
        rig.node.release(lease.lease_id)
    assert rig.node.lookup(twin.engine_id, hashes).tiers == ["dram"] * 3
    res = rig.store(hashes, engine=other)
    assert res.already_stored == [False] * 3
    assert rig.node.stats().tiers["dram"].used_blocks == 6
    assert rig.tiers(hashes) == ["dram"] * 3
    rig.node.check_integrity()


async def test_hbm_reports_are_per_engine_and_bounded(make_rig: MakeRig) -> None:
    """An engine's reported GPU blocks look up as "hbm" for it only; the set keeps the newest
    hbm_max_blocks_per_engine hashes; unregister drops it."""
    rig = make_rig(hbm_max_blocks_per_engine=2)
    hashes = chain(4)
    rig.store(hashes)
    twin = rig.node.register_engine("default", LAYOUT)
    rig.node.report_hbm(rig.engine.engine_id, stored=hashes[:3], removed=[])
    assert rig.tiers(hashes) == ["dram", "hbm", "hbm", "dram"]   # 0 dropped by the cap
    assert rig.node.lookup(twin.engine_id, hashes).tiers == ["dram"] * 4
    rig.node.report_hbm(rig.engine.engine_id, stored=[hashes[0]], removed=[hashes[1]])
    assert rig.tiers(hashes) == ["hbm", "dram", "hbm", "dram"]
    stats = rig.node.stats()
    assert stats.hbm_blocks == {rig.engine.engine_id: 2}
    assert stats.tiers["hbm"].used_blocks == 2 and stats.tiers["hbm"].hits == 4 * 16
    rig.node.report_hbm(rig.engine.engine_id, stored=[], removed=[], cleared=True)
    assert rig.tiers(hashes[:1]) == ["dram"]
    rig.node.report_hbm(twin.engine_id, stored=hashes[:1], removed=[])
    rig.node.unregister_engine(twin.engine_id)
    assert rig.node.stats().hbm_blocks == {rig.engine.engine_id: 0}
    with pytest.raises(ValueError, match="has 3 bytes"):
        rig.node.report_hbm(rig.engine.engine_id, stored=[BlockHash(b"abc")], removed=[])
    rig.node.check_integrity()


async def test_unregister_ends_the_engines_leases(rig: Rig) -> None:
    """Unregistering frees an engine's reservation and unpins its read lease."""
    hashes = chain(2)
    rig.store(hashes)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    rig.node.reserve(rig.engine.engine_id, chain(2, "b"))
    rig.node.unregister_engine(rig.engine.engine_id)
    stats = rig.node.stats()
    assert stats.tiers["dram"].used_blocks == 2 and stats.tiers["dram"].pinned_blocks == 0
    with pytest.raises(NotFound, match="unregistered"):
        rig.node.release(lease.lease_id)
    with pytest.raises(NotFound):
        rig.node.unregister_engine(rig.engine.engine_id)
    rig.node.check_integrity()


async def test_concurrent_acquires_promote_a_block_once(rig: Rig) -> None:
    """Two acquires of the same SSD prefix at once read each block once and share the slots."""
    hashes = chain(8)
    rig.store(hashes)
    await rig.node.maintain()                                  # 0, 1 -> SSD
    a, b = await asyncio.gather(rig.node.acquire(rig.engine.engine_id, hashes[:2]),
                                rig.node.acquire(rig.engine.engine_id, hashes[:2]))
    assert a.slot_ids == b.slot_ids and len(a.slot_ids) == 2
    assert rig.copy_out(a.slot_ids) == [payload(h) for h in hashes[:2]]
    stats = rig.node.stats()
    assert stats.tiers["ssd"].promotions == 2 and stats.tiers["dram"].pinned_blocks == 2
    rig.node.check_integrity()
    rig.node.release(a.lease_id)
    rig.node.release(b.lease_id)
    rig.node.check_integrity()


async def test_long_ssd_prefix_is_read_in_batches_started_while_staging(
        make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8-block SSD prefix with a read batch of 3 records: the reads start in batches of 3,
    3 and 2 (the first two while the rest is still being staged); all 8 land bit-exact."""
    rig = make_rig(ssd_bytes=8 * (BLOCK + HEADER_BYTES), dram_high_watermark=0.1,
                   dram_low_watermark=0.1)
    hashes = chain(8)
    rig.store(hashes)
    await rig.node.maintain()                                  # all 8 -> SSD
    assert rig.tiers(hashes) == ["ssd"] * 8
    monkeypatch.setattr("tierd.daemon.promotion.READ_BATCH_BYTES", 3 * (BLOCK + HEADER_BYTES))
    batches: list[int] = []
    read_many = rig.ssd.read_many

    def counting(requests: list[tuple[Any, Any, memoryview]]) -> Any:
        batches.append(len(requests))
        return read_many(requests)

    monkeypatch.setattr(rig.ssd, "read_many", counting)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert batches == [3, 3, 2]
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in hashes]
    assert rig.node.stats().tiers["ssd"].promotions == 8
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_an_ssd_prefix_longer_than_the_room_ends_where_room_ends(
        make_rig: MakeRig) -> None:
    """X on SSD, X[3] back in DRAM, 5 other blocks pinned (8 slots): acquiring X[:4] finds room
    for two promotions (X[3] is pinned for the plan, so not evicted for them): the lease holds
    X[0] and X[1], X[3]'s pin for the plan is undone, and no pin or slot leaks."""
    rig = make_rig(dram_high_watermark=0.1, dram_low_watermark=0.1)
    x = chain(8)
    rig.store(x)
    await rig.node.maintain()                                  # all 8 -> SSD
    rig.node.release((await rig.node.acquire(rig.engine.engine_id, x[3:4])).lease_id)
    others = chain(5, "y")
    rig.store(others)
    held = await rig.node.acquire(rig.engine.engine_id, others)
    assert rig.tiers(x[3:4]) == ["dram"] and len(held.slot_ids) == 5
    lease = await rig.node.acquire(rig.engine.engine_id, x[:4])
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in x[:2]]
    assert rig.node.stats().tiers["dram"].pinned_blocks == 7  # the 5 others, X[0] and X[1]
    assert rig.tiers(x[3:4]) == ["dram"]
    rig.node.check_integrity()
    rig.node.release(lease.lease_id)
    rig.node.release(held.lease_id)
    assert rig.node.stats().tiers["dram"].pinned_blocks == 0
    rig.node.check_integrity()


async def test_a_probe_counts_like_a_lookup_and_an_acquire_counts_nothing(
        make_rig: MakeRig, tmp_path: Path) -> None:
    """Two identical rigs (8 blocks stored, 0-1 demoted to SSD, block 8 missing): a lookup of
    9 blocks on one and a probe on the other count the same 9 * 16 query tokens and 2 * 16 SSD +
    6 * 16 DRAM hit tokens; an acquire counts nothing."""
    counted = []
    for use_probe in (False, True):
        rig = make_rig(ssd_dir=str(tmp_path / f"ssd-{use_probe}"))
        hashes = chain(9)
        rig.store(hashes[:8])
        await rig.node.maintain()                              # 0, 1 -> SSD
        if use_probe:
            lease = rig.node.probe(rig.engine.engine_id, hashes)
            assert (lease.slot_ids, len(lease.held_after)) == ([], 8)
            rig.node.release(lease.lease_id)
            before = {t: (s.queries, s.hits) for t, s in rig.node.stats().tiers.items()}
            rig.node.release((await rig.node.acquire(rig.engine.engine_id, hashes)).lease_id)
            assert {t: (s.queries, s.hits) for t, s in rig.node.stats().tiers.items()} == before
        else:
            assert rig.tiers(hashes) == ["ssd", "ssd"] + ["dram"] * 6
        counted.append({t: (s.queries, s.hits) for t, s in rig.node.stats().tiers.items()})
        rig.node.check_integrity()
    assert counted[0] == counted[1]
    assert (counted[0]["dram"], counted[0]["ssd"][1]) == ((9 * 16, 6 * 16), 2 * 16)


async def test_a_probe_pins_the_dram_run_and_starts_reading_the_ssd_run_after_it(
        make_rig: MakeRig, tmp_path: Path) -> None:
    """Blocks 0-1 and 4-7 in DRAM, 2-3 on SSD, 8 missing: a probe pins 0-1 alone, lists the
    rest of the held prefix by tier (as a lookup would, and counted as one), and starts reading
    2-3 into DRAM, unpinned; the acquire that follows pins all 8 without reading them again."""
    rig = make_rig(ssd_dir=str(tmp_path / "ssd"))
    hashes = chain(9)
    rig.store(hashes[2:8])
    rig.store(hashes[:2])
    await rig.node.maintain()                                  # LRU 2, 3 -> SSD
    queries = rig.node.stats().tiers["dram"].queries
    lease = rig.node.probe(rig.engine.engine_id, hashes)
    assert lease.checksums == [block_checksum(payload(h)) for h in hashes[:2]]
    assert lease.held_after == ["ssd", "ssd", "dram", "dram", "dram", "dram"]
    assert rig.node.stats().tiers["dram"].queries == queries + 9 * 16
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in hashes[:2]]
    await _landed(rig, hashes[:8])
    assert rig.node.stats().tiers["dram"].pinned_blocks == 2   # the read blocks: unpinned
    promotions = rig.node.stats().tiers["ssd"].promotions
    assert promotions == 2
    got = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert rig.copy_out(got.slot_ids) == [payload(h) for h in hashes[:8]]
    assert rig.node.stats().tiers["ssd"].promotions == promotions
    rig.node.release(lease.lease_id)
    rig.node.release(got.lease_id)
    assert rig.node.stats().tiers["dram"].pinned_blocks == 0


async def test_a_probe_reads_nothing_where_only_its_own_chain_could_make_room(
        make_rig: MakeRig, tmp_path: Path) -> None:
    """As above, but the two free slots held blank by a reservation: the only evictable DRAM
    blocks are 4-7 of the probed chain, so the probe reads nothing (2-3 stay on SSD, 4-7 stay
    in DRAM); a chain starting on SSD pins nothing, lists it all and is read in."""
    rig = make_rig(ssd_dir=str(tmp_path / "ssd"))
    hashes = chain(9)
    rig.store(hashes[2:8])
    rig.store(hashes[:2])
    await rig.node.maintain()                                  # LRU 2, 3 -> SSD
    blank = rig.node.reserve_blank(rig.engine.engine_id, 2)
    assert len([s for s in blank.slot_ids if s is not None]) == 2
    lease = rig.node.probe(rig.engine.engine_id, hashes)
    assert lease.held_after == ["ssd", "ssd", "dram", "dram", "dram", "dram"]
    await asyncio.sleep(0.05)
    assert rig.tiers(hashes) == ["dram", "dram", "ssd", "ssd"] + ["dram"] * 4
    assert rig.node.stats().tiers["ssd"].promotions == 0
    rig.node.release(lease.lease_id)
    cold = rig.node.probe(rig.engine.engine_id, hashes[2:4])
    assert (cold.lease_id, cold.slot_ids, cold.held_after) == (EMPTY_LEASE, [], ["ssd", "ssd"])
    rig.node.abort(blank.lease_id)
    await _landed(rig, hashes[2:4])  # nothing of that chain in DRAM: 4-7 made room for it
    assert rig.node.stats().tiers["dram"].pinned_blocks == 0


async def _landed(rig: Rig, hashes: list[BlockHash], timeout: float = 10.0) -> None:
    """Wait until every block of ``hashes`` is in DRAM (promotions land on the event loop)."""
    deadline = time.monotonic() + timeout
    while rig.tiers(hashes) != ["dram"] * len(hashes):
        assert time.monotonic() < deadline, rig.tiers(hashes)
        await asyncio.sleep(0.005)


async def test_a_miss_pins_nothing_and_holds_no_lease(rig: Rig) -> None:
    """An acquire of a chain nobody stored returns the empty lease: nothing pinned, nothing
    tracked (misses under load cannot pile up leases), and releasing it is a no-op."""
    lease = await rig.node.acquire(rig.engine.engine_id, chain(4))
    assert (lease.lease_id, lease.slot_ids, lease.checksums) == (EMPTY_LEASE, [], [])
    rig.node.release(lease.lease_id)
    rig.node.release(lease.lease_id)
    assert rig.node.stats().tiers["dram"].pinned_blocks == 0


async def test_release_reporting_a_corrupt_block_drops_it_after_a_recheck(rig: Rig) -> None:
    """A report names block 1 of a 3-block lease: a false report (bytes intact) changes nothing;
    a true one while another lease pins the block is confirmed at once: no lookup counts it and
    no acquire pins it from then on, and it goes with that lease's plain release (a checksum
    failure, not an eviction), so the chain's held prefix becomes 1 block."""
    hashes = chain(3)
    rig.store(hashes)
    eng = rig.engine.engine_id
    lease = await rig.node.acquire(eng, hashes)
    with pytest.raises(ValueError, match="corrupt_from 3 is outside"):
        rig.node.release(lease.lease_id, corrupt_from=3)
    assert rig.node.release(lease.lease_id, corrupt_from=1) is False  # intact: nothing dropped
    offset = rig.engine.geometry.offset(lease.slot_ids[1])
    rig.arena.view(offset + 7, 1)[0] ^= 0xFF
    first, second = await rig.node.acquire(eng, hashes), await rig.node.acquire(eng, hashes)
    assert rig.node.release(first.lease_id, corrupt_from=1) is True  # bad; second still pins it
    assert rig.tiers(hashes) == ["dram"]
    third = await rig.node.acquire(eng, hashes)
    assert len(third.slot_ids) == 1 and rig.node.stats().tiers["dram"].used_blocks == 3
    rig.node.release(second.lease_id)
    rig.node.release(third.lease_id)
    assert rig.tiers(hashes) == ["dram"]
    stats = rig.node.stats()
    assert (stats.checksum_failures, stats.tiers["dram"].evictions) == (1, 0)
    assert stats.tiers["dram"].used_blocks == 2
    assert [type(e).__name__ for e in rig.node.take_events()][-1] == "BlockRemoved"
    rig.node.check_integrity()


async def test_a_corrupt_block_reported_during_its_ssd_write_goes_when_the_write_returns(
        rig: Rig) -> None:
    """Block 1 of 3 damaged in DRAM, reported while a write-behind pass writes the chain to SSD:
    it stays until the write returns (its slot is being read), then goes; the SSD refused its
    bad bytes, so the chain's held prefix is block 0 in DRAM and nothing of block 1 anywhere."""
    hashes = chain(3)
    rig.store(hashes)
    eng = rig.engine.engine_id
    lease = await rig.node.acquire(eng, hashes)
    rig.arena.view(rig.engine.geometry.offset(lease.slot_ids[1]) + 7, 1)[0] ^= 0xFF
    block = rig.node._tiers.dram.get(make_key(rig.engine.namespace, hashes[1]))
    assert block is not None
    behind = asyncio.create_task(rig.node.write_behind())
    for _ in range(1000):
        if block.demoting:
            break
        await asyncio.sleep(0)
    assert block.demoting                                  # the SSD write reads its slot now
    assert rig.node.release(lease.lease_id, corrupt_from=1) is True
    assert rig.node.stats().tiers["dram"].used_blocks == 3
    assert await behind == 2
    assert rig.tiers(hashes) == ["dram"]
    assert not rig.ssd.contains(rig.engine.namespace, hashes[1])
    assert rig.node.stats().tiers["dram"].used_blocks == 2
    rig.node.check_integrity()


async def test_a_silent_engine_lapses_and_its_hbm_report_goes(make_rig: MakeRig) -> None:
    """With engine idle_seconds=60: the engine silent for 60 s is unregistered by maintain
    (its HBM report dropped, the watcher told, its next call NotFound); the one that called
    at 59 s stays."""
    rig = make_rig(engines=EngineCaps(idle_seconds=60.0))
    other = rig.node.register_engine("default", LAYOUT, "other")
    rig.node.report_hbm(rig.engine.engine_id, chain(3, "h"), [])
    gone: list[str] = []
    rig.node.watch_engines(gone.append)
    rig.clock.advance(59)
    rig.node.lookup(other.engine_id, chain(1))
    await rig.node.maintain()
    assert gone == [] and rig.node.stats().hbm_blocks == {rig.engine.engine_id: 3}
    rig.clock.advance(1)
    await rig.node.maintain()
    assert gone == [rig.engine.engine_id] and rig.node.stats().hbm_blocks == {}
    with pytest.raises(NotFound, match="unknown engine"):
        rig.node.lookup(rig.engine.engine_id, chain(1))
    assert [e.engine_id for e in rig.node.engines_of("default")] == [other.engine_id]
    rig.node.check_integrity()


async def test_engines_per_tenant_and_name_size_are_capped(make_rig: MakeRig) -> None:
    """max_per_tenant=2 and max_name_bytes=8: a third engine of the tenant is
    ResourceExhausted naming the key, another tenant is not affected, a 9-byte name is a
    ValueError naming the key; unregistering frees a place."""
    rig = make_rig(engines=EngineCaps(max_per_tenant=2, max_name_bytes=8))
    rig.node.register_engine("default", LAYOUT, "b")
    with pytest.raises(ResourceExhausted, match="max_engines_per_tenant = 2"):
        rig.node.register_engine("default", LAYOUT, "c")
    rig.node.register_engine("team-b", LAYOUT, "c")
    with pytest.raises(ValueError, match="9 bytes; at most 8 .max_name_bytes."):
        rig.node.register_engine("team-b", LAYOUT, "x" * 9)
    rig.node.unregister_engine(rig.engine.engine_id)
    rig.node.register_engine("default", LAYOUT, "d")
    rig.node.check_integrity()
