"""``build_node``: a node's parts, built from one ``TierdConfig`` and wired together.

The parts are the slab allocator over the arena, the SSD store, the cluster link (with Redis
configured) and the presence filter (unless the remote tier is on: engines then always ask),
and the ``NodeStore`` that owns the block tables. The link and the filter are the store's tier
listeners, bound to it; the link's metrics join the store's registry. The gRPC edge
(``tierd.daemon.server``) serves what this builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierd.cluster.directory import NodeRecord
from tierd.daemon.cluster_link import ClusterLink, LinkConfig
from tierd.daemon.config import TierdConfig
from tierd.daemon.listeners import TierListener, TierListeners
from tierd.daemon.node import NodeStore
from tierd.daemon.presence import PresenceFilter
from tierd.daemon.slots import SlabAllocator
from tierd.daemon.ssd import SsdStore
from tierd.wire.arena import ShmArena
from tierd.wire.layout import NAMESPACE_LEN


@dataclass(frozen=True, slots=True)
class Node:
    """The parts ``build_node`` made; ``store`` is the one owner of the block tables."""

    store: NodeStore
    allocator: SlabAllocator
    ssd: SsdStore | None
    cluster: ClusterLink | None
    presence: PresenceFilter | None


def build_node(config: TierdConfig, arena: ShmArena) -> Node:
    """Build and wire the node's parts over ``arena`` (created by the caller, who keeps it),
    then open the store: blocks while the SSD store rebuilds its index, and the listeners hear
    of every record found. Nothing is left open if it raises (the presence filter's file is
    removed). Starts no task: the cluster link's publisher starts with the server."""
    allocator = SlabAllocator(config.dram_bytes, config.slab_bytes, config.block_overhead_bytes)
    ssd = (SsdStore(config.ssd_dir, footprint_bytes=config.ssd_bytes,  # headroom included
                    compression=config.ssd_compression, io_threads=config.ssd_io_threads)
           if config.ssd_dir else None)
    cluster = ClusterLink(link_config(config), NAMESPACE_LEN) if config.redis_url else None
    presence = None
    if config.presence_cells and not config.remote_tier:
        presence = PresenceFilter.create(arena, config.presence_cells)
    try:
        listeners: list[TierListener] = [x for x in (cluster, presence) if x is not None]
        listener: TierListener | None = listeners[0] if len(listeners) == 1 else None
        if len(listeners) > 1:
            listener = TierListeners(listeners)
        store = NodeStore(arena, allocator, ssd, config.node_config(), listener=listener)
        if presence is not None:
            presence.bind(store.held_keys)
        if cluster is not None:
            cluster.bind(store, arena)
            cluster.register_metrics(store.metrics.registry)
        store.open()
    except BaseException:
        if presence is not None:
            presence.close()
        raise
    return Node(store, allocator, ssd, cluster, presence)


def link_config(config: TierdConfig) -> LinkConfig:
    """The cluster link's settings (the address is filled in once the listeners are bound)."""
    return LinkConfig(
        redis_url=config.redis_url,
        node=NodeRecord(config.node_id, config.node_address,
                        config.dram_bytes + (config.ssd_bytes if config.ssd_dir else 0)),
        heartbeat_s=config.cluster_heartbeat_seconds, node_ttl_s=config.cluster_node_ttl_seconds,
        block_ttl_s=config.cluster_block_ttl_seconds, remote_tier=config.remote_tier,
        remote_tier_bytes=config.remote_tier_bytes, queue_bytes=config.remote_queue_bytes,
        recompute_tokens_per_second=config.recompute_tokens_per_second)
