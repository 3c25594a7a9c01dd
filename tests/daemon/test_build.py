"""build_node wires a node from one TierdConfig: a real arena, SSD directory and presence
filter; the store is opened and its listener is the filter."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from node_rig import LAYOUT, payload  # noqa: E402

from tierd.checksum import block_checksum
from tierd.daemon.arena import OwnedArena
from tierd.daemon.build import build_node
from tierd.daemon.config import TierdConfig
from tierd.types import BlockHash, make_key


def test_build_node_opens_the_store_with_the_filter_as_its_listener(tmp_path: Path) -> None:
    """With an SSD dir and 1024 presence cells and no Redis: the store serves SSD, a committed
    block shows in the presence filter, there is no cluster link; the node's parts close."""
    config = TierdConfig(socket_path="", tcp_port=0, token_file="t", dram_bytes=1 << 20,
                         slab_bytes=64 << 10, prefault=False, ssd_dir=str(tmp_path / "ssd"),
                         ssd_bytes=1 << 20, presence_cells=1024)
    arena = OwnedArena.create(f"tierd-test-{os.getpid()}-{secrets.token_hex(4)}", 1 << 20,
                            prefault=False)
    node = build_node(config, arena)
    try:
        assert node.cluster is None and node.presence is not None and node.ssd is not None
        assert node.ssd.healthy and node.store.stats().ssd_healthy
        engine = node.store.register_engine("default", LAYOUT, "eng")
        block = BlockHash(bytes(32))
        reserved = node.store.reserve(engine.engine_id, [block])
        slot = reserved.slot_ids[0]
        assert slot is not None
        arena.view(engine.geometry.offset(slot), LAYOUT.block_bytes)[:] = payload(block)
        assert node.store.commit(reserved.lease_id, [block_checksum(payload(block))]) == 1
        assert node.presence.may_hold(make_key(engine.namespace, block))
        node.store.check_integrity()
    finally:
        if node.presence is not None:
            node.presence.close()
        if node.ssd is not None:
            node.ssd.close()
        arena.close()
        arena.unlink()
