"""The daemon's link to the cluster: what the node holds goes to the Redis directory, Locate asks
it, and (optionally) evicted blocks go to the shared remote tier and come back on a local miss.

``ClusterLink`` is the ``TierListener`` of the node store: every change of a tier reaches it
synchronously with namespaced keys, and it forwards it to the ``Publisher`` (no I/O: the
publisher's own task talks to Redis). HBM reports are reference counted per key, because two
engines of one namespace may both hold a block and the directory holds one entry per node.

Remote tier (off unless configured):
- *Put*: a block whose last copy leaves the node by eviction (an SSD eviction, or a DRAM
  eviction with no SSD copy) is copied into a bounded queue (``queue_bytes``; past it the block
  is simply not shared, and counted); ``flush_remote`` (the maintain loop) puts the queue into
  Redis. Nothing touches Redis on the request path for a put.
- *Fetch*: ``acquire`` wraps ``NodeStore.acquire``. When the local prefix ends early it asks
  ``RemoteTier.should_fetch`` (predicted fetch time from measured bandwidth against recomputing
  the rest at ``recompute_tokens_per_second``), fetches the leading run of remote hits in
  chunks of at most ``fetch_chunk_bytes`` (each verified by checksum), stores them through the
  ordinary reserve/commit path into DRAM slots, then acquires again so the one lease covers the
  longer prefix. Cost of that design: the first lease's blocks are acquired twice (their hit
  count and reuse gap see one extra, ~0 s, access).

No Redis failure raises here: the directory turns them into empty answers and a ``stale`` flag.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tierd.checksum import block_checksum
from tierd.cluster.directory import Directory, DirectoryConfig, NodeRecord
from tierd.cluster.publisher import Publisher, PublisherConfig
from tierd.cluster.remote import RemoteConfig, RemoteTier
from tierd.types import BlockHash, Namespace, NamespacedKey, Placement, Tier

if TYPE_CHECKING:
    from tierd.daemon.listeners import Payload
    from tierd.daemon.node import EngineInfo, Lease, NodeStore
    from tierd.wire.arena import ShmArena

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """Everything the link needs (the server builds it from ``TierdConfig``)."""

    redis_url: str
    node: NodeRecord
    heartbeat_s: float = 5.0
    node_ttl_s: float = 15.0
    block_ttl_s: float = 600.0
    remote_tier: bool = False
    remote_tier_bytes: int = 1 << 30
    queue_bytes: int = 64 << 20             # evicted blocks waiting to be put remote
    recompute_tokens_per_second: float = 10_000.0
    fetch_chunk_bytes: int = 32 << 20       # per remote round trip (well under the 0.5 s timeout)


@dataclass(slots=True)
class LinkStats:
    """Counters of the link itself (the directory, publisher and remote tier keep their own)."""

    queued_puts: int = 0
    dropped_puts: int = 0           # evicted blocks not shared: queue full or unreadable
    remote_puts_failed: int = 0
    fetched_blocks: int = 0         # remote blocks stored into DRAM by acquire
    fetch_skips: int = 0            # acquires that recomputed instead (should_fetch said no)


@dataclass(frozen=True, slots=True)
class _Evicted:
    namespace: Namespace
    block_hash: BlockHash
    payload: asyncio.Future[bytes | None]  # copied (DRAM) or being read (SSD)
    nbytes: int
    checksum: int


class ClusterLink:
    """The node's side of the cluster. One event loop only; ``bind`` it to the store before
    serving, ``start`` the publisher task, ``close`` at shutdown."""

    def __init__(self, config: LinkConfig, namespace_len: int) -> None:
        """Build the directory client, publisher and (if configured) remote tier: no I/O."""
        self.config = config
        self._ns_len = namespace_len
        self.directory = Directory(DirectoryConfig(
            redis_url=config.redis_url, node_ttl_s=config.node_ttl_s,
            block_ttl_s=config.block_ttl_s))
        self.publisher = Publisher(self.directory, PublisherConfig(
            node=config.node, heartbeat_s=config.heartbeat_s, refresh_s=config.block_ttl_s / 3))
        remote = RemoteConfig(budget_bytes=config.remote_tier_bytes)
        self.remote = RemoteTier(self.directory, remote) if config.remote_tier else None
        self.stats = LinkStats()
        self._hbm_refs: Counter[NamespacedKey] = Counter()
        self._queue: deque[_Evicted] = deque()
        self._queued_bytes = 0
        self._engines: dict[str, EngineInfo] = {}
        self._store: NodeStore | None = None
        self._arena: ShmArena | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self, store: NodeStore, arena: ShmArena) -> None:
        """The store this link listens to (built with ``listener=self``) and its arena."""
        self._store, self._arena = store, arena

    def set_address(self, address: str) -> None:
        """Publish ``address`` as where this node is reached (known once the listeners are
        bound). Call before ``start``."""
        assert self._task is None, "set the address before starting the publisher"
        node = replace(self.config.node, address=address)
        self.config = replace(self.config, node=node)
        self.publisher.config = replace(self.publisher.config, node=node)

    def start(self) -> None:
        """Start the publisher task (heartbeat, then everything held). Needs a running loop."""
        assert self._task is None, "the cluster link is already started"
        self._task = asyncio.create_task(self.publisher.run())

    async def close(self) -> None:
        """Stop publishing and withdraw this node (Locate stops returning it at once; its block
        entries expire with their TTL); close the Redis connection. Never raises for Redis."""
        await self.publisher.close(withdraw=True)
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self.directory.close()

    def engine_registered(self, info: EngineInfo) -> None:
        self._engines[info.engine_id] = info

    def engine_unregistered(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def namespace_of(self, engine_id: str) -> Namespace:
        """The namespace of a registered engine (the servicer checked it is the caller's)."""
        return self._engines[engine_id].namespace

    # -- TierListener: synchronous, no I/O ---------------------------------------------------

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        if tier == "hbm":
            keys = [k for k in keys if self._hbm_ref(k, +1) == 1]
        self.publisher.stored(keys, tier)

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        if tier == "hbm":
            keys = [k for k in keys if self._hbm_ref(k, -1) == 0]
        self.publisher.removed(keys, tier)

    def cleared(self, tier: Tier) -> None:
        self.publisher.cleared(tier)

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        if self.remote is None:
            return
        if self._queued_bytes + nbytes > self.config.queue_bytes:
            self.stats.dropped_puts += 1
            return
        namespace, block_hash = Namespace(key[:self._ns_len]), BlockHash(key[self._ns_len:])
        self._queue.append(_Evicted(namespace, block_hash, payload(), nbytes, checksum))
        self._queued_bytes += nbytes
        self.stats.queued_puts += 1

    def _hbm_ref(self, key: NamespacedKey, delta: int) -> int:
        count = self._hbm_refs[key] + delta
        assert count >= 0, f"{key.hex()}: more HBM removals than reports"
        if count:
            self._hbm_refs[key] = count
        else:
            del self._hbm_refs[key]
        return count

    # -- Redis-side work ---------------------------------------------------------------------

    async def locate(self, namespace: Namespace,
                     hashes: Sequence[BlockHash]) -> tuple[list[Placement], bool]:
        """Nodes ranked by the prefix of the chain they hold (one Redis round trip), and whether
        the directory is stale (then the list is empty and means nothing)."""
        placements = await self.directory.locate(namespace, hashes)
        return placements, self.directory.stale

    async def flush_remote(self) -> int:
        """Put every queued evicted block into the remote tier (the maintain loop calls this;
        one round trip per block). Returns how many were stored; failures are counted and the
        blocks dropped (they were evicted anyway)."""
        assert self.remote is not None or not self._queue, "queued puts without a remote tier"
        stored = 0
        while self._queue and self.remote is not None:
            item = self._queue.popleft()
            self._queued_bytes -= item.nbytes
            data = await item.payload
            if data is None:  # an SSD record that did not verify
                self.stats.dropped_puts += 1
            elif await self.remote.put(item.namespace, item.block_hash, data, item.checksum):
                stored += 1
            else:
                self.stats.remote_puts_failed += 1
        return stored

    async def acquire(self, engine_id: str, hashes: Sequence[BlockHash], *,
                      count_lookup: bool = False, dram_run_only: bool = False,
                      hold: bool = False) -> Lease:
        """``NodeStore.acquire``, extended by the remote tier's leading run of hits when that
        is predicted to beat recomputing (see the module doc); not with ``dram_run_only``.
        Same errors as the store's; ``count_lookup`` counts the chain once, on the first local
        acquire; ``hold`` as the store's."""
        store = self._store
        assert store is not None and self._arena is not None, "bind the link before serving"
        lease = await store.acquire(engine_id, hashes, count_lookup=count_lookup,
                                    dram_run_only=dram_run_only, hold=hold)
        hit = len(lease.slot_ids)
        info = self._engines.get(engine_id)
        if self.remote is None or hit == len(hashes) or info is None or dram_run_only:
            return lease
        rest = hashes[hit:]
        slot_bytes = info.geometry.slot_bytes
        recompute_s = len(rest) * info.layout.block_size / self.config.recompute_tokens_per_second
        if not self.remote.should_fetch(len(rest) * slot_bytes, recompute_s):
            self.stats.fetch_skips += 1
            return lease
        blocks = await self._fetch_run(info.namespace, rest, slot_bytes)
        if not blocks:
            return lease
        reservation = store.reserve(engine_id, rest[:len(blocks)])
        checksums: list[int | None] = []
        for block, slot in zip(blocks, reservation.slot_ids):
            if slot is not None:
                self._arena.view(info.geometry.offset(slot), slot_bytes)[:] = block
            checksums.append(None if slot is None else block_checksum(block))
        fetched = store.commit(reservation.lease_id, checksums)
        self.stats.fetched_blocks += fetched
        _log.debug("remote tier: %d blocks fetched into DRAM for %s", fetched, engine_id)
        if not fetched:
            return lease
        store.release(lease.lease_id)        # no await between commit and the new acquire:
        again = await store.acquire(engine_id, hashes,  # nothing can evict the fetched blocks
                                    hold=True)          # the first lease counted its own
        if not hold and store.insight_hooks and len(again.slot_ids) > hit:
            store.insight.served(info.namespace, len(again.slot_ids) - hit, 0)  # fetched
        return again

    async def _fetch_run(self, namespace: Namespace, hashes: Sequence[BlockHash],
                         slot_bytes: int) -> list[bytes]:
        """The leading run of verified remote blocks of exactly ``slot_bytes``, fetched in
        chunks of ``fetch_chunk_bytes``, stopping at the first miss."""
        assert self.remote is not None
        per_chunk = max(1, self.config.fetch_chunk_bytes // slot_bytes)
        run: list[bytes] = []
        for start in range(0, len(hashes), per_chunk):
            for block in await self.remote.get_many(namespace, hashes[start:start + per_chunk]):
                if block is None or len(block) != slot_bytes:
                    return run
                run.append(block)
        return run

    # -- observability -----------------------------------------------------------------------

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Export the directory, publisher, remote tier and link counters in ``registry``."""
        registry.register(_LinkCollector(self))

    def check_integrity(self) -> None:
        """The publisher's and directory's invariants, and the queue's byte accounting."""
        self.publisher.check_integrity()
        self.directory.check_integrity()
        assert self._queued_bytes == sum(e.nbytes for e in self._queue), (
            "remote queue byte count disagrees with its blocks")
        assert self._queued_bytes <= self.config.queue_bytes, "remote queue over its bound"
        assert all(n > 0 for n in self._hbm_refs.values()), "a zero HBM reference kept"


class _LinkCollector:
    """Prometheus view of the link (read at scrape time, no Redis I/O)."""

    def __init__(self, link: ClusterLink) -> None:
        self._link = link

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        link = self._link
        d, p = link.directory.stats, link.publisher.stats
        yield GaugeMetricFamily("tierd_cluster_directory_stale",
                                "1 while Redis cannot be reached (serving locally)",
                                value=float(link.directory.stale))
        counters = [
            ("tierd_cluster_outages", "Times the directory went stale", d.outages),
            ("tierd_cluster_redis_failures", "Redis calls that failed or timed out", d.failures),
            ("tierd_cluster_published_blocks", "Block entries published", d.published_blocks),
            ("tierd_cluster_unpublished_blocks", "Block entries withdrawn",
             d.unpublished_blocks),
            ("tierd_cluster_locates", "Locate calls", d.locates),
            ("tierd_cluster_resyncs", "Full re-publishes after an outage", p.resyncs),
        ]
        remote = link.remote
        if remote is not None:
            r, s = remote.stats, link.stats
            counters += [
                ("tierd_remote_puts", "Blocks put into the remote tier", r.puts),
                ("tierd_remote_put_failures", "Remote puts refused or failed",
                 r.put_failures),
                ("tierd_remote_dropped_puts", "Evicted blocks not shared (queue full)",
                 s.dropped_puts),
                ("tierd_remote_hits", "Remote blocks fetched and verified", r.hits),
                ("tierd_remote_misses", "Remote blocks asked for and not found", r.misses),
                ("tierd_remote_checksum_failures", "Remote blocks that failed verification",
                 r.checksum_failures),
                ("tierd_remote_fetched_blocks", "Remote blocks stored into DRAM by Acquire",
                 s.fetched_blocks),
            ]
            decisions = CounterMetricFamily("tierd_remote_fetch_decisions",
                                            "Fetch-or-recompute decisions", labels=["decision"])
            decisions.add_metric(["fetch"], r.fetch_decisions)
            decisions.add_metric(["recompute"], r.skip_decisions)
            yield decisions
            yield GaugeMetricFamily("tierd_remote_bandwidth_bytes_per_second",
                                    "EWMA of remote fetch throughput", value=r.bandwidth_bps)
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        yield GaugeMetricFamily("tierd_cluster_pending_changes",
                                "Tier changes not yet published", value=link.publisher.pending)
