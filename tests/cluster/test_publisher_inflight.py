"""The publisher against a real redis-server: a change made while its batch is in flight."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tierd.cluster.directory import Directory, DirectoryConfig, NodeRecord
from tierd.cluster.publisher import Publisher, PublisherConfig
from tierd.types import BlockHash, Namespace, make_key

if TYPE_CHECKING:
    from conftest import RedisServer


def test_change_during_an_inflight_batch_is_published(redis_server: RedisServer) -> None:
    """A block moves dram -> ssd while its dram publish is in flight: the same step publishes
    ssd too (the change used to be dropped until the TTL refresh, 200 s later)."""
    async def scenario() -> list[str]:
        directory = Directory(DirectoryConfig(redis_url=redis_server.url))
        pub = Publisher(directory, PublisherConfig(NodeRecord("a", "a:1")))
        assert await pub.step()                     # heartbeat + (empty) full publish
        namespace, block = Namespace(bytes(16)), BlockHash(bytes(32))
        key = make_key(namespace, block)
        pub.stored([key], "dram")
        flush = asyncio.create_task(pub.step())
        await asyncio.sleep(0)                      # the batch (dram) is now in flight
        pub.stored([key], "ssd")
        pub.removed([key], "dram")                  # demoted meanwhile
        assert await flush and pub.pending == 0     # the re-marked key went out in the same step
        pub.check_integrity()
        found = await directory.locate(namespace, [block])
        await directory.close()
        return [t for p in found for t in p.tiers]

    assert asyncio.run(scenario()) == ["ssd"]
