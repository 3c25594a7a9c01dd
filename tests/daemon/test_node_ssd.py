"""The node store's SSD side over a real arena and SSD directory: a full SSD, evictions handed
to a listener off the event loop, corrupt and unusable SSD state, restarts finding the records
again. Each test ends with ``check_integrity``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from node_rig import BLOCK, SSD, MakeRig, Rig, chain, payload  # noqa: E402

from tierd.daemon.listeners import Payload
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.events import AllBlocksCleared, BlockRemoved, BlockStored
from tierd.types import BlockHash, NamespacedKey, Tier


@pytest.fixture
def rig(make_rig: MakeRig) -> Rig:
    return make_rig()



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
