"""The SSD tier on a filesystem that fills up: a real small tmpfs (mounted per test; skipped where
mounting is not permitted) for ENOSPC, an injected EDQUOT from fdatasync, the start-up warning of
a filesystem smaller than the bound, and a node store that keeps serving its SSD blocks."""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierd.checksum import block_checksum
from tierd.daemon.arena import OwnedArena
from tierd.daemon.node import NodeConfig, NodeStore
from tierd.daemon.slots import SlabAllocator
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.events import AllBlocksCleared
from tierd.types import BlockHash, Namespace
from tierd.wire.layout import Layout

NS = Namespace(b"N" * 16)
BLOCK = 64 << 10
REC = HEADER_BYTES + BLOCK
LAYOUT = Layout(num_layers=4, num_kv_heads=4, head_size=64, dtype="float16", block_size=16,
                model_id="test-model@0")
assert LAYOUT.block_bytes == BLOCK


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def payload(i: int) -> memoryview:
    return memoryview(i.to_bytes(8, "big") * (BLOCK // 8))


def mount_tmpfs(directory: Path, size: str) -> None:
    """Mount a tmpfs of ``size`` on ``directory``, or skip the test saying why it cannot."""
    directory.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here to make a small filesystem to fill")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(directory)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a {size} tmpfs to fill needs root or CAP_SYS_ADMIN: "
                    f"{proc.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted after the test."""
    fs = tmp_path / "fs"
    mount_tmpfs(fs, "2m")
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def fill(fs: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` on ``fs`` (others' data: what leaves the tier too little room)."""
    filler = fs / "other-data"
    filler.write_bytes(os.urandom(nbytes))
    return filler


async def put(store: SsdStore, lru: list[int], i: int) -> bool:
    """What the node store does for one block: evict the oldest until it fits under the
    effective bound, then write it. Whether it was written."""
    while lru and store.used_bytes + store.record_bytes(BLOCK) > store.capacity_bytes:
        store.remove(NS, h(lru.pop(0)))
    p = payload(i)
    if await store.write(NS, h(i), p, block_checksum(p)) is None:
        return False
    lru.append(i)
    return True


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def test_enospc_lowers_the_bound_evicts_and_grows_back_when_space_returns(
        small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another file leaves the 1 MiB-footprint tier about 0.5 MiB: writes hit ENOSPC, the bound
    drops under the live bytes with one warning, the store stays healthy and keeps writing by
    evicting; once the file is deleted the bound grows back to full over a few writes (one
    warning), and every indexed block reads back bit-exact."""
    filler = fill(small_fs, 1536 << 10)
    store = SsdStore(small_fs / "ssd", footprint_bytes=1 << 20)
    store.open()
    lru: list[int] = []
    with caplog.at_level("WARNING", logger="tierd.daemon.ssd.store"):
        written = [await put(store, lru, i) for i in range(30)]
        assert store.healthy and store.no_space_errors >= 1
        assert store.capacity_bytes < store.full_bytes and store.used_bytes <= store.capacity_bytes
        assert written.count(False) == store.no_space_errors <= 2  # not a failure a write
        assert len(warnings_of(caplog, "disk is full")) == 1
        store.check_integrity(disk=True)
        filler.unlink()
        for i in range(30, 50):
            assert await put(store, lru, i)
        assert store.capacity_bytes == store.full_bytes
        assert store.no_space_errors == written.count(False)
        assert len(warnings_of(caplog, "room again")) == 1
        assert len(warnings_of(caplog, "disk is full")) == 1
    assert store.physical_bytes <= store.footprint_bytes == 1 << 20
    for i in lru:
        into = bytearray(BLOCK)
        assert await store.read(NS, h(i), memoryview(into)) and into == payload(i)
    assert len(lru) == len(store) == store.used_bytes // REC
    store.check_integrity(disk=True)
    store.close()


async def test_a_disk_that_stays_full_keeps_the_bound_low_without_a_flood(
        small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bound far above a 2 MiB filesystem: start-up warns once naming the fix; 200 writes
    later the store is healthy, has written most of them, warned of a full disk once, and the
    bound sits near what the filesystem holds."""
    with caplog.at_level("WARNING", logger="tierd.daemon.ssd.store"):
        store = SsdStore(small_fs / "ssd", footprint_bytes=64 << 20, segment_bytes=4 * REC)
        store.open()
        small = warnings_of(caplog, "set ssd_bytes to at most")
        assert len(small) == 1 and "less than the 67108864 its bound needs" in small[0]
        lru: list[int] = []
        written = [await put(store, lru, i) for i in range(200)]
    assert store.healthy and written.count(True) >= 180
    assert len(warnings_of(caplog, "disk is full")) == 1
    assert store.capacity_bytes <= 2 << 20 < store.full_bytes
    store.check_integrity(disk=True)
    store.close()


async def test_edquot_from_the_sync_is_a_full_disk_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quota error (EDQUOT) from fdatasync: the batch is not acknowledged, the bound is
    lowered, the store stays healthy; the next write works and indexes its block."""
    store = SsdStore(tmp_path, 16 * REC)
    store.open()
    lru: list[int] = []
    for i in range(4):
        assert await put(store, lru, i)
    real = os.fdatasync

    def quota_exceeded(fd: int) -> None:
        monkeypatch.setattr(os, "fdatasync", real)
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "fdatasync", quota_exceeded)
    assert not await put(store, lru, 4)
    assert (store.healthy, store.write_errors, store.no_space_errors) == (True, 1, 1)
    assert store.capacity_bytes == 4 * REC * 7 // 8 // 512 * 512
    assert await put(store, lru, 5)
    assert lru == [2, 3, 5] and store.contains(NS, h(5))  # 3.5 records of room: 2 evicted
    store.check_integrity(disk=True)
    store.close()


async def test_node_keeps_serving_ssd_blocks_when_the_disk_fills(
        small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A node demoting 48 blocks of 64 KiB into a 2 MiB filesystem with a 16 MiB bound: the SSD
    tier never goes unhealthy, never hides its blocks (no AllBlocksCleared), the newest demoted
    blocks look up as "ssd"; the metrics show the lowered bound and the no-space errors, and
    one warning was logged."""
    arena = OwnedArena.create(f"tierd-test-{os.getpid()}-{secrets.token_hex(4)}", 8 * BLOCK,
                            prefault=False)
    ssd = SsdStore(small_fs / "ssd", footprint_bytes=16 << 20, io_threads=2)
    node = NodeStore(arena, SlabAllocator(8 * BLOCK, 4 * BLOCK), ssd,
                     NodeConfig(dram_high_watermark=0.1, dram_low_watermark=0.1))
    try:
        node.open()
        engine = node.register_engine("default", LAYOUT, "eng")
        with caplog.at_level("WARNING"):
            for r in range(12):
                hashes = [h(4 * r + k) for k in range(4)]
                res = node.reserve(engine.engine_id, hashes)
                for k, slot in enumerate(res.slot_ids):
                    assert slot is not None
                    arena.view(engine.geometry.offset(slot), BLOCK)[:] = payload(4 * r + k)
                node.commit(res.lease_id, [block_checksum(payload(4 * r + k)) for k in range(4)])
                await node.maintain()
                assert node.stats().ssd_healthy
                node.check_integrity()
        assert not any(isinstance(e, AllBlocksCleared) for e in node.take_events())
        assert list(node.lookup(engine.engine_id, [h(46), h(47)]).tiers) == ["ssd", "ssd"]
        assert len(warnings_of(caplog, "disk is full")) == 1
        assert not warnings_of(caplog, "unhealthy")
        sample = node.metrics.registry.get_sample_value
        assert sample("tierd_ssd_write_errors_total", {"error": "no_space"}) == ssd.no_space_errors
        assert ssd.no_space_errors >= 1
        assert sample("tierd_ssd_write_errors_total", {"error": "other"}) == 0
        assert sample("tierd_ssd_bound_bytes") == ssd.capacity_bytes < ssd.full_bytes
        assert sample("tierd_ssd_full_bound_bytes") == ssd.full_bytes
        assert sample("tierd_ssd_file_bytes") == ssd.physical_bytes
        lease = await node.acquire(engine.engine_id, [h(47)])
        assert bytes(arena.view(engine.geometry.offset(lease.slot_ids[0]), BLOCK)) == payload(47)
        node.release(lease.lease_id)
        node.check_integrity()
    finally:
        await node.close()
        arena.close()
        arena.unlink()
    await asyncio.sleep(0)
