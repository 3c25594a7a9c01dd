"""The node-store test rig shared by the node store's tests (``test_node*``,
``test_writebehind``): a real shared-memory arena, slab allocator and SSD directory under a
``NodeStore`` with a hand-moved clock (the ``make_rig`` fixture is in this folder's conftest)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from tierd.checksum import block_checksum
from tierd.daemon.node import EngineInfo, NodeStore, Reservation
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.types import BlockHash
from tierd.wire.arena import ShmArena
from tierd.wire.layout import Layout

LAYOUT = Layout(num_layers=1, num_kv_heads=1, head_size=16, dtype="float16", block_size=16,
                model_id="test-model@0")
BLOCK = LAYOUT.block_bytes            # 1024 bytes
ARENA = 8 * BLOCK                     # 8 slots: 2 slabs of 4
SLAB = 4 * BLOCK
SSD = 4 * (BLOCK + HEADER_BYTES)      # 4 records (512-byte header each)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def chain(n: int, seed: str = "a") -> list[BlockHash]:
    """``n`` distinct 32-byte hashes."""
    return [BlockHash(hashlib.sha256(f"{seed}/{i}".encode()).digest()) for i in range(n)]


def payload(block_hash: BlockHash, size: int = BLOCK) -> bytes:
    """Deterministic, hash-specific block contents."""
    return (block_hash * (size // len(block_hash) + 1))[:size]


@dataclass
class Rig:
    node: NodeStore
    arena: ShmArena
    ssd: SsdStore
    clock: FakeClock
    engine: EngineInfo

    def store(self, hashes: list[BlockHash], engine: EngineInfo | None = None) -> Reservation:
        """What an engine does: reserve, copy each block into its slot, commit with checksums."""
        engine = engine or self.engine
        res = self.node.reserve(engine.engine_id, hashes)
        sums: list[int | None] = []
        for h, slot in zip(hashes, res.slot_ids):
            if slot is not None:
                self.arena.view(engine.geometry.offset(slot), BLOCK)[:] = payload(h)
            sums.append(None if slot is None else block_checksum(payload(h)))
        self.node.commit(res.lease_id, sums)
        return res

    def copy_out(self, slots: list[int]) -> list[bytes]:
        return [bytes(self.arena.view(self.engine.geometry.offset(s), BLOCK)) for s in slots]

    def tiers(self, hashes: list[BlockHash]) -> list[str]:
        return list(self.node.lookup(self.engine.engine_id, hashes).tiers)


MakeRig = Callable[..., Rig]
