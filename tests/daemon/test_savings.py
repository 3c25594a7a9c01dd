"""Savings: prefill tokens served per tenant, model and tier, and the engine seconds they saved
(at the engine's reported prefill speed, else ``recompute_tokens_per_second``), as counters,
in the Prometheus registry and in `tierd stats --json`."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import grpc
import pytest
from node_rig import LAYOUT, MakeRig, chain
from prometheus_client import generate_latest

from tierd.commands import stats as stats_cmd
from tierd.wire.replies import Saved


async def test_dram_and_ssd_hits_counted_at_the_engine_speed(make_rig: MakeRig) -> None:
    """4 blocks acquired from DRAM at the default 10,000 tokens/s save 64 tokens, 6.4 ms; after
    demotion to SSD and a reported 1,000 tokens/s, re-acquiring them counts 64 SSD tokens and
    64 ms; another tenant's engine of another model gets a row of its own."""
    rig = make_rig(dram_high_watermark=0.5, dram_low_watermark=0.5)
    hashes = chain(4)
    rig.store(hashes)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    rig.node.release(lease.lease_id)
    await rig.node.write_behind()
    rig.store(chain(4, "b"))
    await rig.node.maintain()
    assert rig.tiers(hashes) == ["ssd"] * 4
    rig.node.insight.savings.report_speed(rig.engine.namespace, 1000.0)
    lease = await rig.node.acquire(rig.engine.engine_id, hashes)
    assert len(lease.slot_ids) == 4
    rig.node.release(lease.lease_id)
    other = rig.node.register_engine("b", replace(LAYOUT, model_id="b-model@1"), "b")
    rig.store(chain(1, "c"), engine=other)
    lease = await rig.node.acquire(other.engine_id, chain(1, "c"))
    rig.node.release(lease.lease_id)
    assert [r.tokens for r in rig.node.insight.savings.rows()] == [64]  # queued since maintain
    rig.node.insight.tally()
    assert rig.node.insight.savings.rows() == [
        Saved("b", "b-model@1", "dram", 16, 16 / 10_000, 10_000, "planner"),
        Saved("default", "test-model@0", "dram", 64, 64 / 10_000, 10_000, "planner"),
        Saved("default", "test-model@0", "ssd", 64, 64 / 1000, 1000, "reported")]
    assert [r.tenant for r in rig.node.insight.savings.rows("b")] == ["b"]
    text = generate_latest(rig.node.metrics.registry).decode()
    assert ('tierd_prefill_tokens_served_total{model="test-model@0",tenant="default",'
            'tier="ssd"} 64.0') in text
    assert 'tierd_prefill_seconds_saved_total{model="b-model@1",tenant="b",tier="dram"}' in text
    with pytest.raises(ValueError, match="positive"):
        rig.node.insight.savings.report_speed(rig.engine.namespace, 0.0)
    rig.node.check_integrity()


def test_stats_shows_the_callers_savings(daemon: Any, kit: Any,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An engine that reports 2,000 tokens/s and acquires 3 stored blocks: `tierd stats
    --json` shows 48 DRAM tokens and 24 ms saved; the table shows the row."""
    hashes = kit.chain(3)
    with daemon.client() as client:
        engine = kit.engine_storing(client, hashes)
        client.report_hot_blocks(engine.engine_id, prefill_tokens_per_second=2000.0)
        got = client.acquire(engine.engine_id, hashes)
        client.release(engine.engine_id, got.lease_id)
    parser = argparse.ArgumentParser()
    stats_cmd.configure(parser)
    assert stats_cmd.run(parser.parse_args(["--socket-path", daemon.config.socket_path,
                                            "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["savings"] == [{"tenant": "default", "model_id": kit.layout.model_id,
                                "tier": "dram", "tokens": 48, "seconds": 0.024,
                                "tokens_per_second": 2000.0, "speed_source": "reported"}]
    assert stats_cmd.run(parser.parse_args(["--socket-path", daemon.config.socket_path])) == 0
    text = capsys.readouterr().out
    assert "prefill saved" in text and "2,000" in text and "reported" in text


def test_holds_and_other_tensor_parallel_ranks_are_not_counted(daemon: Any, kit: Any) -> None:
    """Rank 0 of a TP-2 engine stores 2 blocks; a hold of them (an Acquire's, a Probe's) serves
    nothing; rank 1 (its own layout) acquiring its copy of them serves nothing; rank 0's load
    counts 32 tokens once."""
    layouts = [replace(kit.layout, tp_rank=r, tp_size=2) for r in (0, 1)]
    hashes = kit.chain(2)
    with daemon.client() as client:
        engines = [client.register_engine(layout) for layout in layouts]
        for engine in engines:
            arena = kit.attach(engine)
            kit.store_blocks(client, engine, arena, hashes)
            arena.close()
        held = client.acquire(engines[0].engine_id, hashes, hold=True)
        probed = client.probe(engines[0].engine_id, hashes, hold=True)
        assert held.num_blocks == probed.num_blocks == 2
        assert client.stats().savings == []
        client.release(engines[0].engine_id, probed.lease_id)
        for engine in reversed(engines):
            got = client.acquire(engine.engine_id, hashes)
            client.release(engine.engine_id, got.lease_id)
        client.release(engines[0].engine_id, held.lease_id)
        rows = client.stats().savings
    assert [(r.tier, r.tokens, r.speed_source) for r in rows] == [("dram", 32, "planner")]


def test_a_hold_released_with_served_counts_what_was_loaded(daemon: Any, kit: Any) -> None:
    """A hold of 3 blocks released with served=2 counts 32 tokens (the engine loaded 2 under
    it); served on a lease that is not a hold, or past the hold's blocks, is INVALID_ARGUMENT
    naming the fix, and the lease is still held (a plain release ends it)."""
    hashes = kit.chain(3)
    with daemon.client() as client:
        engine = kit.engine_storing(client, hashes)
        plain = client.acquire(engine.engine_id, hashes)
        with pytest.raises(grpc.RpcError) as info:
            client.release(engine.engine_id, plain.lease_id, served=3)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hold" in str(info.value.details())
        client.release(engine.engine_id, plain.lease_id)
        before = [(r.tier, r.tokens) for r in client.stats().savings]
        held = client.probe(engine.engine_id, hashes, hold=True)
        with pytest.raises(grpc.RpcError) as info:
            client.release(engine.engine_id, held.lease_id, served=4)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "were loaded under it" in str(info.value.details())
        client.release(engine.engine_id, held.lease_id, served=2)
        after = [(r.tier, r.tokens) for r in client.stats().savings]
    assert before == [("dram", 48)] and after == [("dram", 48 + 32)]


def test_no_insight_hooks_keeps_no_savings_curves_or_model_counts(
        serve: Any, tmp_path: Any, kit: Any) -> None:
    """`tierd serve --no-insight-hooks`: a looked-up, acquired chain is counted in the node's
    hit ratio but in no savings row, what-if curve or per-model lookup count."""
    _, client = serve(str(tmp_path), "--no-insight-hooks")
    hashes = kit.chain(3)
    with client:
        engine = kit.engine_storing(client, hashes)
        got = client.probe(engine.engine_id, hashes)
        client.release(engine.engine_id, got.lease_id)
        stats = client.stats()
    assert stats.hit_tokens == 48
    assert stats.savings == [] and all(c.references == 0 for c in stats.what_if)
    assert [(m.query_tokens, m.hit_tokens) for m in stats.models] == [(0, 0)]
