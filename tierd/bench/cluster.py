"""`tierd bench cluster`: Locate latency against a plain pipelined EXISTS, and publish throughput.

Locate of a 128-block chain (one EVALSHA that also walks the holders and tiers) is timed against
the least any client could do to learn the same thing from Redis: one pipelined ``EXISTS`` of
the same 128 keys on the same server, measured in the same run. Target: locate p50 within 1.5x.
Publish throughput is blocks/s through the publisher (held-set bookkeeping plus batched
publish scripts), printed beside raw pipelined ``HSET`` of the same keys.

Without ``--redis-url`` it starts its own ``redis-server`` (no persistence) on a free loopback
port and stops it afterwards; with one, it uses a key prefix of its own and deletes its keys.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from tierd.types import BlockHash, Namespace, make_key

HELP = "Cluster directory: Locate vs pipelined EXISTS latency, publish throughput."

LOCATE_LIMIT = 1.5


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis (default: start a private redis-server)")
    parser.add_argument("--chain", type=int, default=128, help="blocks per located chain")
    parser.add_argument("--nodes", type=int, default=3,
                        help="nodes holding (parts of) the chain (default 3)")
    parser.add_argument("--repeat", type=int, default=400, help="timed locates (and EXISTS)")
    parser.add_argument("--publish-blocks", type=int, default=20_000,
                        help="blocks published for the throughput figure")


@contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ValueError("redis-server not found: install it (apt-get install redis-server) "
                         "or pass --redis-url")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                 "", "--appendonly", "no", "--dir", tmp],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


async def _timed(op: Callable[[], Awaitable[object]], repeat: int) -> list[float]:
    for _ in range(min(50, repeat)):           # warm-up: connections, script cache
        await op()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        await op()
        samples.append(time.perf_counter() - start)
    return samples


async def _bench(url: str, args: argparse.Namespace) -> int:
    from tierd.cluster.directory import Directory, DirectoryConfig, NodeRecord
    from tierd.cluster.publisher import Publisher, PublisherConfig

    prefix = f"tierd-bench-{os.getpid()}:"
    config = DirectoryConfig(redis_url=url, key_prefix=prefix, timeout_s=5.0)
    namespace = Namespace(hashlib.blake2b(b"bench", digest_size=16).digest())
    chain = [BlockHash(hashlib.sha256(i.to_bytes(4, "big")).digest()) for i in range(args.chain)]
    keys = [make_key(namespace, h) for h in chain]
    publishers = []
    for n in range(args.nodes):
        pub = Publisher(Directory(config), PublisherConfig(NodeRecord(f"node-{n}", f"n{n}:1")))
        held = keys[:len(keys) * (n + 1) // args.nodes]     # node i holds a longer prefix
        pub.stored(held, "dram")
        pub.stored(held[:len(held) // 4], "hbm")
        assert await pub.step(), f"publishing to {url} failed: {pub.directory.last_error}"
        publishers.append(pub)
    directory = Directory(config)
    redis = directory.redis
    redis_keys = [directory.block_key(k) for k in keys]

    async def exists() -> object:
        async with redis.pipeline(transaction=False) as pipe:
            for key in redis_keys:
                pipe.exists(key)
            return await pipe.execute()

    ranked = await directory.locate(namespace, chain)
    assert [p.prefix_blocks for p in ranked][:1] == [args.chain], "locate found the wrong prefix"
    locate_s = await _timed(lambda: directory.locate(namespace, chain), args.repeat)
    exists_s = await _timed(exists, args.repeat)

    def p99(samples: list[float]) -> float:
        return statistics.quantiles(samples, n=100)[98] * 1e3

    lp50, ep50 = statistics.median(locate_s) * 1e3, statistics.median(exists_s) * 1e3
    ratio = lp50 / ep50
    print(f"locate {args.chain}-block chain, {args.nodes} nodes: p50 {lp50:.3f} ms, "
          f"p99 {p99(locate_s):.3f} ms")
    print(f"pipelined EXISTS x{args.chain}:               p50 {ep50:.3f} ms, "
          f"p99 {p99(exists_s):.3f} ms")
    print(f"locate / EXISTS = {ratio:.2f}x (limit {LOCATE_LIMIT}x): "
          f"{'OK' if ratio <= LOCATE_LIMIT else 'OVER'}")

    # Publish throughput: a fresh node publishing N new blocks through the whole path.
    pub = Publisher(Directory(config), PublisherConfig(NodeRecord("node-pub", "p:1")))
    assert await pub.step()
    many = [make_key(namespace, BlockHash(hashlib.sha256(b"p" + i.to_bytes(4, "big")).digest()))
            for i in range(args.publish_blocks)]
    start = time.perf_counter()
    pub.stored(many, "dram")
    assert await pub.step() and pub.pending == 0, "publish failed"
    publish_rate = len(many) / (time.perf_counter() - start)
    raw_keys = [b"raw:" + directory.block_key(k) for k in many]
    start = time.perf_counter()
    for i in range(0, len(raw_keys), 512):
        async with redis.pipeline(transaction=False) as pipe:
            for key in raw_keys[i:i + 512]:
                pipe.hset(key, "node-pub", "d0")
            await pipe.execute()
    raw_rate = len(raw_keys) / (time.perf_counter() - start)
    print(f"publish: {publish_rate:,.0f} blocks/s (batches of 512, TTL and tier per block); "
          f"raw pipelined HSET {raw_rate:,.0f} keys/s; ratio {publish_rate / raw_rate:.2f}")

    async for key in redis.scan_iter(match=prefix.encode() + b"*", count=1000):
        await redis.delete(key)
    async for key in redis.scan_iter(match=b"raw:" + prefix.encode() + b"*", count=1000):
        await redis.delete(key)
    for p in [*publishers, pub]:
        await p.directory.close()
    await directory.close()
    return 0 if ratio <= LOCATE_LIMIT else 1


def _bench_rpc(url: str, args: argparse.Namespace) -> None:
    """The Locate RPC end to end (engine -> daemon over its Unix socket -> Redis -> back) beside
    a local Lookup RPC of the same chain (the gRPC round trip alone) and the same pipelined
    EXISTS: what a router pays, and how much of it is the daemon's hop."""
    import redis as sync_redis

    from tierd.cluster.directory import Directory, DirectoryConfig, NodeRecord
    from tierd.cluster.publisher import Publisher, PublisherConfig
    from tierd.commands.demo import EmbeddedDaemon, embedded_config
    from tierd.wire.client import TierdClient
    from tierd.wire.layout import Layout, namespace_for

    layout = Layout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_size=16,
                    model_id="bench-cluster@synthetic")
    chain = [BlockHash(hashlib.sha256(b"rpc" + i.to_bytes(4, "big")).digest())
             for i in range(args.chain)]
    with tempfile.TemporaryDirectory(prefix="tierd-bench-cluster-") as workdir:
        config = embedded_config(workdir, dram_bytes=16 << 20, ssd_bytes=0, ssd_dir="",
                                 redis_url=url, node_id="bench-node")
        daemon = EmbeddedDaemon(config).start()
        try:
            with TierdClient(socket_path=config.socket_path) as client:
                engine = client.register_engine(layout, "bench")
                keys = [make_key(namespace_for(config.default_tenant, layout), h) for h in chain]

                async def publish() -> list[bytes]:
                    """Another node holds the whole chain; returns its blocks' Redis keys."""
                    pub = Publisher(Directory(DirectoryConfig(redis_url=url)),
                                    PublisherConfig(NodeRecord("bench-peer", "peer:1")))
                    pub.stored(keys, "dram")
                    assert await pub.step(), f"publishing to {url} failed"
                    block_keys = [pub.directory.block_key(k) for k in keys]
                    await pub.directory.close()
                    return block_keys

                block_keys = asyncio.run(publish())
                located = client.locate(None, chain, layout=layout)
                assert [n.prefix_blocks for n in located.nodes][:1] == [args.chain], located
                sync = sync_redis.Redis.from_url(url)

                def exists() -> object:
                    pipe = sync.pipeline(transaction=False)
                    for key in block_keys:
                        pipe.exists(key)
                    return pipe.execute()

                def timed(op: Callable[[], object]) -> list[float]:
                    op()
                    samples = []
                    for _ in range(args.repeat):
                        start = time.perf_counter()
                        op()
                        samples.append(time.perf_counter() - start)
                    return samples

                rpc = statistics.median(
                    timed(lambda: client.locate(None, chain, layout=layout))) * 1e3
                lookup = statistics.median(
                    timed(lambda: client.lookup(engine.engine_id, chain))) * 1e3
                raw = statistics.median(timed(exists)) * 1e3
                sync.close()
        finally:
            daemon.stop()
    print(f"Locate RPC {args.chain}-block chain: p50 {rpc:.3f} ms; local Lookup RPC (gRPC hop) "
          f"{lookup:.3f} ms; sync pipelined EXISTS {raw:.3f} ms")
    print(f"Locate RPC / EXISTS = {rpc / raw:.2f}x; (Locate RPC - gRPC hop) / EXISTS = "
          f"{max(rpc - lookup, 0.0) / raw:.2f}x (limit {LOCATE_LIMIT}x applies to the directory "
          f"call above; the RPC adds one gRPC round trip)")


def run(args: argparse.Namespace) -> int:
    if args.chain <= 0 or args.nodes <= 0 or args.repeat < 2 or args.publish_blocks <= 0:
        raise ValueError("--chain, --nodes, --publish-blocks must be positive, --repeat >= 2")
    if args.redis_url is not None:
        status = asyncio.run(_bench(args.redis_url, args))
        _bench_rpc(args.redis_url, args)
        return status
    with private_redis() as url:
        status = asyncio.run(_bench(url, args))
        _bench_rpc(url, args)
        return status
