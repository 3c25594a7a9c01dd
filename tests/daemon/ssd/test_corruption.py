"""Damaged records in segment files: flipped payload and header bytes, a damaged lz4 payload, a
truncated segment, a header naming another block: each read is a counted miss, never wrong bytes."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash
from store_kit import BLOCK, NS, flip, h, payload, read_back

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES


async def test_corrupt_payload_byte(store: SsdStore) -> None:
    """One flipped payload byte inside a segment: read False, counted, dropped from the index,
    later a plain miss; its neighbour in the segment still reads."""
    for i in range(2):
        await store.write(NS, h(i), payload(i), block_checksum(payload(i)))
    flip(store, h(0), HEADER_BYTES + 1000)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, store.contains(NS, h(0))) == (1, False)
    assert await read_back(store, NS, h(0)) is None
    assert await read_back(store, NS, h(1)) == bytes(payload(1))
    assert (store.checksum_failures, store.used_bytes) == (1, HEADER_BYTES + BLOCK)
    store.check_integrity(disk=True)


async def test_corrupt_header_byte(store: SsdStore) -> None:
    """A flipped header byte fails the header checksum: a counted miss."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    flip(store, h(0), 20)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, len(store), store.used_bytes) == (1, 0, 0)
    store.check_integrity(disk=True)


async def test_corrupt_compressed_payload(tmp_path: Path) -> None:
    """A damaged lz4 payload fails decompression or the checksum: a counted miss."""
    store = SsdStore(tmp_path, 1 << 20, compression="lz4")
    store.open()
    text = memoryview(bytes(range(256)) * (BLOCK // 256))
    entry = await store.write(NS, h(0), text, block_checksum(text))
    assert entry is not None and entry.stored_bytes < BLOCK
    for at in range(HEADER_BYTES + 5, HEADER_BYTES + 40):
        flip(store, h(0), at, 0xFF)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, store.contains(NS, h(0))) == (1, False)
    store.check_integrity(disk=True)
    store.close()


async def test_truncated_segment(store: SsdStore) -> None:
    """A segment cut short under a record: the read is short, a counted miss."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    span = store.locate(NS, h(0))
    assert span is not None
    os.truncate(span.path, span.offset + HEADER_BYTES + BLOCK // 2)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, store.used_bytes) == (1, 0)
    store.check_integrity()


async def test_header_naming_another_block(store: SsdStore) -> None:
    """A record whose header names another hash is never served for this one."""
    for i in range(2):
        await store.write(NS, h(i), payload(i), block_checksum(payload(i)))
    a, b = store.locate(NS, h(0)), store.locate(NS, h(1))
    assert a is not None and b is not None and a.path == b.path
    raw = a.path.read_bytes()
    with open(b.path, "r+b") as f:
        f.seek(b.offset)
        f.write(raw[a.offset:a.offset + a.size])
    assert await read_back(store, NS, h(1)) is None
    assert await read_back(store, NS, h(0)) == bytes(payload(0))
    assert (store.checksum_failures, len(store)) == (1, 1)
    store.check_integrity(disk=True)


async def test_header_that_verifies_but_differs_from_the_index(store: SsdStore) -> None:
    """A header whose checksum verifies but whose bytes are not the ones written (a byte the
    fields leave zero, checksum recomputed) is not the record the index expects: a miss."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    span = store.locate(NS, h(0))
    assert span is not None
    head = bytearray(span.path.read_bytes()[span.offset:span.offset + HEADER_BYTES])
    head[200] = 1
    head[HEADER_BYTES - 8:] = xxhash.xxh3_64_intdigest(bytes(head[:HEADER_BYTES - 8])).to_bytes(
        8, "little")
    with open(span.path, "r+b") as f:
        f.seek(span.offset)
        f.write(head)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, len(store)) == (1, 0)
    store.check_integrity(disk=True)

