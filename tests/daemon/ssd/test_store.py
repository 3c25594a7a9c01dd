"""The SSD tier on real segment files: round trips, the bound, coalesced reads, compaction,
corruption, restart after a real SIGKILL, a sick disk."""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.index import batches
from tierd.daemon.ssd.rawdisk import measure_raw_disk
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.types import BlockHash, Namespace

REPO = Path(__file__).resolve().parents[2]
NS = Namespace(b"N" * 16)
OTHER_NS = Namespace(b"O" * 16)
BLOCK = 64 * 1024


def h(i: int, size: int = 32) -> BlockHash:
    return BlockHash(i.to_bytes(size, "big"))


def payload(i: int, size: int = BLOCK) -> memoryview:
    """Incompressible bytes, a different block for each i."""
    return memoryview(random.Random(i).randbytes(size))


def flip(store: SsdStore, bh: BlockHash, at: int, mask: int = 0x40) -> None:
    """Flip bits of the byte ``at`` bytes into the block's record, in its segment file."""
    span = store.locate(NS, bh)
    assert span is not None and at < span.size
    with open(span.path, "r+b") as f:
        f.seek(span.offset + at)
        byte = f.read(1)
        f.seek(span.offset + at)
        f.write(bytes([byte[0] ^ mask]))


def segments(directory: Path) -> dict[str, int]:
    """Segment file name -> size."""
    return {p.name: p.stat().st_size for p in sorted(directory.glob("seg-*.kvs")) if p.is_file()}


def aligned(nbytes: int) -> memoryview:
    """Page-aligned writable memory, like a DRAM slot (O_DIRECT capable)."""
    return memoryview(mmap.mmap(-1, nbytes))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SsdStore]:
    """An open store of 1 MiB over a fresh directory."""
    s = SsdStore(tmp_path / "ssd", 1 << 20)
    assert s.open() == []
    yield s
    s.close()


async def read_back(store: SsdStore, ns: Namespace, bh: BlockHash,
                    size: int = BLOCK) -> bytes | None:
    into = bytearray(size)
    return bytes(into) if await store.read(ns, bh, memoryview(into)) else None


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


async def test_restart_cuts_torn_tail_resyncs_past_garbage_and_keeps_later_duplicate(
        tmp_path: Path) -> None:
    """Reopening cuts the newest segment's torn tail (half a record), skips a garbage header in
    a sealed segment and finds the record after it, keeps a block's later record, and accounts
    bytes like the disk; payloads read back bit-exact."""
    first = SsdStore(tmp_path, 1 << 20, segment_bytes=4 * (HEADER_BYTES + 1024))
    first.open()
    for i in range(5):  # odd sizes: padded records; 4 per segment
        p = payload(i, 1000 + i)
        assert await first.write(NS, h(i, 16), p, block_checksum(p)) is not None
    first.remove(NS, h(0, 16))
    p = payload(0, 1000)
    assert await first.write(NS, h(0, 16), p, block_checksum(p)) is not None  # in segment 1
    span = first.locate(NS, h(1, 16))
    assert span is not None
    record = span.path.read_bytes()[span.offset:span.offset + span.size]
    first.close()
    seg0, seg1 = sorted(tmp_path.glob("seg-*.kvs"))
    with open(seg1, "ab") as f:
        f.write(record[:600])  # a torn write: a valid header, half the payload
    with open(seg0, "ab") as f:
        f.write(os.urandom(HEADER_BYTES) + record)  # garbage header, then block 1 again
    sizes = {p.name: p.stat().st_size for p in (seg0, seg1)}

    second = SsdStore(tmp_path, 1 << 20)
    entries = second.open()
    assert [(e.block_hash, e.payload_len) for e in entries] == [
        (h(i, 16), 1000 + i) for i in (2, 3, 1, 4, 0)]
    assert (second.torn_bytes, second.damaged_bytes) == (600, HEADER_BYTES)
    on_disk = segments(tmp_path)
    assert on_disk == {seg0.name: sizes[seg0.name], seg1.name: sizes[seg1.name] - 600}
    assert second.used_bytes == sum(e.stored_bytes for e in entries) == sum(
        HEADER_BYTES + 1024 for _ in range(5))
    garbage = HEADER_BYTES + 2 * (HEADER_BYTES + 1024)  # the garbage, blocks 0 and 1 superseded
    assert second.physical_bytes == sum(on_disk.values()) == second.used_bytes + garbage
    for i in range(5):
        assert await read_back(second, NS, h(i, 16), 1000 + i) == bytes(payload(i, 1000 + i))
    assert second.checksum_failures == 0
    second.check_integrity(disk=True)
    second.close()


async def test_open_deletes_files_of_the_one_file_per_block_format(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Old records and temporaries named as tierd named them beside a segment: open deletes
    exactly them with one warning of their count and bytes, keeps the segment's block and every
    other file, even one ending in ``.kvb`` or ``.tmp``."""
    first = SsdStore(tmp_path, 1 << 20)
    first.open()
    p = payload(1)
    assert await first.write(NS, h(1), p, block_checksum(p)) is not None
    first.close()
    record = "ab" * 16 + "-" + "cd" * 32 + ".kvb"
    (tmp_path / record).write_bytes(bytes(1000))
    (tmp_path / ("ab" * 16 + "-" + "ef" * 16 + ".kvb")).write_bytes(bytes(2000))
    (tmp_path / f".{record}.1a2b3c4d.tmp").write_bytes(bytes(300))
    others = ["notes.txt", "upload.tmp", ".ef.1a2b3c4d.tmp", "ab" * 48 + ".kvb", "old.kvb"]
    for name in others[:-1]:
        (tmp_path / name).write_text("not ours")
    (tmp_path / "old.kvb").mkdir()  # not a regular file: left alone

    store = SsdStore(tmp_path, 1 << 20)
    with caplog.at_level("WARNING", logger="tierd.daemon.ssd.index"):
        entries = store.open()
    assert [e.block_hash for e in entries] == [h(1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        others + ["seg-0000000000000000.kvs"])
    warnings = [r.getMessage() for r in caplog.records if r.name == "tierd.daemon.ssd.index"]
    assert len(warnings) == 1 and "deleted 3 files (3300 bytes)" in warnings[0]
    assert store.used_bytes == store.physical_bytes == HEADER_BYTES + BLOCK
    assert await read_back(store, NS, h(1)) == bytes(p)
    store.check_integrity(disk=True)
    store.close()


def test_restart_after_sigkill_mid_batch(tmp_path: Path) -> None:
    """A real writer process appending batches of 4 blocks is killed with SIGKILL halfway
    through its third batch's write: every acknowledged block is found intact, the torn record
    is cut off (100 bytes past the batch's second record), and accounting equals the disk."""
    writer = textwrap.dedent(f"""
        import asyncio, os, random, signal
        from tierd.checksum import block_checksum
        from tierd.daemon.ssd import SsdStore
        real, calls = os.pwritev, []
        def pwritev(fd, bufs, offset):
            calls.append(1)
            if len(calls) == 3:  # the third batch: half of it, then a real SIGKILL
                data = b"".join(bytes(b) for b in bufs)
                os.pwrite(fd, data[:len(data) // 2 + 100], offset)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(fd, bufs, offset)
        os.pwritev = pwritev
        async def main():
            s = SsdStore({str(tmp_path)!r}, 1 << 40)
            s.open()
            for b in range(100):
                blocks = []
                for i in range(4 * b, 4 * b + 4):
                    p = memoryview(random.Random(i).randbytes({BLOCK}))
                    blocks.append(({bytes(NS)!r}, i.to_bytes(32, "big"), p, block_checksum(p)))
                assert all(await s.write_many(blocks))
                print(b, flush=True)
        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", writer], cwd=REPO, stdout=subprocess.PIPE,
                          text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["0", "1"]
    store = SsdStore(tmp_path, 1 << 40)
    found = [int.from_bytes(e.block_hash, "big") for e in store.open()]
    assert found == list(range(10))  # 8 acknowledged, 2 whole records of the torn batch
    assert store.torn_bytes == 100
    assert store.used_bytes == store.physical_bytes == sum(segments(tmp_path).values())
    for i in found:
        assert asyncio.run(read_back(store, NS, h(i))) == bytes(payload(i))
    assert store.checksum_failures == 0
    store.check_integrity(disk=True)
    store.close()


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


def test_measure_raw_disk(tmp_path: Path) -> None:
    """The raw-disk baseline returns two positive rates and leaves no file behind."""
    write_gbps, read_gbps = measure_raw_disk(tmp_path, 4 << 20)
    assert write_gbps > 0 and read_gbps > 0
    assert list(tmp_path.iterdir()) == []


async def test_read_many_mixed_batch(store: SsdStore) -> None:
    """One batch: intact blocks read back bit-exact, a missing one and a corrupt one are misses
    (the corrupt record dropped and counted), in request order."""
    for i in range(4):
        assert await store.write(NS, h(i), payload(i), block_checksum(payload(i))) is not None
    flip(store, h(2), HEADER_BYTES + 7, 0x01)
    keys = [h(0), h(9), h(2), h(1), h(3)]
    into = [bytearray(BLOCK) for _ in keys]
    futures = store.read_many([(NS, k, memoryview(b)) for k, b in zip(keys, into)])
    assert await asyncio.gather(*futures) == [True, False, False, True, True]
    assert [bytes(into[i]) for i in (0, 3, 4)] == [bytes(payload(i)) for i in (0, 1, 3)]
    assert (store.checksum_failures, store.contains(NS, h(2)), len(store)) == (1, False, 3)
    store.check_integrity(disk=True)


@pytest.mark.parametrize("target", ["aligned", "bytearray"])
async def test_read_many_coalesces_adjacent_records(tmp_path: Path, target: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """24 records written as one batch and one written later, not adjacent, requested
    shuffled: the batch's records are one run read by one preadv (straight into page-aligned
    slots or into plain buffers), the late one a second; every block bit-exact."""
    store = SsdStore(tmp_path, 4 << 20)
    store.open()
    n = 24  # 1.5 MiB: within RUN_BYTES
    src = aligned(n * BLOCK)
    for i in range(n):
        src[i * BLOCK:(i + 1) * BLOCK] = payload(i)
    blocks = [(NS, h(i), src[i * BLOCK:(i + 1) * BLOCK], block_checksum(payload(i)))
              for i in range(n)]
    assert all(await store.write_many(blocks))
    for i in (n + 1, n):  # n + 1 is never read: n is not adjacent to the batch
        assert await store.write(NS, h(i), payload(i), block_checksum(payload(i)))
    order = list(range(n + 1))
    random.Random(7).shuffle(order)
    dst = aligned((n + 1) * BLOCK)
    into = ([dst[i * BLOCK:(i + 1) * BLOCK] for i in range(n + 1)] if target == "aligned"
            else [memoryview(bytearray(BLOCK)) for _ in range(n + 1)])
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    ok = await asyncio.gather(*store.read_many([(NS, h(i), into[i]) for i in order]))
    monkeypatch.undo()
    assert ok == [True] * (n + 1)
    assert all(bytes(into[i]) == bytes(payload(i)) for i in range(n + 1))
    assert sorted(calls) == [2, 2 * n]  # header + payload per record (64 KiB: no padding)
    store.check_integrity(disk=True)
    store.close()


def test_read_tasks_split_runs_by_bytes_none_empty() -> None:
    """Runs go to at most ``most`` tasks of about ``least`` bytes or more, in order: four full
    runs and a small last one get five tasks (the small one alone, not queued behind a full
    one); 128 equal runs get five of 25-26; tasks are never empty nor more than ``most``."""
    full, small = 2047488, 264192  # 31 and 4 records of 64 KiB
    assert batches(list("abcde"), [full] * 4 + [small], 2 << 20, 8) == [
        ["a"], ["b"], ["c"], ["d"], ["e"]]
    assert [len(t) for t in batches(list(range(128)), [66048] * 128, 2 << 20, 8)] == [
        26, 26, 25, 26, 25]
    assert batches(list(range(8)), [1] * 8, 1, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert batches([1, 2, 3], [1, 1, 10], 1, 2) == [[1, 2], [3]]
    assert batches([1], [5], 100, 8) == [[1]] and batches([], [], 100, 8) == []


async def test_read_many_bad_target_starts_nothing(store: SsdStore) -> None:
    """A wrong-sized target anywhere in the batch raises before any read starts."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    good = bytearray(BLOCK)
    with pytest.raises(ValueError, match="exactly one slot"):
        store.read_many([(NS, h(0), memoryview(good)), (NS, h(0), memoryview(bytearray(7)))])
    assert good == bytes(BLOCK)
    store.check_integrity(disk=True)


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


REC = HEADER_BYTES + BLOCK


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
