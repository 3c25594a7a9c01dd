"""The SSD tier on real segment files: round trips (raw and lz4), the byte bound, batched writes,
concurrent writes and reads, bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from store_kit import BLOCK, NS, OTHER_NS, h, payload, read_back, segments

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.types import BlockHash, Namespace


async def test_round_trip_uncompressed(store: SsdStore) -> None:
    """Blocks written are read back bit-exact; entries and accounting match the files."""
    for i in range(3):
        p = payload(i)
        entry = await store.write(NS, h(i), p, block_checksum(p))
        assert entry is not None
        assert (entry.payload_len, entry.stored_bytes, entry.checksum) == (
            BLOCK, HEADER_BYTES + BLOCK, block_checksum(p))
    for i in range(3):
        assert await read_back(store, NS, h(i)) == bytes(payload(i))
    assert await read_back(store, OTHER_NS, h(0)) is None  # another namespace: a miss
    assert store.used_bytes == 3 * (HEADER_BYTES + BLOCK) == store.record_bytes(BLOCK) * 3
    assert (store.healthy, store.checksum_failures, store.write_errors) == (True, 0, 0)
    store.check_integrity(disk=True)


@pytest.mark.parametrize("mode", ["lz4", "auto"])
async def test_round_trip_compressed(tmp_path: Path, mode: str) -> None:
    """lz4 shrinks a compressible block and reads back bit-exact; 'auto' stores incompressible
    bytes raw while 'lz4' keeps whatever is strictly smaller."""
    store = SsdStore(tmp_path, 1 << 20, compression=mode)  # type: ignore[arg-type]
    store.open()
    text = memoryview((b"the same prefix, again and again. " * 4000)[:BLOCK])
    entry = await store.write(NS, h(1), text, block_checksum(text))
    assert entry is not None and entry.stored_bytes < BLOCK // 10
    noise = payload(2)
    entry = await store.write(NS, h(2), noise, block_checksum(noise))
    assert entry is not None and entry.stored_bytes == HEADER_BYTES + BLOCK
    assert await read_back(store, NS, h(1)) == bytes(text)
    assert await read_back(store, NS, h(2)) == bytes(noise)
    store.check_integrity(disk=True)
    store.close()


async def test_checksum_mismatch_on_write_refused(store: SsdStore) -> None:
    """A payload that does not match the engine's checksum is never stored."""
    p = payload(0)
    assert await store.write(NS, h(0), p, block_checksum(p) ^ 1) is None
    assert (store.checksum_failures, store.contains(NS, h(0)), store.used_bytes) == (1, False, 0)
    store.check_integrity(disk=True)


async def test_byte_bound_refuses_then_accepts_after_remove(tmp_path: Path) -> None:
    """A write that would pass the bound returns None; after a remove it fits: the removed
    record stays in its segment as garbage until compaction."""
    store = SsdStore(tmp_path, 2 * (HEADER_BYTES + BLOCK))
    store.open()
    for i in range(2):
        assert await store.write(NS, h(i), payload(i), block_checksum(payload(i))) is not None
    assert await store.write(NS, h(2), payload(2), block_checksum(payload(2))) is None
    assert (store.used_bytes, store.healthy, store.write_errors) == (2 * (HEADER_BYTES + BLOCK),
                                                                      True, 0)
    store.remove(NS, h(0))
    store.remove(NS, h(0))  # idempotent
    assert await store.write(NS, h(2), payload(2), block_checksum(payload(2))) is not None
    assert store.used_bytes == 2 * (HEADER_BYTES + BLOCK)
    assert segments(tmp_path) == {"seg-0000000000000000.kvs": 3 * (HEADER_BYTES + BLOCK)}
    assert store.physical_bytes == 3 * (HEADER_BYTES + BLOCK)
    store.check_integrity(disk=True)
    store.close()


async def test_write_many_mixed_batch(tmp_path: Path) -> None:
    """One call: new blocks stored in one segment, a stored one returns its entry, a repeat
    within the call, a bad checksum and a block past the bound get None; accounting matches
    the disk."""
    store = SsdStore(tmp_path, 5 * (HEADER_BYTES + BLOCK))
    store.open()
    first = await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    blocks = [(NS, h(i), payload(i), block_checksum(payload(i))) for i in (0, 1, 2, 5)]
    blocks.insert(2, (NS, h(1), payload(1), block_checksum(payload(1))))  # repeat of h(1)
    blocks.append((NS, h(3), payload(3), block_checksum(payload(3)) ^ 1))  # bad checksum
    blocks.append((NS, h(4), payload(4), block_checksum(payload(4))))  # past the bound
    got = await store.write_many(blocks)
    assert [e is not None for e in got] == [True, True, False, True, True, False, False]
    assert got[0] == first
    assert (store.checksum_failures, store.write_errors, store.healthy) == (1, 0, True)
    assert store.used_bytes == 4 * (HEADER_BYTES + BLOCK) == store.physical_bytes
    for i in (0, 1, 2, 5):
        assert await read_back(store, NS, h(i)) == bytes(payload(i))
    store.check_integrity(disk=True)
    store.close()


async def test_concurrent_writes_reads_and_remove_during_write(store: SsdStore) -> None:
    """Many writes and reads in flight at once; a block removed while being written is not kept
    (its record is garbage); a second write of a stored block returns the existing entry."""
    entries = await asyncio.gather(*(store.write(NS, h(i), payload(i), block_checksum(payload(i)))
                                     for i in range(12)))
    assert all(entries)
    assert await store.write(NS, h(3), payload(3), block_checksum(payload(3))) == entries[3]
    racing = asyncio.ensure_future(store.write(NS, h(50), payload(50), block_checksum(payload(50))))
    await asyncio.sleep(0)
    store.remove(NS, h(50))
    assert await racing is None
    reads = await asyncio.gather(*(read_back(store, NS, h(i)) for i in range(12)))
    assert reads == [bytes(payload(i)) for i in range(12)]
    assert len(store) == 12
    assert store.physical_bytes - store.used_bytes == HEADER_BYTES + BLOCK
    store.check_integrity(disk=True)


async def test_bad_keys_and_targets(store: SsdStore) -> None:
    """Wrong namespace or hash lengths and a wrong-sized read target raise ValueError."""
    for ns, bh in [(Namespace(b"short"), h(0)), (NS, BlockHash(b"x" * 20))]:
        with pytest.raises(ValueError, match="16 or 32 bytes"):
            await store.write(ns, bh, payload(0), block_checksum(payload(0)))
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    with pytest.raises(ValueError, match="exactly one slot"):
        await store.read(NS, h(0), memoryview(bytearray(BLOCK + 1)))
    with pytest.raises(ValueError):
        SsdStore(store.directory, 0)
    store.check_integrity(disk=True)

