"""The node store over a real shared-memory arena, slab allocator and SSD directory: store,
look up, acquire and copy out bit-exact from DRAM and SSD; demotion and promotion order; leases;
namespaces; bad input. Each test ends with ``check_integrity``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from node_rig import BLOCK, LAYOUT, SSD, MakeRig, Rig, chain, payload  # noqa: E402

from tierd.checksum import block_checksum
from tierd.daemon.errors import FailedPrecondition, NotFound, ResourceExhausted
from tierd.daemon.listeners import Payload
from tierd.daemon.metrics import NodeMetrics, NodeStats, TierStats
from tierd.daemon.node import EMPTY_LEASE
from tierd.daemon.node_types import EngineCaps
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.events import AllBlocksCleared, BlockRemoved, BlockStored
from tierd.types import BlockHash, NamespacedKey, Tier


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
    assert rig.node.take_events() == [BlockRemoved((h,), "dram") for h in old[2:]] + [
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


async def test_full_ssd_drops_its_lru_blocks(rig: Rig) -> None:
    """The 4-record SSD takes 2 demotions per pass; the third pass drops SSD's LRU pair."""
    hashes = chain(14)
    rig.store(hashes[:8])
    await rig.node.maintain()                  # 0, 1 -> SSD
    rig.store(hashes[8:10])
    await rig.node.maintain()                  # 2, 3 -> SSD (full: 4 records)
    rig.store(hashes[10:12])
    rig.node.take_events()
    await rig.node.maintain()                  # 4, 5 -> SSD, dropping 0, 1
    assert rig.node.take_events() == [
        BlockRemoved((hashes[0],), "ssd"), BlockRemoved((hashes[1],), "ssd"),
        BlockStored((hashes[4],), None, "ssd"), BlockStored((hashes[5],), None, "ssd"),
        BlockRemoved((hashes[4],), "dram"), BlockRemoved((hashes[5],), "dram")]
    stats = rig.node.stats()
    assert stats.tiers["ssd"].evictions == 2 and stats.tiers["ssd"].used_blocks == 4
    assert stats.tiers["ssd"].used_bytes == SSD == stats.tiers["ssd"].capacity_bytes
    rig.node.check_integrity()


class Evictions:
    """A ``TierListener`` that takes every evicted block's bytes, noting at that moment whether
    they were already read and whether the SSD record still existed."""

    def __init__(self) -> None:
        self.taken: list[tuple[BlockHash, bool, asyncio.Future[bytes | None]]] = []

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        pass

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        pass

    def cleared(self, tier: Tier) -> None:
        pass

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        got = payload()
        self.taken.append((BlockHash(key[-32:]), got.done(), got))


async def test_ssd_eviction_reads_the_evicted_record_off_the_event_loop(
        make_rig: MakeRig) -> None:
    """The SSD's LRU pair, dropped to make room, is handed to the listener as reads in flight on
    an I/O thread (not done when ``evicted`` returns); their records are deleted at once and
    the reads still deliver each block's bytes."""
    evictions = Evictions()
    rig = make_rig(listener=evictions)
    hashes = chain(12)
    rig.store(hashes[:8])
    await rig.node.maintain()                  # 0, 1 -> SSD
    rig.store(hashes[8:10])
    await rig.node.maintain()                  # 2, 3 -> SSD (full: 4 records)
    rig.store(hashes[10:12])
    await rig.node.maintain()                  # 4, 5 -> SSD, dropping 0, 1
    assert [(h, done) for h, done, _ in evictions.taken] == [(hashes[0], False),
                                                              (hashes[1], False)]
    assert not any(rig.ssd.contains(rig.engine.namespace, h) for h in hashes[:2])
    assert [await got for _, _, got in evictions.taken] == [payload(h) for h in hashes[:2]]
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


async def test_corrupt_ssd_record_is_a_miss(rig: Rig) -> None:
    """A demoted block whose record is flipped on disk ends the acquired prefix there, is
    dropped from the index and counted; the slot it was staged in is freed."""
    hashes = chain(8)
    rig.store(hashes)
    await rig.node.maintain()                                  # 0, 1 -> SSD
    span = rig.ssd.locate(rig.engine.namespace, hashes[1])
    assert span is not None
    raw = bytearray(span.path.read_bytes())
    raw[span.offset + span.size - 1] ^= 0xFF               # the record's last payload byte
    span.path.write_bytes(raw)
    rig.node.take_events()
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert len(lease.slot_ids) == 1
    assert rig.copy_out(lease.slot_ids) == [payload(hashes[0])]
    assert BlockRemoved((hashes[1],), "ssd") in rig.node.take_events()
    assert rig.tiers(hashes) == ["dram"]
    stats = rig.node.stats()
    assert stats.checksum_failures == 1 and stats.tiers["ssd"].used_blocks == 1
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_unusable_ssd_directory_degrades_to_dram_only(make_rig: MakeRig,
                                                            tmp_path: Path) -> None:
    """An SSD "directory" that is a file: the node serves DRAM only, maintain evicts nothing
    it cannot demote, reserve evicts on demand, stats say unhealthy."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    rig = make_rig(ssd_dir=str(blocker))
    hashes = chain(8)
    rig.store(hashes)
    await rig.node.maintain()
    assert rig.tiers(hashes) == ["dram"] * 8
    stats = rig.node.stats()
    assert stats.ssd_healthy is False and stats.tiers["dram"].used_blocks == 8
    assert rig.node.metrics.registry.get_sample_value("tierd_ssd_healthy") == 0.0
    res = rig.store(chain(2, "b"))
    assert None not in res.slot_ids
    assert rig.tiers(hashes) == []                            # 0, 1 evicted for them
    rig.node.check_integrity()


async def test_ssd_going_unhealthy_hides_it_and_a_good_write_brings_it_back(rig: Rig) -> None:
    """When the SSD store reports unhealthy its blocks stop being served (AllBlocksCleared);
    a successful probe demotion brings them back (one BlockStored of them all)."""
    hashes = chain(8)
    rig.store(hashes)
    await rig.node.maintain()                                  # 0, 1 -> SSD
    rig.node.take_events()
    rig.ssd.healthy = False                                    # as after a disk error
    assert rig.tiers(hashes) == []
    new = chain(2, "b")
    rig.store(new)                                             # 8/8 again
    await rig.node.maintain()                                  # probe: 2 -> SSD, healthy
    assert rig.node.take_events() == [
        BlockStored(tuple(new), None, "dram", 16), AllBlocksCleared("ssd"),
        BlockStored((hashes[2],), None, "ssd"),
        BlockStored((hashes[0], hashes[1], hashes[2]), None, "ssd"),
        BlockRemoved((hashes[2],), "dram")]
    assert rig.node.stats().ssd_healthy is True
    assert rig.tiers(hashes[:4]) == ["ssd", "ssd", "ssd", "dram"]
    rig.node.check_integrity()


async def test_restart_finds_ssd_blocks_again(make_rig: MakeRig, tmp_path: Path) -> None:
    """A new node on the same SSD directory serves the demoted blocks bit-exact (no flush at
    close: only the demotion wrote)."""
    first = make_rig(ssd_dir=str(tmp_path / "shared"), stop_flush_seconds=0.0)
    hashes = chain(8)
    first.store(hashes)
    await first.node.maintain()
    await first.node.close()
    second = make_rig(ssd_dir=str(tmp_path / "shared"))
    assert second.tiers(hashes[:2]) == ["ssd", "ssd"]
    lease = await second.node.acquire(second.engine.engine_id, hashes[:2])
    assert second.copy_out(lease.slot_ids) == [payload(h) for h in hashes[:2]]
    second.node.release(lease.lease_id)
    second.node.check_integrity()


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
        BlockRemoved((h,), "dram") for h in [*others, hashes[0]]]
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
def test_reading_follows_the_essay(ratio: float, words: str) -> None:
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


async def test_restart_with_a_smaller_bound_drops_the_oldest_records(make_rig: MakeRig,
                                                                     tmp_path: Path) -> None:
    """Reopened with room for one record, the node keeps the newest (append order) and drops
    the other (no flush at close: only the demotion wrote)."""
    first = make_rig(ssd_dir=str(tmp_path / "shared"), stop_flush_seconds=0.0)
    hashes = chain(8)
    first.store(hashes)
    await first.node.maintain()                                # 0, 1 written
    await first.node.close()
    second = make_rig(ssd_dir=str(tmp_path / "shared"), ssd_bytes=BLOCK + HEADER_BYTES)
    assert second.tiers(hashes[1:2]) == ["ssd"] and second.tiers(hashes[:1]) == []
    assert second.node.take_events()[-1] == BlockRemoved((hashes[0],), "ssd")
    second.ssd.check_integrity(disk=True)
    second.node.check_integrity()


async def test_acquire_with_count_lookup_counts_like_a_lookup(make_rig: MakeRig,
                                                              tmp_path: Path) -> None:
    """Two identical rigs (8 blocks stored, 0-1 demoted to SSD, block 8 missing): a lookup of
    9 blocks on one and an acquire with count_lookup on the other count the same 9 * 16 query
    tokens and 2 * 16 SSD + 6 * 16 DRAM hit tokens; an acquire without it counts nothing."""
    counted = []
    for use_acquire in (False, True):
        rig = make_rig(ssd_dir=str(tmp_path / f"ssd-{use_acquire}"))
        hashes = chain(9)
        rig.store(hashes[:8])
        await rig.node.maintain()                              # 0, 1 -> SSD
        if use_acquire:
            lease = await rig.node.acquire(rig.engine.engine_id, hashes, count_lookup=True)
            assert len(lease.slot_ids) == 8
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


async def test_a_miss_pins_nothing_and_holds_no_lease(rig: Rig) -> None:
    """An acquire of a chain nobody stored returns the empty lease: nothing pinned, nothing
    tracked (misses under load cannot pile up leases), and releasing it is a no-op."""
    lease = await rig.node.acquire(rig.engine.engine_id, chain(4))
    assert (lease.lease_id, lease.slot_ids, lease.checksums) == (EMPTY_LEASE, [], [])
    rig.node.release(lease.lease_id)
    rig.node.release(lease.lease_id)
    assert rig.node.stats().tiers["dram"].pinned_blocks == 0


async def test_release_reporting_a_corrupt_block_drops_it_after_a_recheck(rig: Rig) -> None:
    """A report names block 1 of a 3-block lease: a false report (bytes intact) or one while
    another lease pins it changes nothing; a true one drops exactly that block (a checksum
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
    assert rig.node.release(first.lease_id, corrupt_from=1) is False  # still pinned by second
    assert rig.node.release(second.lease_id, corrupt_from=1) is True
    assert rig.tiers(hashes) == ["dram"]
    stats = rig.node.stats()
    assert (stats.checksum_failures, stats.tiers["dram"].evictions) == (1, 0)
    assert [type(e).__name__ for e in rig.node.take_events()][-1] == "BlockRemoved"


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
