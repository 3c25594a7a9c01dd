"""Compaction of segment files: dead segments unlinked, garbage past its fraction copied out,
reads in flight undisturbed, the files never past the footprint under churn."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from store_kit import BLOCK, NS, REC, h, payload, read_back, segments

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES


async def test_dead_segment_unlinked_and_compaction_frees_garbage(tmp_path: Path) -> None:
    """Segments of 4 records, capacity 32: a sealed segment whose records are all removed is
    unlinked at once; when garbage passes 25% of capacity, the next write compacts the segments
    with the most garbage: every live record reads back bit-exact, their garbage is freed, the
    physical bound holds, and a restart finds the same live records."""
    store = SsdStore(tmp_path, 32 * REC, segment_bytes=4 * REC)
    store.open()
    for b in range(6):
        batch = [(NS, h(i), payload(i), block_checksum(payload(i)))
                 for i in range(4 * b, 4 * b + 4)]
        assert all(await store.write_many(batch))
    assert len(segments(tmp_path)) == 6
    for i in range(4):  # segment 0 entirely
        store.remove(NS, h(i))
    assert len(segments(tmp_path)) == 5 and store.physical_bytes == 20 * REC
    for i in (4, 5, 6, 8, 9, 10, 12, 13, 16):  # 3 dead in segments 1 and 2, 2 in 3, 1 in 4
        store.remove(NS, h(i))
    assert store.physical_bytes - store.used_bytes == 9 * REC  # more than 25% of 32
    live = {i for i in range(24) if store.contains(NS, h(i))}
    assert await store.write(NS, h(99), payload(99), block_checksum(payload(99)))
    live.add(99)
    # Segments 1 and 2 (3 dead each) were copied out, leaving 3 <= 25% / 2 of 32 records dead.
    assert store.physical_bytes - store.used_bytes == 3 * REC
    assert store.used_bytes == len(live) * REC
    assert store.physical_bytes <= 32 * REC * 1.25 + 2 * 4 * REC
    for i in sorted(live):
        assert await read_back(store, NS, h(i)) == bytes(payload(i)), i
    store.check_integrity(disk=True)
    store.close()
    again = SsdStore(tmp_path, 32 * REC)
    found = {int.from_bytes(e.block_hash, "big") for e in again.open()}
    assert found == live | {12, 13, 16}  # removed records of a live segment may come back
    assert again.used_bytes == again.physical_bytes == sum(segments(tmp_path).values())
    again.check_integrity(disk=True)
    again.close()


async def test_compaction_does_not_disturb_reads_in_flight(tmp_path: Path) -> None:
    """Reads started before a compaction moves their records complete from the old copy; reads
    after it find the new one; the old segment goes once the reads are done."""
    store = SsdStore(tmp_path, 16 * REC, segment_bytes=4 * REC, garbage_fraction=0.1)
    store.open()
    for b in range(3):
        batch = [(NS, h(i), payload(i), block_checksum(payload(i)))
                 for i in range(4 * b, 4 * b + 4)]
        assert all(await store.write_many(batch))
    for i in (0, 1, 4, 5):
        store.remove(NS, h(i))
    before = store.locate(NS, h(2))
    into = [bytearray(BLOCK) for _ in (2, 3, 6)]
    futures = store.read_many([(NS, h(i), memoryview(b)) for i, b in zip((2, 3, 6), into)])
    assert await store.compact() == 4 * REC
    after = store.locate(NS, h(2))
    assert before is not None and after is not None and before.path != after.path
    assert await asyncio.gather(*futures) == [True, True, True]
    assert [bytes(b) for b in into] == [bytes(payload(i)) for i in (2, 3, 6)]
    for i in (2, 3, 6, 7, 8):
        assert await read_back(store, NS, h(i)) == bytes(payload(i))
    assert not before.path.exists()
    store.check_integrity(disk=True)
    store.close()


async def test_files_never_pass_the_footprint_under_churn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store bounded by a 64-record footprint, 400 writes with random removals (garbage in
    every segment, so compaction copies many of them): after every chunk the writer syncs and
    after every write, the segment files on disk stay within ``footprint_bytes``."""
    from tierd.daemon.ssd import segment

    rec = HEADER_BYTES + BLOCK
    store = SsdStore(tmp_path, footprint_bytes=64 * rec)
    store.open()
    peak = [0]
    real = segment.SegmentWriter._write_chunk

    def measured(writer: segment.SegmentWriter, chunk: list[segment._Item]) -> None:
        real(writer, chunk)
        peak[0] = max(peak[0], sum(segments(tmp_path).values()))

    monkeypatch.setattr(segment.SegmentWriter, "_write_chunk", measured)
    rng = random.Random(7)
    live: list[int] = []
    for i in range(400):
        while live and (store.used_bytes + rec > store.capacity_bytes or rng.random() < 0.3):
            store.remove(NS, h(live.pop(rng.randrange(len(live)))))
        p = payload(i)
        assert await store.write(NS, h(i), p, block_checksum(p)) is not None
        live.append(i)
        peak[0] = max(peak[0], sum(segments(tmp_path).values()))
        store.check_integrity(disk=True)
    assert 0 < peak[0] <= store.footprint_bytes == 64 * rec
    assert store.capacity_bytes == store.full_bytes > 40 * rec
    for i in rng.sample(live, 5):
        assert await read_back(store, NS, h(i)) == bytes(payload(i))
    store.close()

