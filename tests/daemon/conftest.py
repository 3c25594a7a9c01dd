"""Fixtures of the daemon's tests: a real daemon (real shared-memory arena, real SSD directory)
serving on a temporary Unix socket, on its own event loop in a background thread, so tests use
the blocking ``TierdClient`` exactly as a caller would."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tierd.bench.tierd_serve import TierdServe
from tierd.daemon.arena import OwnedArena
from tierd.daemon.config import TierdConfig
from tierd.daemon.listeners import TierListener
from tierd.daemon.node import NodeConfig, NodeStore
from tierd.daemon.server import Daemon
from tierd.daemon.slots import SlabAllocator
from tierd.daemon.ssd import SsdStore
from tierd.types import BlockHash
from tierd.wire.arena import ShmArena
from tierd.wire.client import EngineHandle, TierdClient
from tierd.wire.layout import Layout

sys.path.insert(0, os.path.dirname(__file__))  # the tests of this folder import node_rig

from node_rig import ARENA, LAYOUT, SLAB, SSD, FakeClock, MakeRig, Rig  # noqa: E402

T = TypeVar("T")

SMALL_LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16", block_size=16,
                      model_id="test-model@0")
"""4096-byte blocks: 16 per 64 KiB slab."""


def small_config(workdir: str, **overrides: Any) -> TierdConfig:
    """A 16 MiB arena of 64 KiB slabs, a 4 MiB SSD tier, no pre-fault, no automatic
    maintenance (tests run ``maintain`` themselves), socket and SSD dir under ``workdir``."""
    values: dict[str, Any] = dict(
        socket_path=os.path.join(workdir, "tierd.sock"), dram_bytes=16 << 20,
        slab_bytes=64 << 10, prefault=False, ssd_dir=os.path.join(workdir, "ssd"),
        ssd_bytes=4 << 20, ssd_io_threads=2, maintain_seconds=3600.0, lease_seconds=30.0)
    values.update(overrides)
    return TierdConfig(**values)


@dataclass
class RunningDaemon:
    """A daemon on a background event loop; ``call`` runs a coroutine on that loop."""

    daemon: Daemon
    loop: asyncio.AbstractEventLoop
    config: TierdConfig

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def check_integrity(self) -> None:
        async def check() -> None:
            self.daemon.store.check_integrity()
        self.call(check())

    def maintain(self) -> None:
        self.call(self.daemon.store.maintain())

    def client(self, token: str | None = None) -> TierdClient:
        return TierdClient(socket_path=self.config.socket_path, token=token, timeout=10.0)


@pytest.fixture
def workdir() -> Iterator[str]:
    """A short directory under /tmp (a Unix socket path must stay under 108 bytes)."""
    path = tempfile.mkdtemp(prefix="tierd-t")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_daemon(config: TierdConfig) -> tuple[RunningDaemon, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    daemon = asyncio.run_coroutine_threadsafe(Daemon.start(config), loop).result(timeout=60)
    return RunningDaemon(daemon, loop, config), thread


def stop_daemon(running: RunningDaemon, thread: threading.Thread) -> None:
    running.call(running.daemon.stop(grace=0.5))
    running.loop.call_soon_threadsafe(running.loop.stop)
    thread.join(timeout=10)
    running.loop.close()


@pytest.fixture
def make_daemon(workdir: str) -> Iterator[Any]:
    """Factory: ``make_daemon(**config overrides)`` starts a daemon; every one is checked
    (``check_integrity``) and stopped at teardown."""
    started: list[tuple[RunningDaemon, threading.Thread]] = []

    def make(**overrides: Any) -> RunningDaemon:
        pair = start_daemon(small_config(workdir, **overrides))
        started.append(pair)
        return pair[0]

    yield make
    for running, thread in started:
        try:
            running.check_integrity()
        finally:
            stop_daemon(running, thread)


@pytest.fixture
def daemon(make_daemon: Any) -> RunningDaemon:
    """One daemon with the small config."""
    return make_daemon()  # type: ignore[no-any-return]


class Kit:
    """Helpers an engine stand-in uses (a fixture, since tests cannot import conftest)."""

    layout = SMALL_LAYOUT

    @staticmethod
    def chain(n: int, seed: int = 0, size: int = 32) -> list[BlockHash]:
        """``n`` distinct hashes of ``size`` bytes (stand-ins for a real chain)."""
        return [BlockHash(bytes([seed % 256, i % 256, i // 256]) + bytes(size - 3))
                for i in range(n)]

    @staticmethod
    def block_bytes(key: BlockHash, nbytes: int) -> bytes:
        """Deterministic, hash-specific block contents."""
        pattern = bytes((b * 31 + 7) % 256 for b in key[:8]) + key[:3]
        return (pattern * (nbytes // len(pattern) + 1))[:nbytes]

    @staticmethod
    def store_blocks(client: TierdClient, engine: EngineHandle, arena: ShmArena,
                     hashes: list[BlockHash]) -> int:
        """What an engine does to save blocks: reserve, copy each into its slot, commit the
        written flags (the daemon checksums). Returns the number of blocks stored."""
        reserved = client.reserve(engine.engine_id, hashes)
        for key, slot in zip(hashes, reserved.slot_ids):
            if slot is not None:
                data = Kit.block_bytes(key, engine.geometry.slot_bytes)
                arena.view(engine.geometry.offset(slot), engine.geometry.slot_bytes)[:] = data
        return client.commit(engine.engine_id, reserved.lease_id,
                             [s is not None for s in reserved.slot_ids])

    @staticmethod
    def attach(engine: EngineHandle) -> ShmArena:
        return ShmArena.attach(engine.arena_name, directory=engine.arena_directory)

    @staticmethod
    def engine_storing(client: TierdClient, hashes: list[BlockHash]) -> EngineHandle:
        """A new engine of ``layout`` that has stored ``hashes`` (``store_blocks``)."""
        engine = client.register_engine(Kit.layout)
        arena = Kit.attach(engine)
        Kit.store_blocks(client, engine, arena, hashes)
        arena.close()
        return engine


@pytest.fixture
def kit() -> type[Kit]:
    """The engine-side helpers (``kit.chain``, ``kit.store_blocks``, ``kit.attach``...)."""
    return Kit


@pytest.fixture
def serve(processes: list[subprocess.Popen[bytes]]) -> Callable[..., tuple[Any, TierdClient]]:
    """Factory ``serve(workdir, *flags)``: a real `tierd serve` child on ``workdir/tierd.sock``
    with a 16 MiB arena of 64 KiB slabs (no pre-fault) and its SSD tier in ``workdir/ssd``,
    ``flags`` added (the SSD size among them), started by ``tierd.bench.tierd_serve``; waits
    until it answers and returns (the process, a client). The process is killed at teardown if
    still running."""

    def start(workdir: str, *flags: str) -> tuple[Any, TierdClient]:
        daemon = TierdServe(workdir, ["--dram-bytes", "16MiB", "--slab-bytes", "64KiB",
                                      "--no-prefault", "--ssd-dir", os.path.join(workdir, "ssd"),
                                      *flags])
        processes.append(daemon.start())
        return processes[-1], daemon.client()

    return start


@pytest.fixture
async def make_rig(tmp_path: Path) -> AsyncIterator[MakeRig]:
    """Factory of rigs (``make_rig(ssd_dir=, ssd_bytes=, listener=, **NodeConfig overrides)``);
    each is checked for integrity, closed and its arena unlinked at teardown."""
    rigs: list[Rig] = []

    def make(ssd_dir: str | None = None, ssd_bytes: int = SSD,
             listener: TierListener | None = None, **config: Any) -> Rig:
        node_config = NodeConfig(**config)
        node_config.validate()  # a bad config raises before the arena exists
        arena = OwnedArena.create(f"tierd-test-{os.getpid()}-{secrets.token_hex(4)}", ARENA,
                                prefault=False)
        ssd = SsdStore(ssd_dir or tmp_path / "ssd", ssd_bytes, io_threads=2)
        clock = FakeClock()
        node = NodeStore(arena, SlabAllocator(ARENA, SLAB), ssd, node_config,
                         clock=clock, listener=listener)
        node.open()
        rig = Rig(node, arena, ssd, clock, node.register_engine("default", LAYOUT, "eng"))
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.node.check_integrity()
        if rig.ssd.healthy:  # closing flushes to SSD
            await rig.node.close()
        rig.arena.close()
        rig.arena.unlink()
