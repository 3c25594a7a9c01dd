"""The shared remote tier against a real redis-server of the test's own."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from tierd.checksum import block_checksum
from tierd.cluster.directory import Directory, DirectoryConfig
from tierd.cluster.remote import RemoteConfig, RemoteTier
from tierd.types import BlockHash, Namespace

if TYPE_CHECKING:
    from conftest import RedisServer

NS = Namespace(b"n" * 16)
OTHER = Namespace(b"o" * 16)


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(bytes([i])).digest())


def remote(server: RedisServer, **config: object) -> RemoteTier:
    return RemoteTier(Directory(DirectoryConfig(redis_url=server.url)),
                      RemoteConfig(**config))  # type: ignore[arg-type]


async def done(tier: RemoteTier) -> None:
    await tier.check_integrity()
    tier.directory.check_integrity()
    await tier.directory.close()


async def test_put_get_is_bit_exact_raw_and_compressed(redis_server: RedisServer) -> None:
    """A random block is stored raw, a zero block lz4-compressed; both come back bit-exact and
    only under their own namespace."""
    tier = remote(redis_server)
    noise, zeros = os.urandom(4096), bytes(4096)
    assert await tier.put(NS, h(0), noise, block_checksum(noise))
    assert await tier.put(NS, h(1), memoryview(zeros), block_checksum(zeros))
    assert tier.stats.puts == 2 and tier.stats.compressed_puts == 1
    assert await tier.get_many(NS, [h(0), h(1), h(2)]) == [noise, zeros, None]
    assert await tier.get(OTHER, h(0)) is None
    slot = memoryview(bytearray(4096))
    assert await tier.get_into(NS, h(0), slot) and bytes(slot) == noise
    assert not await tier.get_into(NS, h(0), memoryview(bytearray(10)))   # wrong slot size
    assert (tier.stats.hits, tier.stats.misses) == (4, 2)
    assert await tier.used_bytes() == 4096 + 24 + len(tier.encode(zeros, 0))
    await done(tier)


async def test_corrupted_block_is_a_miss_and_dropped(redis_server: RedisServer) -> None:
    """A byte flipped in Redis makes the fetch a miss, counts it, and deletes the block."""
    tier = remote(redis_server)
    data = os.urandom(1000)
    assert await tier.put(NS, h(0), data, block_checksum(data))
    key = tier._key(NS, h(0))
    stored = bytearray(await tier.directory.redis.get(key))
    stored[-1] ^= 0xFF
    await tier.directory.redis.set(key, bytes(stored))
    assert await tier.get(NS, h(0)) is None
    assert tier.stats.checksum_failures == 1
    assert await tier.directory.redis.exists(key) == 0
    assert await tier.used_bytes() == 0
    assert not await tier.put(NS, h(1), data, block_checksum(data) ^ 1)   # wrong checksum
    assert tier.stats.put_failures == 1
    await done(tier)


async def test_byte_budget_evicts_least_recently_used(redis_server: RedisServer) -> None:
    """Budget for three 1024-byte blocks: touching block 0 makes block 1 the one evicted by
    the fourth put; a block over the whole budget is refused."""
    tier = remote(redis_server, budget_bytes=3 * (1024 + 24), compression="off")
    blocks = [os.urandom(1024) for _ in range(4)]
    for i in range(3):
        assert await tier.put(NS, h(i), blocks[i], block_checksum(blocks[i]))
    assert await tier.get(NS, h(0)) == blocks[0]
    assert await tier.put(NS, h(3), blocks[3], block_checksum(blocks[3]))
    assert tier.stats.evictions == 1
    assert await tier.get_many(NS, [h(0), h(1), h(2), h(3)]) == [
        blocks[0], None, blocks[2], blocks[3]]
    assert await tier.used_bytes() == 3 * (1024 + 24)
    big = os.urandom(4000)
    assert not await tier.put(NS, h(9), big, block_checksum(big))
    assert await tier.used_bytes() == 3 * (1024 + 24)
    await done(tier)


async def test_should_fetch_compares_predicted_fetch_with_recompute(
        redis_server: RedisServer) -> None:
    """At a measured 100 MB/s, 1 MB takes 10 ms: fetched if recompute takes 20 ms, skipped if
    it takes 5 ms; with no measurement the tier fetches to learn. Every decision is counted."""
    tier = remote(redis_server)
    assert tier.should_fetch(1_000_000, 0.001)
    tier.record_fetch(1_000_000, 0.01)
    assert tier.stats.bandwidth_bps == 100e6
    assert tier.should_fetch(1_000_000, 0.020)
    assert not tier.should_fetch(1_000_000, 0.005)
    tier.record_fetch(1_000_000, 0.1)                 # a slow sample: 10 MB/s
    assert round(tier.stats.bandwidth_bps) == round(0.2 * 10e6 + 0.8 * 100e6)
    assert (tier.stats.fetch_decisions, tier.stats.skip_decisions) == (2, 1)
    await done(tier)


async def test_redis_down_makes_remote_a_fast_miss(redis_server: RedisServer) -> None:
    """With Redis gone, put is refused and get misses, without raising."""
    tier = remote(redis_server)
    data = os.urandom(100)
    redis_server.stop()
    assert not await tier.put(NS, h(0), data, block_checksum(data))
    assert await tier.get_many(NS, [h(0), h(1)]) == [None, None]
    assert tier.directory.stale and tier.stats.misses == 2
    tier.directory.check_integrity()
    await tier.directory.close()


async def test_node_b_serves_a_block_node_a_put(redis_server: RedisServer) -> None:
    """Node A puts an evicted block; node B, over its own connection, fetches it into a slot."""
    a, b = remote(redis_server), remote(redis_server)
    data = bytes(range(256)) * 16
    assert await a.put(NS, h(7), data, block_checksum(data))
    slot = memoryview(bytearray(len(data)))
    assert b.should_fetch(len(data), 0.01)
    assert await b.get_into(NS, h(7), slot) and bytes(slot) == data
    assert b.stats.hits == 1 and b.stats.bandwidth_bps > 0
    await done(a)
    await done(b)
