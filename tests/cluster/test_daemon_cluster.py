"""Two real daemons (own arena, SSD dir and Unix socket each) sharing one real redis-server act as
two cluster nodes: Locate across nodes, the remote tier, a Redis outage, a dead node, tenants,
`tierd why` naming the node that holds a prompt."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import pytest
import redis
from prometheus_client import generate_latest

from tierd import hashing
from tierd.checksum import block_checksum
from tierd.commands import why as why_cmd
from tierd.daemon.cluster_link import ClusterLink
from tierd.daemon.config import TierdConfig
from tierd.daemon.server import Daemon
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.types import BlockHash, make_key
from tierd.wire.arena import ShmArena
from tierd.wire.client import EngineHandle, Located, TierdClient
from tierd.wire.layout import Layout, namespace_for

T = TypeVar("T")

LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16", block_size=16,
                model_id="test-model@0")
"""4096-byte blocks."""


@dataclass
class Node:
    """A daemon on its own event loop in a background thread."""

    daemon: Daemon
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    config: TierdConfig

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    @property
    def link(self) -> ClusterLink:
        assert self.daemon.cluster is not None
        return self.daemon.cluster

    def client(self, token: str | None = None) -> TierdClient:
        return TierdClient(socket_path=self.config.socket_path, token=token, timeout=10.0)

    def maintain(self) -> None:
        self.call(self.daemon.maintain())

    def check_integrity(self) -> None:
        async def check() -> None:
            self.daemon.store.check_integrity()
            if self.daemon.cluster is not None:
                self.daemon.cluster.check_integrity()
        self.call(check())


@pytest.fixture
def cluster(redis_server: Any) -> Iterator[Callable[..., Node]]:
    """Factory: ``cluster(name, **config overrides)`` starts a node on the test's Redis; every
    node is integrity-checked and stopped at teardown."""
    workdir = tempfile.mkdtemp(prefix="tdc")
    with open(os.path.join(workdir, "tokens.toml"), "w") as f:
        f.write('"tok-acme" = "acme"\n"tok-globex" = "globex"\n')
    nodes: list[Node] = []

    def start(name: str, **overrides: Any) -> Node:
        home = os.path.join(workdir, name)
        os.makedirs(home)
        values: dict[str, Any] = dict(
            socket_path=os.path.join(home, "s.sock"), dram_bytes=16 << 20, slab_bytes=64 << 10,
            prefault=False, ssd_dir=os.path.join(home, "ssd"), ssd_bytes=4 << 20,
            ssd_io_threads=2, maintain_seconds=3600.0, redis_url=redis_server.url,
            node_id=name, cluster_heartbeat_seconds=0.2, cluster_node_ttl_seconds=3.0,
            token_file=os.path.join(workdir, "tokens.toml"))
        values.update(overrides)
        config = TierdConfig(**values)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        daemon = asyncio.run_coroutine_threadsafe(Daemon.start(config), loop).result(timeout=60)
        node = Node(daemon, loop, thread, config)
        nodes.append(node)
        return node

    yield start
    try:
        for node in nodes:
            node.check_integrity()
    finally:
        for node in nodes:
            node.call(node.daemon.stop(grace=0.2))
            node.loop.call_soon_threadsafe(node.loop.stop)
            node.thread.join(timeout=10)
            node.loop.close()
        shutil.rmtree(workdir, ignore_errors=True)


def chain(n: int, seed: int) -> list[BlockHash]:
    return [BlockHash(bytes([seed, i]) + bytes(30)) for i in range(n)]


def block_bytes(key: BlockHash, nbytes: int) -> bytes:
    pattern = bytes((b * 31 + 7) % 256 for b in key[:8]) + key[:3]
    return (pattern * (nbytes // len(pattern) + 1))[:nbytes]


def store(client: TierdClient, engine: EngineHandle, hashes: list[BlockHash]) -> int:
    """An engine saving blocks: reserve, copy into the arena, commit (the daemon checksums)."""
    arena = ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
    try:
        res = client.reserve(engine.engine_id, hashes)
        for key, slot in zip(hashes, res.slot_ids):
            if slot is not None:
                data = block_bytes(key, engine.geometry.slot_bytes)
                arena.view(engine.geometry.offset(slot), engine.geometry.slot_bytes)[:] = data
        return client.commit(engine.engine_id, res.lease_id,
                             [s is not None for s in res.slot_ids])
    finally:
        arena.close()


def wait_for(what: str, probe: Callable[[], T], done: Callable[[T], bool],
             timeout: float = 15.0) -> T:
    """Poll ``probe`` until ``done`` (background publishing is asynchronous by design)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value) or time.monotonic() > deadline:
            assert done(value), f"{what}: still {value!r} after {timeout} s"
            return value
        time.sleep(0.05)


def metrics(node: Node) -> str:
    return generate_latest(node.daemon.store.metrics.registry).decode()


def nodes_of(located: Located) -> list[tuple[str, int, tuple[str, ...], float]]:
    return [(p.node_id, p.prefix_blocks, p.tiers, p.score) for p in located.nodes]


def test_prefix_on_a_is_located_from_b(cluster: Callable[..., Node]) -> None:
    """A holds 6 blocks (2 demoted to SSD, 2 reported in HBM), B holds the first 3: B's Locate
    ranks A (ssd ssd dram dram hbm hbm, 4.8) above B (dram x3, 2.4), without Redis error."""
    a = cluster("node-a", dram_high_watermark=0.001, dram_low_watermark=0.001)
    b = cluster("node-b")
    hashes = chain(6, seed=1)
    with a.client() as ca, b.client() as cb:
        ea, eb = ca.register_engine(LAYOUT, "a"), cb.register_engine(LAYOUT, "b")
        assert store(ca, ea, hashes) == 6
        a.maintain()                                     # blocks 0, 1 go down to SSD
        ca.report_hot_blocks(ea.engine_id, stored=hashes[4:])
        assert ca.lookup(ea.engine_id, hashes) == ["ssd", "ssd", "dram", "dram", "hbm", "hbm"]
        assert store(cb, eb, hashes[:3]) == 3
        found = wait_for("A and B published", lambda: cb.locate(eb.engine_id, hashes + chain(2, 9)),
                         lambda r: nodes_of(r) == [
                             ("node-a", 6, ("ssd", "ssd", "dram", "dram", "hbm", "hbm"), 4.8),
                             ("node-b", 3, ("dram", "dram", "dram"), 2.4)])
        assert found.stale is False
        assert found.nodes[0].address == f"unix:{a.config.socket_path}"
        ca.report_hot_blocks(ea.engine_id, removed=hashes[4:])
        wait_for("A's HBM report withdrawn", lambda: cb.locate(eb.engine_id, hashes),
                 lambda r: nodes_of(r)[0][2] == ("ssd", "ssd", "dram", "dram", "dram", "dram"))


def test_tenants_stay_isolated_across_nodes(cluster: Callable[..., Node]) -> None:
    """acme's prefix on A is found by acme on B (by engine or by layout) and never by globex."""
    a, b = cluster("node-a"), cluster("node-b")
    hashes = chain(4, seed=2)
    with a.client("tok-acme") as ca, b.client("tok-acme") as acme, \
            b.client("tok-globex") as globex:
        assert store(ca, ca.register_engine(LAYOUT, "a"), hashes) == 4
        engine = acme.register_engine(LAYOUT, "b")
        wait_for("acme's blocks published", lambda: acme.locate(engine.engine_id, hashes),
                 lambda r: nodes_of(r) == [("node-a", 4, ("dram",) * 4, 3.2)])
        assert nodes_of(acme.locate(None, hashes, layout=LAYOUT)) == [
            ("node-a", 4, ("dram",) * 4, 3.2)]
        other = globex.register_engine(LAYOUT, "g")
        assert globex.locate(other.engine_id, hashes) == Located(nodes=[], stale=False)
        assert globex.locate(None, hashes, layout=LAYOUT) == Located(nodes=[], stale=False)


def test_remote_tier_serves_a_block_evicted_on_another_node(cluster: Callable[..., Node]) -> None:
    """A (DRAM only, 32 slots) evicts a 4-block prefix; its maintain pass puts them remote; B
    misses locally, fetches them into its arena, and serves them bit-exact."""
    a = cluster("node-a", ssd_dir="", dram_bytes=128 << 10, remote_tier=True,
                block_overhead_bytes=0)                 # every one of the 32 slots usable
    b = cluster("node-b", remote_tier=True)
    prefix = chain(4, seed=3)
    with a.client() as ca, b.client() as cb:
        ea = ca.register_engine(LAYOUT, "a")
        assert store(ca, ea, prefix) == 4
        assert store(ca, ea, chain(32, seed=4)) == 32    # evicts the 4 oldest: the prefix
        assert ca.lookup(ea.engine_id, prefix) == []
        a.maintain()
        assert a.link.remote is not None and a.link.remote.stats.puts == 4
        eb = cb.register_engine(LAYOUT, "b")
        got = cb.acquire(eb.engine_id, prefix + chain(1, seed=5))
        assert got.num_blocks == 4
        arena = ShmArena.attach(eb.arena_name, directory=eb.arena_directory)
        try:
            size = eb.geometry.slot_bytes
            for key, slot, checksum in zip(prefix, got.slot_ids, got.checksums):
                data = bytes(arena.view(eb.geometry.offset(slot), size))
                assert data == block_bytes(key, size) and checksum == block_checksum(data)
        finally:
            arena.close()
        cb.release(eb.engine_id, got.lease_id)
        assert cb.lookup(eb.engine_id, prefix) == ["dram"] * 4
        assert b.link.remote is not None
        assert (b.link.stats.fetched_blocks, b.link.remote.stats.fetch_decisions) == (4, 1)
        assert [(r.tier, r.tokens) for r in cb.stats().savings] == [("dram", 64)]


def test_remote_fetch_past_a_local_hit_counts_each_block_once(
        cluster: Callable[..., Node]) -> None:
    """B holds the first 2 blocks of a 4-block prefix A put remote: an acquire serves the 2
    local blocks and fetches the other 2 (then acquires all 4 again): 64 tokens served, not 96."""
    a = cluster("node-a", ssd_dir="", dram_bytes=128 << 10, remote_tier=True,
                block_overhead_bytes=0)
    b = cluster("node-b", remote_tier=True)
    prefix = chain(4, seed=6)
    with a.client() as ca, b.client() as cb:
        ea = ca.register_engine(LAYOUT, "a")
        assert store(ca, ea, prefix) == 4
        assert store(ca, ea, chain(32, seed=7)) == 32
        a.maintain()
        eb = cb.register_engine(LAYOUT, "b")
        assert store(cb, eb, prefix[:2]) == 2
        got = cb.acquire(eb.engine_id, prefix + chain(1, seed=8))
        assert got.num_blocks == 4 and b.link.stats.fetched_blocks == 2
        cb.release(eb.engine_id, got.lease_id)
        assert [(r.tier, r.tokens) for r in cb.stats().savings] == [("dram", 64)]


def test_redis_outage_keeps_nodes_serving(cluster: Callable[..., Node], redis_server: Any) -> None:
    """With Redis killed, both nodes store, look up and acquire locally and Locate answers stale;
    after Redis restarts empty on the same port, both re-publish everything they hold."""
    a, b = cluster("node-a"), cluster("node-b")
    before, during = chain(3, seed=6), chain(2, seed=7)
    with a.client() as ca, b.client() as cb:
        ea, eb = ca.register_engine(LAYOUT, "a"), cb.register_engine(LAYOUT, "b")
        assert store(ca, ea, before) == 3
        wait_for("published", lambda: cb.locate(eb.engine_id, before),
                 lambda r: nodes_of(r) == [("node-a", 3, ("dram",) * 3, 2.4)])
        redis_server.stop()
        for client, engine in ((ca, ea), (cb, eb)):
            assert store(client, engine, during) == 2
            assert client.lookup(engine.engine_id, during) == ["dram", "dram"]
            got = client.acquire(engine.engine_id, during)
            assert got.num_blocks == 2
            client.release(engine.engine_id, got.lease_id)
        assert cb.locate(eb.engine_id, before) == Located(nodes=[], stale=True)
        wait_for("A sees the outage", lambda: a.link.directory.stale, bool)
        assert "tierd_cluster_directory_stale 1.0" in metrics(b)
        redis_server.start()
        wait_for("the directory is whole again", lambda: cb.locate(eb.engine_id, during),
                 lambda r: nodes_of(r) == [("node-a", 2, ("dram",) * 2, 1.6),
                                           ("node-b", 2, ("dram",) * 2, 1.6)])
        assert nodes_of(cb.locate(eb.engine_id, before)) == [("node-a", 3, ("dram",) * 3, 2.4)]
        assert a.link.directory.stats.outages == 1
        assert "tierd_cluster_outages_total 1.0" in metrics(a)
        assert "tierd_cluster_directory_stale 0.0" in metrics(b)


def test_dead_node_entries_expire(cluster: Callable[..., Node], redis_server: Any) -> None:
    """A node that stops heartbeating without withdrawing is dead for Locate after its node TTL,
    and Redis frees its block entries after the block TTL."""
    ttl = dict(cluster_node_ttl_seconds=0.6, cluster_block_ttl_seconds=1.5)
    a, b = cluster("node-a", **ttl), cluster("node-b", **ttl)
    hashes = chain(2, seed=8)
    with a.client() as ca, b.client() as cb:
        assert store(ca, ca.register_engine(LAYOUT, "a"), hashes) == 2
        eb = cb.register_engine(LAYOUT, "b")
        wait_for("published", lambda: cb.locate(eb.engine_id, hashes),
                 lambda r: nodes_of(r) == [("node-a", 2, ("dram",) * 2, 1.6)])
        a.call(a.link.publisher.close(withdraw=False))   # A goes silent, as if it crashed
        wait_for("A dead for Locate", lambda: cb.locate(eb.engine_id, hashes),
                 lambda r: r == Located(nodes=[], stale=False))
        keys = [b"tierd:b:" + make_key(namespace_for("default", LAYOUT), h) for h in hashes]
        with redis.Redis.from_url(redis_server.url) as raw:
            wait_for("A's entries freed", lambda: raw.exists(*keys), lambda n: n == 0)


def test_ssd_eviction_feeds_the_remote_tier(cluster: Callable[..., Node]) -> None:
    """A's SSD holds 2 records: demoting 2 more evicts the oldest record (p0), whose bytes are
    read back and put remote by the maintain pass; B then acquires p0 from the remote tier."""
    record = HEADER_BYTES + 4096
    # ssd_bytes bounds the files, compaction headroom included (two records here: each is
    # larger than so small a store's segment), so 4.5 records leave (4.5 - 2) / 1.25 = 2 live
    a = cluster("node-a", dram_bytes=128 << 10, ssd_bytes=9 * record // 2, remote_tier=True,
                dram_high_watermark=0.05, dram_low_watermark=0.05)   # DRAM keeps 1 block
    b = cluster("node-b", remote_tier=True)
    p, q = chain(2, seed=10), chain(2, seed=11)
    with a.client() as ca, b.client() as cb:
        ea = ca.register_engine(LAYOUT, "a")
        assert store(ca, ea, p) == 2
        a.maintain()                                     # p0 -> SSD
        assert store(ca, ea, q) == 2
        a.maintain()                                     # p1, q0 -> SSD; p0's record evicted
        assert ca.lookup(ea.engine_id, p[:1]) == []
        stats = ca.stats()
        assert [(t.tier, t.evictions) for t in stats.tiers if t.tier != "hbm"] == [
            ("dram", 0), ("ssd", 1)]
        assert a.link.remote is not None and a.link.remote.stats.puts == 1
        eb = cb.register_engine(LAYOUT, "b")
        got = cb.acquire(eb.engine_id, p)
        assert got.num_blocks == 1
        arena = ShmArena.attach(eb.arena_name, directory=eb.arena_directory)
        try:
            size = eb.geometry.slot_bytes
            data = bytes(arena.view(eb.geometry.offset(got.slot_ids[0]), size))
            assert data == block_bytes(p[0], size)
        finally:
            arena.close()
        cb.release(eb.engine_id, got.lease_id)


def test_route_asks_a_daemon(cluster: Callable[..., Node],
                             capsys: pytest.CaptureFixture[str]) -> None:
    """`tierd route --socket-path` ranks through B's Locate (tenant of the connection); a daemon
    without Redis answers FAILED_PRECONDITION naming --redis-url, and route exits 1."""
    from tierd.commands import route

    a, b = cluster("node-a"), cluster("node-b")
    lone = cluster("lone", redis_url="")
    hashes = chain(3, seed=12)
    layout_flags = ["--model", "test-model@0", "--num-layers", "2", "--num-kv-heads", "2",
                    "--head-size", "16", "--dtype", "float16"]
    with a.client() as ca, b.client() as cb:
        assert store(ca, ca.register_engine(LAYOUT, "a"), hashes) == 3
        wait_for("published", lambda: cb.locate(None, hashes, layout=LAYOUT),
                 lambda r: nodes_of(r) == [("node-a", 3, ("dram",) * 3, 2.4)])
        # Another model of the same shape: the directory holds nothing of its own.
        other = cb.locate(None, hashes, layout=replace(LAYOUT, model_id="test-model-v2@1"))
        assert not other.stale and nodes_of(other) == []
    parser = argparse.ArgumentParser()
    route.configure(parser)
    hexes = ",".join(h.hex() for h in hashes)
    args = parser.parse_args(["--hashes", hexes, *layout_flags,
                              "--socket-path", b.config.socket_path, "--json"])
    assert route.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(n["node_id"], n["prefix_blocks"], n["score"]) for n in out["nodes"]] == [
        ("node-a", 3, 2.4)]
    args = parser.parse_args(["--hashes", hexes, *layout_flags, "--socket-path",
                              lone.config.socket_path])
    assert route.run(args) == 1
    err = capsys.readouterr().err
    assert "FAILED_PRECONDITION" in err and "--redis-url" in err
    assert lone.daemon.cluster is None


def test_published_address_is_dialable_over_tcp(cluster: Callable[..., Node]) -> None:
    """A node whose node_address is a bare host (a pod IP) listening on TCP with a tcp_token is
    located at HOST:PORT; a router dials that address with the token and is served."""
    a = cluster("node-a", node_address="127.0.0.1", tcp_port=0, tcp_token="router-secret")
    b = cluster("node-b")
    hashes = chain(2, seed=5)
    with a.client() as ca, b.client() as cb:
        assert store(ca, ca.register_engine(LAYOUT, "a"), hashes) == 2
        found = wait_for("A published", lambda: cb.locate(None, hashes, layout=LAYOUT),
                         lambda r: [p.node_id for p in r.nodes] == ["node-a"])
    assert found.nodes[0].address == f"127.0.0.1:{a.daemon.tcp_port}"
    with TierdClient(address=found.nodes[0].address, token="router-secret") as router:
        assert router.locate(None, hashes, layout=LAYOUT).nodes[0].node_id == "node-a"


WHY_TOKENS = list(range(500, 564))   # four 16-token blocks


def why_json(node: Node, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    why_cmd.configure(parser)
    assert why_cmd.run(parser.parse_args([
        ",".join(map(str, WHY_TOKENS)), "--model", LAYOUT.model_id, "--num-layers", "2",
        "--num-kv-heads", "2", "--head-size", "16", "--dtype", "float16", "--socket-path",
        node.config.socket_path, "--json"])) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_why_names_the_node_that_holds_the_prompt(cluster: Callable[..., Node],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A stores the prompt's 4 blocks; asked on B, the verdict is never stored here, the
    cluster nodes list A with 4 DRAM blocks and the reason points at routing."""
    a, b = cluster("node-a"), cluster("node-b")
    with a.client() as ca:
        engine = ca.register_engine(LAYOUT, "a")
        assert store(ca, engine, hashing.block_hashes(WHY_TOKENS, 16)) == 4
    report = wait_for("A published", lambda: why_json(b, capsys),
                      lambda r: bool(r["nodes"]))
    assert report["verdict"] == "never_stored" and report["cluster_stale"] is False
    assert report["nodes"] == [{"node_id": "node-a", "address": f"unix:{a.config.socket_path}",
                                "prefix_blocks": 4, "tiers": ["dram"] * 4}]
    assert "node node-a" in str(report["reason"]) and "routing" in str(report["reason"])
    assert why_json(a, capsys)["verdict"] == "hit"
