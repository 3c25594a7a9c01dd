"""Random RPC sequences against one real daemon: after every call the store's invariants hold
and every acquired block copies out bit-exact."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierd.checksum import block_checksum
from tierd.types import BlockHash
from tierd.wire.client import EngineHandle, TierdClient

OPS = st.lists(st.tuples(st.sampled_from(["store", "lookup", "acquire", "abort", "maintain",
                                          "hot"]),
                         st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=12)


def test_random_rpc_sequences_keep_invariants(make_daemon: Any, kit: Any) -> None:
    """Store / lookup / acquire / abort / maintain / hot-block reports on 4 chains in any order,
    with DRAM demoting everything on each maintain pass: check_integrity holds after each call
    and acquired blocks are always the bytes stored under their hash."""
    daemon = make_daemon(dram_high_watermark=1e-9, dram_low_watermark=1e-9)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=OPS)
    def sequence(ops: list[tuple[str, int, int]]) -> None:
        with daemon.client() as client:
            engine = client.register_engine(kit.layout)
            arena = kit.attach(engine)
            for op, seed, length in ops:
                apply(op, kit.chain(length, seed=seed), seed, daemon, client, engine, arena, kit)
                daemon.check_integrity()
            client.unregister_engine(engine.engine_id)
            arena.close()
        daemon.check_integrity()

    sequence()


def apply(op: str, hashes: list[BlockHash], seed: int, daemon: Any, client: TierdClient,
          engine: EngineHandle, arena: Any, kit: Any) -> None:
    """One random step, with what must hold right after it."""
    n = engine.geometry.slot_bytes
    if op == "store":
        kit.store_blocks(client, engine, arena, hashes)
    elif op == "lookup":
        tiers = client.lookup(engine.engine_id, hashes)
        assert set(tiers) <= {"hbm", "dram", "ssd"} and len(tiers) <= len(hashes)
    elif op == "acquire":
        got = client.acquire(engine.engine_id, hashes)
        for key, slot, checksum in zip(hashes, got.slot_ids, got.checksums):
            data = bytes(arena.view(engine.geometry.offset(slot), n))
            assert data == kit.block_bytes(key, n) and block_checksum(data) == checksum
        client.release(engine.engine_id, got.lease_id)
    elif op == "abort":
        client.abort(engine.engine_id, client.reserve(engine.engine_id, hashes).lease_id)
    elif op == "maintain":
        daemon.maintain()
    else:
        client.report_hot_blocks(engine.engine_id, stored=hashes[:1], cleared=seed == 0)
