"""A real `tierd serve` process: blocks that reached SSD survive kill -9 and a restart on the same
SSD directory, a torn write is discarded, and SIGTERM shuts down cleanly."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from tierd.checksum import block_checksum

DEMOTE_ALL = ("--ssd-bytes", "4MiB", "--dram-high-watermark", "1e-9",
              "--dram-low-watermark", "1e-9", "--maintain-seconds", "0.05")
"""Every committed block is demoted to SSD by the background maintain pass (every 50 ms)."""


def wait_until(predicate: Any, what: str) -> None:
    """Poll ``predicate`` (a readiness wait, not a timing assertion) for up to 30 s."""
    for _ in range(600):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def test_kill_9_and_restart_finds_ssd_blocks(workdir: str, kit: Any,
                                             serve: Any) -> None:
    """Six blocks demoted to SSD, kill -9, a torn record left at the end of the last segment:
    the restarted daemon finds all six on SSD, they copy out bit-exact, the torn tail is cut
    off, SSD bytes match the disk, and the dead daemon's arena file is removed."""
    hashes = kit.chain(6)
    first, client = serve(workdir, *DEMOTE_ALL)
    with client:
        engine = client.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes) == 6
        arena.close()
        wait_until(lambda: client.lookup(engine.engine_id, hashes) == ["ssd"] * 6,
                   "the maintain pass to demote all six blocks")
    first.send_signal(signal.SIGKILL)
    first.wait()
    old_arena = os.path.join(engine.arena_directory, engine.arena_name)
    assert os.path.exists(old_arena) and os.path.exists(os.path.join(workdir, "tierd.sock"))
    ssd_dir = os.path.join(workdir, "ssd")
    last = max(e.path for e in os.scandir(ssd_dir) if e.name.endswith(".kvs"))
    intact = os.path.getsize(last)
    with open(last, "ab") as f:
        f.write(b"TKVB" + bytes(600))

    second, client = serve(workdir, *DEMOTE_ALL)
    with client:
        engine = client.register_engine(kit.layout)
        assert client.lookup(engine.engine_id, hashes) == ["ssd"] * 6
        arena = kit.attach(engine)
        got = client.acquire(engine.engine_id, hashes)
        assert got.num_blocks == 6
        for key, slot, checksum in zip(hashes, got.slot_ids, got.checksums):
            data = bytes(arena.view(engine.geometry.offset(slot), engine.geometry.slot_bytes))
            assert data == kit.block_bytes(key, 4096) and block_checksum(data) == checksum
        client.release(engine.engine_id, got.lease_id)
        arena.close()
        ssd = client.stats().tiers[2]
    segments = [e for e in os.scandir(ssd_dir) if e.name.endswith(".kvs")]
    assert os.path.getsize(last) == intact and not os.path.exists(old_arena)
    assert (ssd.tier, ssd.used_blocks) == ("ssd", 6)
    assert ssd.used_bytes == sum(e.stat().st_size for e in segments)
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0


def test_sigterm_removes_socket_and_arena(workdir: str, kit: Any,
                                          serve: Any) -> None:
    """SIGTERM: the daemon exits 0 and its socket and arena file are gone."""
    process, client = serve(workdir, *DEMOTE_ALL)
    with client:
        engine = client.register_engine(kit.layout)
    arena_path = os.path.join(engine.arena_directory, engine.arena_name)
    assert os.path.exists(arena_path)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert not os.path.exists(arena_path)
    assert not os.path.exists(os.path.join(workdir, "tierd.sock"))
