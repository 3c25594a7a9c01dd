"""Write-behind and the flush at a graceful stop: committed blocks reach SSD without the
watermarks, a stop writes DRAM-only blocks most recently used first within the SSD's bound,
and a restart finds the cache, in-process on default settings and after a kill -9 of a real
`tierd serve`. Each node-level test ends with ``check_integrity``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tierd.checksum import block_checksum
from tierd.daemon.arena import ShmArena
from tierd.daemon.client import TierdClient
from tierd.daemon.config import TierdConfig
from tierd.daemon.layout import Layout
from tierd.daemon.node import EngineInfo, NodeConfig, NodeStore
from tierd.daemon.server import Daemon
from tierd.daemon.slots import SlabAllocator
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.events import BlockStored
from tierd.types import BlockHash

LAYOUT = Layout(num_layers=1, num_kv_heads=1, head_size=16, dtype="float16", block_size=16)
BLOCK = LAYOUT.block_bytes            # 1024 bytes
ARENA = 8 * BLOCK                     # 8 slots: 2 slabs of 4
SSD = 4 * (BLOCK + HEADER_BYTES)      # 4 records


def chain(n: int, seed: str = "a") -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(f"{seed}/{i}".encode()).digest()) for i in range(n)]


def payload(block_hash: BlockHash, size: int = BLOCK) -> bytes:
    return (block_hash * (size // len(block_hash) + 1))[:size]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    node: NodeStore
    arena: ShmArena
    ssd: SsdStore
    clock: FakeClock
    engine: EngineInfo

    def store(self, hashes: list[BlockHash]) -> None:
        res = self.node.reserve(self.engine.engine_id, hashes)
        sums: list[int | None] = []
        for h, slot in zip(hashes, res.slot_ids):
            if slot is not None:
                self.arena.view(self.engine.geometry.offset(slot), BLOCK)[:] = payload(h)
            sums.append(None if slot is None else block_checksum(payload(h)))
        self.node.commit(res.lease_id, sums)

    def tiers(self, hashes: list[BlockHash]) -> list[str]:
        return list(self.node.lookup(self.engine.engine_id, hashes).tiers)


@pytest.fixture
async def make_rig(tmp_path: Path) -> AsyncIterator[Callable[..., Rig]]:
    """Factory of node stores over a real arena and SSD directory (``make_rig(ssd_dir=,
    **NodeConfig overrides)``); each is checked and closed at teardown."""
    rigs: list[Rig] = []

    def make(ssd_dir: str | None = None, **config: Any) -> Rig:
        arena = ShmArena.create(f"tierd-test-{os.getpid()}-{secrets.token_hex(4)}", ARENA,
                                prefault=False)
        ssd = SsdStore(ssd_dir or tmp_path / "ssd", SSD, io_threads=2)
        clock = FakeClock()
        node = NodeStore(arena, SlabAllocator(ARENA, 4 * BLOCK), ssd, NodeConfig(**config),
                         clock=clock)
        node.open()
        rig = Rig(node, arena, ssd, clock, node.register_engine("default", LAYOUT, "eng"))
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.node.check_integrity()
        if rig.ssd.healthy:
            await rig.node.close()
        rig.arena.close()
        rig.arena.unlink()


async def test_write_behind_gives_committed_blocks_an_ssd_copy(make_rig: Callable[..., Rig]
                                                               ) -> None:
    """Three blocks committed into a nearly empty arena (far below the watermarks) get SSD
    copies from one write-behind pass, oldest first; their DRAM copies stay."""
    rig = make_rig()
    hashes = chain(3)
    rig.store(hashes)
    rig.node.take_events()
    await rig.node.maintain()                                  # the watermarks do nothing
    assert rig.node.stats().tiers["ssd"].used_blocks == 0
    assert await rig.node.write_behind() == 3
    assert rig.node.take_events() == [BlockStored((h,), None, "ssd") for h in hashes]
    stats = rig.node.stats()
    assert (stats.tiers["ssd"].used_blocks, stats.tiers["dram"].used_blocks) == (3, 3)
    assert rig.tiers(hashes) == ["dram"] * 3
    assert await rig.node.write_behind() == 0                  # nothing new: nothing written
    assert rig.node.metrics.registry.get_sample_value(
        "tierd_persisted_blocks_total", {"how": "write_behind"}) == 3.0
    rig.node.check_integrity()


async def test_write_behind_skips_evicted_and_unadmitted_blocks(make_rig: Callable[..., Rig]
                                                                ) -> None:
    """With ssd_min_hits=1 a block never hit is not written behind (the SSD's admission), and
    a block evicted before the pass is forgotten; an acquired one is written."""
    rig = make_rig(ssd_min_hits=1)
    hashes = chain(8)
    rig.store(hashes)                                          # the arena is full
    lease = await rig.node.acquire(rig.engine.engine_id, hashes[7:])
    rig.node.release(lease.lease_id)
    rig.store(chain(1, "b"))                                   # evicts hashes[0]
    assert rig.tiers(hashes[:1]) == []
    assert await rig.node.write_behind() == 1
    assert rig.ssd.contains(rig.engine.namespace, hashes[7])
    assert len(rig.ssd) == 1
    rig.node.check_integrity()


async def test_a_block_evicted_while_its_batch_waits_is_not_written(
        make_rig: Callable[..., Rig]) -> None:
    """A batch taken while a demotion holds the maintenance lock: a block evicted meanwhile
    (its slot now holds another block) is left out, so no stale slot is written (it was, and
    the SSD refused it as a checksum failure); four of the rest fit the bound, and the new
    block, written next, takes the place of the oldest of them."""
    rig = make_rig()
    hashes = chain(8)
    rig.store(hashes)                                          # the arena is full
    async with rig.node._maintaining:                          # as a maintain pass would
        behind = asyncio.create_task(rig.node.write_behind())
        await asyncio.sleep(0)                                 # it took its batch, waits
        rig.store(chain(1, "c"))                               # evicts hashes[0]
    assert await behind == 5
    assert [rig.ssd.contains(rig.engine.namespace, h) for h in hashes[:5] + chain(1, "c")] == [
        False, False, True, True, True, True]
    assert rig.ssd.checksum_failures == 0
    rig.node.check_integrity()


async def test_write_behind_writes_nothing_while_the_ssd_is_unhealthy(
        make_rig: Callable[..., Rig]) -> None:
    """A hidden SSD tier takes no write-behind; what was noted is forgotten, not retried."""
    rig = make_rig()
    rig.store(chain(2))
    rig.ssd.healthy = False
    assert await rig.node.write_behind() == 0
    rig.ssd.healthy = True
    assert await rig.node.write_behind() == 0
    assert len(rig.ssd) == 0
    rig.node.check_integrity()


async def test_close_writes_dram_only_blocks_most_recent_first(make_rig: Callable[..., Rig],
                                                               tmp_path: Path) -> None:
    """Eight DRAM-only blocks, 2 and 5 acquired last, an SSD bound of four records: close
    writes the four most recently used (5, 2, 7, 6), dropping none of them for the others,
    and a new node on the directory finds exactly those."""
    shared = str(tmp_path / "shared")
    first = make_rig(ssd_dir=shared, write_behind_seconds=0.0)
    hashes = chain(8)
    first.store(hashes)
    for i in (2, 5):
        lease = await first.node.acquire(first.engine.engine_id, [hashes[i]])
        first.node.release(lease.lease_id)
    flushed = await first.node.close()
    assert (flushed.written, flushed.left) == (4, 4)
    second = make_rig(ssd_dir=shared)
    held = [i for i, h in enumerate(hashes) if second.tiers([h]) == ["ssd"]]
    assert held == [2, 5, 6, 7]
    second.node.check_integrity()


async def test_close_with_no_flush_budget_writes_nothing(make_rig: Callable[..., Rig],
                                                         tmp_path: Path) -> None:
    """stop_flush_seconds=0: close writes no block (the budget is spent before the first)."""
    shared = str(tmp_path / "shared")
    first = make_rig(ssd_dir=shared, stop_flush_seconds=0.0, write_behind_seconds=0.0)
    first.store(chain(3))
    assert (await first.node.close()).written == 0
    second = make_rig(ssd_dir=shared)
    assert second.tiers(chain(3)) == []


def _run_daemon(config: TierdConfig, body: Callable[[], None]) -> None:
    """Start a daemon on its own loop thread, run ``body`` against it, stop it gracefully."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    daemon = asyncio.run_coroutine_threadsafe(Daemon.start(config), loop).result(timeout=120)
    try:
        body()
    finally:
        asyncio.run_coroutine_threadsafe(daemon.stop(grace=0.5), loop).result(timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_restart_on_default_settings_finds_the_prefix(workdir: str, kit: Any) -> None:
    """The issue's scenario: a 2,048-token prefix committed into a mostly empty arena on the
    default settings (watermarks 0.90/0.75, 1 GiB arena), a graceful stop and a start on the
    same SSD directory: all 128 blocks are found on SSD and copy out bit-exact."""
    config = TierdConfig(socket_path=os.path.join(workdir, "tierd.sock"),
                         ssd_dir=os.path.join(workdir, "ssd"))
    hashes = kit.chain(128)
    client = TierdClient(socket_path=config.socket_path, timeout=30.0)

    def save() -> None:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes) == 128
        arena.close()

    def load() -> None:
        engine = client.register_engine(kit.layout)
        assert client.lookup(engine.engine_id, hashes) == ["ssd"] * 128
        arena = kit.attach(engine)
        got = client.acquire(engine.engine_id, hashes)
        size = engine.geometry.slot_bytes
        for key, slot in zip(hashes, got.slot_ids):
            assert bytes(arena.view(engine.geometry.offset(slot), size)) == \
                kit.block_bytes(key, size)
        client.release(engine.engine_id, got.lease_id)
        arena.close()

    _run_daemon(config, save)
    _run_daemon(config, load)
    client.close()


def _serve(workdir: str) -> subprocess.Popen[bytes]:
    """`tierd serve` with the default policy (watermarks, write-behind 2 s), a small arena."""
    return subprocess.Popen(
        [sys.executable, "-m", "tierd.commands.serve",
         "--socket-path", os.path.join(workdir, "tierd.sock"), "--dram-bytes", "16MiB",
         "--slab-bytes", "64KiB", "--no-prefault", "--ssd-dir", os.path.join(workdir, "ssd"),
         "--ssd-bytes", "8MiB", "--log-level", "WARNING"],
        env={**os.environ, "TIERD_CONFIG": ""}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _connect(workdir: str, process: subprocess.Popen[bytes]) -> TierdClient:
    client = TierdClient(socket_path=os.path.join(workdir, "tierd.sock"), timeout=10.0)
    try:
        client.wait_ready(timeout=60)
    except Exception:
        process.kill()
        raise AssertionError(f"tierd serve did not come up: {process.communicate()[1]!r}")
    return client


def test_kill_9_loses_at_most_the_write_behind_window(
        workdir: str, kit: Any, processes: list[subprocess.Popen[bytes]]) -> None:
    """Default settings, 64 blocks committed and left alone until Stats shows them on SSD (the
    write-behind, no watermark involved), 64 more committed just before kill -9: after the
    restart every one of the first 64 is back bit-exact; of the last 64 (inside the window)
    only some may be, each bit-exact."""
    older, recent = kit.chain(64, seed=1), kit.chain(64, seed=2)
    first = _serve(workdir)
    processes.append(first)
    with _connect(workdir, first) as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, older) == 64
        for _ in range(600):                                   # a readiness wait (<= 60 s)
            if client.stats().tiers[2].used_blocks >= 64:
                break
            threading.Event().wait(0.1)
        assert client.stats().tiers[2].used_blocks == 64, "the write-behind never wrote"
        assert kit.store_blocks(client, engine, arena, recent) == 64
        arena.close()
    first.send_signal(signal.SIGKILL)
    first.wait()

    second = _serve(workdir)
    processes.append(second)
    with _connect(workdir, second) as client:
        engine = client.register_engine(kit.layout)
        assert client.lookup(engine.engine_id, older) == ["ssd"] * 64
        survived = [h for h in recent if client.lookup(engine.engine_id, [h]) == ["ssd"]]
        arena = kit.attach(engine)
        size = engine.geometry.slot_bytes
        for hashes in (older, survived):
            got = client.acquire(engine.engine_id, hashes) if hashes else None
            if got is None:
                continue
            for key, slot, checksum in zip(hashes, got.slot_ids, got.checksums):
                data = bytes(arena.view(engine.geometry.offset(slot), size))
                assert data == kit.block_bytes(key, size) and block_checksum(data) == checksum
            client.release(engine.engine_id, got.lease_id)
        arena.close()
        print(f"kill -9: 64/64 older blocks back, {len(survived)}/64 of the window's")
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0
