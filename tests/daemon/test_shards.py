"""The what-if sampler (``Shards``): its curve against an exact LRU simulation of the same
lookups with prefix hits, at full rate and with the rate lowered by its memory bound; its
bounds; and the curves through a real daemon: `tierd stats --what-if`, the gauges, tenants."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections import OrderedDict
from typing import Any

import pytest
from prometheus_client import generate_latest

from tierd.commands import stats as stats_cmd
from tierd.daemon.shards import Shards
from tierd.types import NamespacedKey
from tierd.wire.replies import SCALES

NS = bytes(16)


def _key(*parts: object) -> NamespacedKey:
    return NamespacedKey(NS + hashlib.sha256(repr(parts).encode()).digest())


def _trace(n: int, seed: int = 1) -> list[list[NamespacedKey]]:
    """Chat-like lookups: a Zipf-popular system prompt of 8 blocks, then one of 20 user
    turns of 4 blocks."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, turn = min(int(rng.paretovariate(0.8)), 2000), rng.randrange(20)
        out.append([_key(prompt, i) for i in range(8)] + [_key(prompt, turn, i)
                                                          for i in range(4)])
    return out


def _lru_prefix_hit_ratio(trace: list[list[NamespacedKey]], capacity: int) -> float:
    """Exact: an LRU of ``capacity`` blocks, each lookup hitting its leading run held."""
    lru: OrderedDict[NamespacedKey, None] = OrderedDict()
    hits = queried = 0
    for chain in trace:
        queried += len(chain)
        for key in chain:
            if key not in lru:
                break
            hits += 1
        for key in chain:
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits / queried


@pytest.mark.parametrize("max_keys", [1 << 20, 2048])
def test_curve_matches_exact_lru(max_keys: int) -> None:
    """At full rate, and with the sample bounded to 2,048 blocks (rate lowered), every point of
    the curve around 1,000 blocks is within 5 points of the exact LRU's prefix hit ratio."""
    trace = _trace(12_000)
    shards = Shards(lambda ns: ("t", "m"), max_keys=max_keys)
    for chain in trace:
        shards.accessed(NS, chain)
    shards.drain()
    shards.check_integrity()
    assert (shards.rate < 0.5) is (max_keys == 2048)
    assert shards.sampled_blocks <= max_keys
    for scale in SCALES:
        exact = _lru_prefix_hit_ratio(trace, int(1000 * scale))
        assert abs(shards.hit_ratio(1000 * scale) - exact) < 0.05, (scale, exact)
    curve = shards.curves("dram", 1000)[0]
    assert (curve.tenant, curve.model_id) == ("", "*") and len(curve.hit_ratios) == 6
    assert list(curve.hit_ratios) == sorted(curve.hit_ratios)


def test_queue_is_bounded() -> None:
    """Chains queued past max_pending_blocks are dropped and counted, not kept."""
    shards = Shards(lambda ns: None, max_pending_blocks=10)
    chain = [_key(0, i) for i in range(4)]
    for _ in range(4):
        shards.accessed(NS, chain)
    assert shards.dropped_chains == 2
    shards.check_integrity()
    shards.drain()
    assert shards.curves("dram", 4)[0].model_id == "*"


async def test_drain_in_steps() -> None:
    """``drain(limit)`` replays whole chains up to about ``limit`` blocks; ``drain_async``
    replays the rest in steps."""
    shards = Shards(lambda ns: None)
    for chain in range(3):
        shards.accessed(NS, [_key(chain, i) for i in range(4)])
    shards.drain(4)
    assert shards.sampled_blocks == 4
    await shards.drain_async(step=4)
    assert shards.sampled_blocks == 12
    shards.check_integrity()


def test_stats_what_if_and_gauges(daemon: Any, kit: Any,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """After a lookup stores and looks up a chain twice, `tierd stats --what-if --json` has a
    DRAM curve for every lookup and one for the model; the maintenance pass sets the gauges;
    the table prints."""
    hashes = kit.chain(4)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        client.lookup(engine.engine_id, hashes)
        kit.store_blocks(client, engine, arena, hashes)
        client.lookup(engine.engine_id, hashes)
        arena.close()
    parser = argparse.ArgumentParser()
    stats_cmd.configure(parser)
    argv = ["--socket-path", daemon.config.socket_path, "--what-if"]
    assert stats_cmd.run(parser.parse_args([*argv, "--json"])) == 0
    curves = json.loads(capsys.readouterr().out)["what_if"]
    dram = [(c["tenant"], c["model_id"], c["hit_ratios"]) for c in curves if c["tier"] == "dram"]
    assert dram == [("", "*", [0.5] * 6), ("default", kit.layout.model_id, [0.5] * 6)]
    assert stats_cmd.run(parser.parse_args(argv)) == 0
    assert "flattens at" in capsys.readouterr().out
    daemon.maintain()
    text = generate_latest(daemon.daemon.store.metrics.registry).decode()
    assert ('tierd_whatif_hit_ratio{model="*",scale="0.25",tenant="",tier="dram"} 0.5'
            in text)
    assert "tierd_whatif_sample_rate 1.0" in text


async def test_a_tenant_sees_only_its_models_curves(make_rig: Any) -> None:
    """Tenants "default" and "b" look up chains: b's what-if rows are every lookup's and its
    own model's, never default's model."""
    from dataclasses import replace

    from node_rig import LAYOUT, chain

    rig = make_rig()
    other = rig.node.register_engine("b", replace(LAYOUT, model_id="b-model@1"), "b")
    rig.node.lookup(rig.engine.engine_id, chain(2, "a"))
    rig.node.lookup(other.engine_id, chain(2, "b"))
    rows = rig.node.insight.what_if(rig.node.stats(), "b")
    assert {(c.tenant, c.model_id) for c in rows} == {("", "*"), ("b", "b-model@1")}
    everyone = rig.node.insight.what_if(rig.node.stats())
    assert {(c.tenant, c.model_id) for c in everyone} == {
        ("", "*"), ("b", "b-model@1"), ("default", "test-model@0")}
    rig.node.check_integrity()
