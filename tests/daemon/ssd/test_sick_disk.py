"""A sick disk under the SSD tier: an unusable or already locked directory leaves the store inert
and unhealthy; a failed write degrades it until the next write heals it."""

from __future__ import annotations

from pathlib import Path

from store_kit import BLOCK, NS, h, payload, read_back, segments

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES


async def test_unusable_directory(tmp_path: Path) -> None:
    """A directory path that is a regular file (mkdir fails even as root) or one already locked
    by another store: open returns [], the store is unhealthy and inert, nothing raises."""
    (tmp_path / "file").write_text("not a directory")
    for directory in (tmp_path / "file", tmp_path / "file" / "below"):
        store = SsdStore(directory, 1 << 20)
        assert store.open() == []
        assert store.healthy is False
        assert await store.write(NS, h(0), payload(0), block_checksum(payload(0))) is None
        assert await read_back(store, NS, h(0)) is None
        store.check_integrity(disk=True)
        store.close()
    owner = SsdStore(tmp_path / "ssd", 1 << 20)
    owner.open()
    intruder = SsdStore(tmp_path / "ssd", 1 << 20)
    assert (intruder.open(), intruder.healthy, owner.healthy) == ([], False, True)
    intruder.close()
    owner.close()


async def test_write_error_degrades_then_recovers(store: SsdStore) -> None:
    """A disk error during a write (the new segment's name is taken by a directory) returns
    None, sets healthy False, counts it; the next write goes to the next segment and heals
    the store."""
    blocker = store.directory / "seg-0000000000000000.kvs"
    blocker.mkdir()
    assert await store.write(NS, h(0), payload(0), block_checksum(payload(0))) is None
    assert (store.healthy, store.write_errors, store.used_bytes) == (False, 1, 0)
    store.check_integrity(disk=True)
    assert await store.write(NS, h(1), payload(1), block_checksum(payload(1))) is not None
    assert (store.healthy, store.write_errors) == (True, 1)
    assert segments(store.directory) == {"seg-0000000000000001.kvs": HEADER_BYTES + BLOCK}
    store.check_integrity(disk=True)

