"""Seeded random operation sequences against a node store with two tenants and two block sizes
(real arena, allocator and SSD directory): every hit copies out bit-exact, every error is the
documented one, and ``check_integrity`` holds after every step."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tierd.checksum import block_checksum
from tierd.daemon.arena import OwnedArena
from tierd.daemon.errors import FailedPrecondition, NotFound
from tierd.daemon.node import EMPTY_LEASE, EngineInfo, Lease, NodeConfig, NodeStore, Reservation
from tierd.daemon.slots import SlabAllocator
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.types import BlockHash
from tierd.wire.arena import ShmArena
from tierd.wire.layout import Layout

SMALL = Layout(num_layers=1, num_kv_heads=1, head_size=16, dtype="float16", block_size=16,
               model_id="test-model@0")
WIDE = Layout(num_layers=1, num_kv_heads=2, head_size=16, dtype="float16", block_size=16,
              model_id="test-model@0")
ARENA, SLAB, SSD = 16 << 10, 4 << 10, 6 * (1024 + HEADER_BYTES)

REMEMBERED_S = 30.0
"""A finished lease is remembered this long past its deadline (the default lease time)."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def payload(engine: EngineInfo, block_hash: BlockHash) -> bytes:
    """Contents unique to (namespace, hash): a block served to the wrong tenant would differ."""
    seed = hashlib.sha256(engine.namespace + block_hash).digest()
    size = engine.geometry.slot_bytes
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class World:
    node: NodeStore
    arena: ShmArena
    ssd: SsdStore
    clock: FakeClock
    engines: list[EngineInfo]
    chains: list[list[BlockHash]]
    leases: list[tuple[Lease, EngineInfo]] = field(default_factory=list)
    pending: list[tuple[Reservation, list[int | None]]] = field(default_factory=list)

    def copy_out_and_check(self, engine: EngineInfo, hashes: list[BlockHash], lease: Lease) -> None:
        g = engine.geometry
        for h, slot, checksum in zip(hashes, lease.slot_ids, lease.checksums):
            data = bytes(self.arena.view(g.offset(slot), g.slot_bytes))
            assert data == payload(engine, h), f"slot {slot} does not hold {h.hex()[:8]}"
            assert checksum == block_checksum(data)

    def write(self, engine: EngineInfo, hashes: list[BlockHash],
              res: Reservation) -> list[int | None]:
        sums: list[int | None] = []
        for h, slot in zip(hashes, res.slot_ids):
            if slot is not None:
                data = payload(engine, h)
                self.arena.view(engine.geometry.offset(slot), len(data))[:] = data
            sums.append(None if slot is None else block_checksum(payload(engine, h)))
        return sums

    async def step(self, rng: random.Random) -> None:
        node, engine = self.node, rng.choice(self.engines)
        hashes = rng.choice(self.chains)[:rng.randint(1, 6)]
        op = rng.choices(["store", "reserve", "finish", "acquire", "pair", "release", "lookup",
                          "tick", "maintain", "hbm", "corrupt", "sick"],
                         weights=[6, 2, 2, 5, 1, 3, 2, 2, 3, 1, 1, 1])[0]
        if op == "store":
            res = node.reserve(engine.engine_id, hashes)
            sums = self.write(engine, hashes, res)
            if rng.random() < 0.2:
                sums = [None if rng.random() < 0.5 else s for s in sums]
            node.commit(res.lease_id, sums)
        elif op == "reserve":
            res = node.reserve(engine.engine_id, hashes)     # copied now, committed later
            self.pending.append((res, self.write(engine, hashes, res)))
        elif op == "finish" and self.pending:
            res, sums = self.pending.pop(rng.randrange(len(self.pending)))
            if self.clock.now >= res.deadline + REMEMBERED_S:   # forgotten: an unknown lease
                with pytest.raises(NotFound, match="unknown lease"):
                    if rng.random() < 0.3:
                        node.abort(res.lease_id)
                    else:
                        node.commit(res.lease_id, sums)
            elif rng.random() < 0.3:
                node.abort(res.lease_id)
            elif self.clock.now >= res.deadline:
                with pytest.raises(FailedPrecondition, match="expired"):
                    node.commit(res.lease_id, sums)
            else:
                node.commit(res.lease_id, sums)
        elif op in ("acquire", "pair"):
            n = 1 if op == "acquire" else 2
            leases = await asyncio.gather(*(node.acquire(engine.engine_id, hashes)
                                            for _ in range(n)))
            for lease in leases:
                self.copy_out_and_check(engine, hashes, lease)
                self.leases.append((lease, engine))
        elif op == "release" and self.leases:
            lease, _ = self.leases.pop(rng.randrange(len(self.leases)))
            if self.clock.now >= lease.deadline and lease.lease_id != EMPTY_LEASE:
                forgotten = self.clock.now >= lease.deadline + REMEMBERED_S
                with pytest.raises(NotFound, match="unknown" if forgotten else "expired"):
                    node.release(lease.lease_id)
            else:
                node.release(lease.lease_id)
        elif op == "lookup":
            tiers = node.lookup(engine.engine_id, hashes).tiers
            assert len(tiers) <= len(hashes)
        elif op == "tick":
            self.clock.now += rng.uniform(0, 12)
        elif op == "maintain":
            await node.maintain()
        elif op == "hbm":
            node.report_hbm(engine.engine_id, stored=hashes[:2], removed=hashes[2:3],
                            cleared=rng.random() < 0.1)
        elif op == "sick":                 # as after a disk error; a good write heals it
            self.ssd.healthy = False
        elif op == "corrupt":
            records = sorted(self.ssd.directory.glob("seg-*.kvs"))
            if records:
                path = rng.choice(records)
                raw = bytearray(path.read_bytes())
                raw[rng.randrange(len(raw))] ^= 0x5A
                path.write_bytes(raw)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_operations_keep_every_invariant(seed: int, tmp_path: Path) -> None:
    """300 random steps (store, reserve/commit/abort, acquire alone and in pairs, release,
    expiry, maintain, HBM reports, corrupted records, SSD errors): integrity after each step,
    every hit bit-exact."""
    rng = random.Random(seed)
    arena = OwnedArena.create(f"tierd-rand-{os.getpid()}-{secrets.token_hex(4)}", ARENA,
                            prefault=False)
    ssd = SsdStore(tmp_path / "ssd", SSD, io_threads=2)
    clock = FakeClock()
    node = NodeStore(arena, SlabAllocator(ARENA, SLAB), ssd, NodeConfig(), clock=clock)
    node.open()
    try:
        engines = [node.register_engine("a", SMALL), node.register_engine("b", SMALL),
                   node.register_engine("a", WIDE)]
        chains = [[BlockHash(hashlib.sha256(f"{c}/{i}".encode()).digest()) for i in range(6)]
                  for c in range(4)]
        world = World(node, arena, ssd, clock, engines, chains)
        for _ in range(300):
            await world.step(rng)
            node.check_integrity()
        for lease, _ in world.leases:
            if clock.now < lease.deadline:
                node.release(lease.lease_id)
        clock.now += 60
        await node.maintain()
        node.check_integrity()
        stats = node.stats()
        assert stats.tiers["dram"].pinned_blocks == 0
        assert stats.tiers["dram"].used_blocks == len(node._tiers.dram)
        ssd.check_integrity(disk=True)
    finally:
        await node.close()
        arena.close()
        arena.unlink()
