"""The cluster directory and its publisher against a real redis-server of the test's own."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierd.cluster.directory import Directory, DirectoryConfig, NodeRecord
from tierd.cluster.publisher import Publisher, PublisherConfig
from tierd.types import BlockHash, Namespace, NamespacedKey, make_key

if TYPE_CHECKING:
    from conftest import RedisServer

NS_A = Namespace(b"A" * 16)
NS_B = Namespace(b"B" * 16)


class Clock:
    """A hand-moved monotonic clock, so backoff and cadence need no sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(n: int, seed: bytes = b"p") -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(seed + bytes([i])).digest()) for i in range(n)]


def keys(namespace: Namespace, hashes: Sequence[BlockHash]) -> list[NamespacedKey]:
    return [make_key(namespace, h) for h in hashes]


def node(server: RedisServer, node_id: str, clock: Clock, **config: float) -> Publisher:
    directory = Directory(DirectoryConfig(redis_url=server.url, **config), clock=clock)
    return Publisher(directory, PublisherConfig(NodeRecord(node_id, f"{node_id}:50051", 1 << 30),
                                                heartbeat_s=config.get("node_ttl_s", 15) / 3,
                                                refresh_s=config.get("block_ttl_s", 600) / 3),
                     clock=clock)


async def close(*pubs: Publisher) -> None:
    for pub in pubs:
        pub.check_integrity()
        pub.directory.check_integrity()
        await pub.close(withdraw=False)
        await pub.directory.close()


async def test_prefix_published_by_a_is_located_on_a_from_b(redis_server: RedisServer) -> None:
    """A holds blocks 0-2 in HBM and 3-5 in DRAM, B holds 0-1 in SSD: B's locate ranks A first
    with prefix 6 and exact tiers, then itself with prefix 2."""
    clock = Clock()
    a, b = node(redis_server, "a", clock), node(redis_server, "b", clock)
    hashes = chain(8)
    a.stored(keys(NS_A, hashes[:6]), "dram")
    a.stored(keys(NS_A, hashes[:3]), "hbm")
    b.stored(keys(NS_A, hashes[:2]), "ssd")
    assert await a.step() and await b.step()
    ranked = await b.directory.locate(NS_A, hashes)
    assert [(p.node_id, p.address, p.prefix_blocks, p.tiers, p.score) for p in ranked] == [
        ("a", "a:50051", 6, ("hbm",) * 3 + ("dram",) * 3, 5.4),
        ("b", "b:50051", 2, ("ssd", "ssd"), 1.2)]
    assert ranked[0].capacity_bytes == 1 << 30
    assert await b.directory.locate(NS_A, chain(8, b"other")) == []   # nobody holds block 0
    gapped = hashes[:1] + chain(2, b"x") + hashes[2:]
    assert [p.prefix_blocks for p in await b.directory.locate(NS_A, gapped)] == [
        1, 1]                           # a gap ends every prefix
    assert b.directory.stats.published_blocks == 2 and a.directory.stats.published_blocks == 6
    await close(a, b)


async def test_eviction_moves_and_withdraws_entries(redis_server: RedisServer) -> None:
    """Demoting block 1 to SSD republishes it as ssd; dropping block 2 from every tier ends
    the prefix there; clearing DRAM leaves only the SSD copy."""
    clock = Clock()
    a = node(redis_server, "a", clock)
    hashes = chain(4)
    a.stored(keys(NS_A, hashes), "dram")
    assert await a.step()
    a.stored(keys(NS_A, hashes[1:2]), "ssd")
    a.removed(keys(NS_A, hashes[1:2]), "dram")
    a.removed(keys(NS_A, hashes[2:3]), "dram")
    assert a.pending == 2
    assert await a.step() and a.pending == 0
    ranked = await a.directory.locate(NS_A, hashes)
    assert [(p.prefix_blocks, p.tiers) for p in ranked] == [(2, ("dram", "ssd"))]
    a.cleared("dram")
    assert await a.step()
    assert a.held() == {make_key(NS_A, hashes[1]): "ssd"}
    assert await a.directory.locate(NS_A, hashes) == []
    assert [p.tiers for p in await a.directory.locate(NS_A, hashes[1:])] == [("ssd",)]
    await close(a)


async def test_tenants_never_match_across_namespaces(redis_server: RedisServer) -> None:
    """The same hashes under namespace A are invisible to a locate under namespace B."""
    clock = Clock()
    a, b = node(redis_server, "a", clock), node(redis_server, "b", clock)
    hashes = chain(4)
    a.stored(keys(NS_A, hashes), "dram")
    b.stored(keys(NS_B, hashes[:1]), "dram")
    assert await a.step() and await b.step()
    assert [(p.node_id, p.prefix_blocks) for p in await b.directory.locate(NS_B, hashes)] == [
        ("b", 1)]
    assert [(p.node_id, p.prefix_blocks) for p in await b.directory.locate(NS_A, hashes)] == [
        ("a", 4)]
    await close(a, b)


async def test_dead_node_entries_expire(redis_server: RedisServer) -> None:
    """A node that stops heartbeating vanishes from locate after node_ttl, and its block keys
    are freed by Redis after block_ttl."""
    clock = Clock()
    a = node(redis_server, "a", clock, node_ttl_s=0.2, block_ttl_s=0.4)
    b = node(redis_server, "b", clock, node_ttl_s=0.2, block_ttl_s=0.4)
    hashes = chain(3)
    a.stored(keys(NS_A, hashes), "dram")
    assert await a.step()
    assert [p.node_id for p in await b.directory.locate(NS_A, hashes)] == ["a"]
    await asyncio.sleep(0.3)            # past node_ttl: a's heartbeat is too old
    assert await b.directory.locate(NS_A, hashes) == []
    redis = b.directory._redis
    for _ in range(100):                # Redis frees expired keys lazily, within ~100 ms
        if await redis.exists(*(b.directory.block_key(k) for k in keys(NS_A, hashes))) == 0:
            break
        await asyncio.sleep(0.05)
    assert await redis.exists(*(b.directory.block_key(k) for k in keys(NS_A, hashes))) == 0
    await close(a, b)


async def test_redis_killed_mid_run_then_restarted(redis_server: RedisServer) -> None:
    """With Redis dead, publish and locate return empty without raising and the directory is
    stale; once it restarts empty on the same port, the next step after the backoff
    re-publishes the whole held set and locate sees everything again."""
    clock = Clock()
    a, b = node(redis_server, "a", clock), node(redis_server, "b", clock)
    hashes = chain(5)
    a.stored(keys(NS_A, hashes[:3]), "dram")
    assert await a.step() and await b.step()
    redis_server.stop()
    a.stored(keys(NS_A, hashes[3:]), "dram")
    assert await a.step() is False
    assert await b.directory.locate(NS_A, hashes) == []
    assert a.directory.stale and b.directory.stale
    assert await a.step() is False      # within the backoff: Redis is not even tried
    assert a.directory.stats.skipped_stale >= 1
    redis_server.start()
    assert await b.directory.locate(NS_A, hashes) == []    # still inside b's backoff
    clock.now += 1.0                    # past the backoff
    assert await a.step() and a.stats.resyncs == 1
    ranked = await b.directory.locate(NS_A, hashes)
    assert [(p.node_id, p.prefix_blocks) for p in ranked] == [("a", 5)]
    assert not a.directory.stale and not b.directory.stale
    assert a.directory.outages == 1
    await close(a, b)


async def test_emptied_redis_is_detected_by_the_heartbeat(redis_server: RedisServer) -> None:
    """A FLUSHALL between two heartbeats (no failed call) still triggers a full re-publish."""
    clock = Clock()
    a = node(redis_server, "a", clock)
    hashes = chain(2)
    a.stored(keys(NS_A, hashes), "hbm")
    assert await a.step()
    await a.directory._redis.flushall()
    clock.now += a.config.heartbeat_s
    assert await a.step() and a.stats.resyncs == 1
    assert [p.tiers for p in await a.directory.locate(NS_A, hashes)] == [("hbm", "hbm")]
    await close(a)


async def test_pending_overflow_falls_back_to_full_publish(redis_server: RedisServer) -> None:
    """More changes than max_pending drop the pending set and publish everything once."""
    clock = Clock()
    directory = Directory(DirectoryConfig(redis_url=redis_server.url), clock=clock)
    a = Publisher(directory, PublisherConfig(NodeRecord("a", "a:1"), max_pending=4,
                                             batch_size=3), clock=clock)
    assert await a.step()               # the initial (empty) full publish
    hashes = chain(10)
    a.stored(keys(NS_A, hashes), "dram")
    assert a.pending == 0 and a.stats.pending_overflows == 1
    a.check_integrity()
    assert await a.step() and a.stats.full_publishes == 2
    assert [p.prefix_blocks for p in await directory.locate(NS_A, hashes)] == [10]
    await close(a)


async def test_background_task_publishes_and_withdraws(redis_server: RedisServer) -> None:
    """``run()`` pushes a change without any explicit step; ``close()`` withdraws the node."""
    a = node(redis_server, "a", Clock())
    task = asyncio.create_task(a.run())
    hashes = chain(2)
    a.stored(keys(NS_A, hashes), "dram")
    for _ in range(200):
        if await a.directory.locate(NS_A, hashes):
            break
        await asyncio.sleep(0.01)
    assert [p.prefix_blocks for p in await a.directory.locate(NS_A, hashes)] == [2]
    await a.close()
    await asyncio.wait_for(task, 5)
    assert await a.directory.locate(NS_A, hashes) == []
    await a.directory.close()


async def test_slow_redis_times_out_into_stale(redis_server: RedisServer) -> None:
    """A Redis paused past the timeout (CLIENT PAUSE) makes locate return [] and the directory
    stale, without raising; after the pause and the backoff it answers again."""
    clock = Clock()
    a = node(redis_server, "a", clock, timeout_s=0.25)
    hashes = chain(2)
    a.stored(keys(NS_A, hashes), "dram")
    for _ in range(5):                  # the first step connects too: a busy host may be slow
        if await a.step():
            break
        clock.now += 10.0               # past the backoff
    assert not a.directory.stale
    admin = Directory(DirectoryConfig(redis_url=redis_server.url))
    await admin.redis.execute_command("CLIENT", "PAUSE", 1000, "ALL")
    assert await a.directory.locate(NS_A, hashes) == []
    assert a.directory.stale and "TimeoutError" in a.directory.last_error
    await asyncio.sleep(1.1)            # the pause ends
    clock.now += 1.0
    assert [p.prefix_blocks for p in await a.directory.locate(NS_A, hashes)] == [2]
    assert not a.directory.stale
    await admin.close()
    await close(a)
