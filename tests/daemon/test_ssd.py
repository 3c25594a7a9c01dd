"""The SSD tier on real files: round trips, the bound, corruption, restart, a sick disk."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierd.checksum import block_checksum
from tierd.daemon.rawdisk import measure_raw_disk
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssdrecord import HEADER_BYTES
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


def record_path(store: SsdStore, ns: Namespace, bh: BlockHash) -> Path:
    return store.directory / f"{ns.hex()}-{bh.hex()}.kvb"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SsdStore]:
    """An open store of 1 MiB over a fresh directory."""
    s = SsdStore(tmp_path / "ssd", 1 << 20)
    assert s.open() == []
    yield s
    s.close()


async def read_back(store: SsdStore, ns: Namespace, bh: BlockHash, size: int = BLOCK) -> bytes | None:
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
    """A write that would pass the bound returns None; after a remove it fits."""
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
    assert sorted(p.name[-8:] for p in tmp_path.iterdir()) == ["0001.kvb", "0002.kvb"]
    store.check_integrity(disk=True)
    store.close()


async def test_corrupt_payload_byte(store: SsdStore) -> None:
    """One flipped payload byte: read False, counted, record deleted, later a plain miss."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    path = record_path(store, NS, h(0))
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 1000)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 1000)
        f.write(bytes([byte[0] ^ 0x40]))
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, path.exists(), store.contains(NS, h(0))) == (1, False, False)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, store.used_bytes) == (1, 0)
    store.check_integrity(disk=True)


async def test_corrupt_compressed_payload(tmp_path: Path) -> None:
    """A damaged lz4 payload fails decompression or the checksum: a counted miss."""
    store = SsdStore(tmp_path, 1 << 20, compression="lz4")
    store.open()
    text = memoryview(bytes(range(256)) * (BLOCK // 256))
    entry = await store.write(NS, h(0), text, block_checksum(text))
    assert entry is not None and entry.stored_bytes < BLOCK
    path = record_path(store, NS, h(0))
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 5 : HEADER_BYTES + 40] = bytes(35)
    path.write_bytes(raw)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, path.exists()) == (1, False)
    store.check_integrity(disk=True)
    store.close()


async def test_truncated_record(store: SsdStore) -> None:
    """A record cut short is detected on read, deleted and counted."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    path = record_path(store, NS, h(0))
    os.truncate(path, HEADER_BYTES + BLOCK // 2)
    assert await read_back(store, NS, h(0)) is None
    assert (store.checksum_failures, path.exists(), store.used_bytes) == (1, False, 0)
    store.check_integrity(disk=True)


async def test_header_naming_another_block(store: SsdStore) -> None:
    """A file whose header names another hash is never served for this one."""
    for i in range(2):
        await store.write(NS, h(i), payload(i), block_checksum(payload(i)))
    record_path(store, NS, h(1)).write_bytes(record_path(store, NS, h(0)).read_bytes())
    assert await read_back(store, NS, h(1)) is None
    assert await read_back(store, NS, h(0)) == bytes(payload(0))
    assert (store.checksum_failures, len(store)) == (1, 1)
    store.check_integrity(disk=True)


async def test_restart_keeps_intact_records_and_drops_torn_ones(tmp_path: Path) -> None:
    """Reopening after a crash finds exactly the intact records, oldest first, deletes a torn
    temp file, a half-written record, a garbage header and a record under another block's name,
    and accounts bytes like the disk."""
    first = SsdStore(tmp_path, 1 << 20)
    first.open()
    for i in range(5):
        p = payload(i, 1000 + i)
        assert await first.write(NS, h(i, 16), p, block_checksum(p)) is not None
    for i in range(5):  # distinct mtimes, i oldest first
        os.utime(record_path(first, NS, h(i, 16)), ns=(10**18 + i, 10**18 + i))
    first.close()
    (tmp_path / f".{NS.hex()}-{h(9).hex()}.kvb.1a2b3c4d.tmp").write_bytes(b"torn")
    half = record_path(first, NS, h(5, 16))
    half.write_bytes(record_path(first, NS, h(0, 16)).read_bytes()[:600])  # cut mid-record
    (tmp_path / f"{NS.hex()}-{h(6).hex()}.kvb").write_bytes(os.urandom(300))
    misnamed = record_path(first, NS, h(7, 16))
    misnamed.write_bytes(record_path(first, NS, h(1, 16)).read_bytes())  # header names h(1)
    (tmp_path / "unrelated.txt").write_text("left alone")

    second = SsdStore(tmp_path, 1 << 20)
    entries = second.open()
    assert [(e.block_hash, e.payload_len) for e in entries] == [(h(i, 16), 1000 + i)
                                                               for i in range(5)]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 6 and files[-1] == "unrelated.txt"
    disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.suffix == ".kvb")
    assert second.used_bytes == disk == sum(HEADER_BYTES + 1000 + i for i in range(5))
    assert second.checksum_failures == 3
    for i in range(5):
        assert await read_back(second, NS, h(i, 16), 1000 + i) == bytes(payload(i, 1000 + i))
    second.check_integrity(disk=True)
    second.close()


def test_restart_after_kill_9(tmp_path: Path) -> None:
    """A real writer process killed with SIGKILL mid-stream: every block it saw acknowledged is
    found again intact, and accounting equals the disk."""
    writer = textwrap.dedent(f"""
        import asyncio, random, sys
        from tierd.checksum import block_checksum
        from tierd.daemon.ssd import SsdStore
        async def main():
            s = SsdStore({str(tmp_path)!r}, 1 << 40)
            s.open()
            for i in range(100000):
                p = memoryview(random.Random(i).randbytes({BLOCK}))
                assert await s.write({bytes(NS)!r}, i.to_bytes(32, "big"), p, block_checksum(p))
                print(i, flush=True)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    acked = [int(proc.stdout.readline()) for _ in range(20)]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert acked == list(range(20))
    store = SsdStore(tmp_path, 1 << 40)
    found = {e.block_hash for e in store.open()}
    assert {h(i) for i in acked} <= found
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    assert store.used_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    for bh in sorted(found):
        assert await_read(store, bh) == bytes(payload(int.from_bytes(bh, "big")))
    assert store.checksum_failures == 0
    store.check_integrity(disk=True)
    store.close()


def await_read(store: SsdStore, bh: BlockHash) -> bytes | None:
    return asyncio.run(read_back(store, NS, bh))


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
    """A disk error during a write (the record's name is taken by a directory) returns None,
    sets healthy False, counts it, leaves no temp file; the next good write heals the store."""
    blocker = record_path(store, NS, h(0))
    blocker.mkdir()
    assert await store.write(NS, h(0), payload(0), block_checksum(payload(0))) is None
    assert (store.healthy, store.write_errors, store.used_bytes) == (False, 1, 0)
    assert sorted(p.name for p in store.directory.iterdir()) == [blocker.name]
    blocker.rmdir()
    store.check_integrity(disk=True)
    assert await store.write(NS, h(1), payload(1), block_checksum(payload(1))) is not None
    assert (store.healthy, store.write_errors) == (True, 1)
    store.check_integrity(disk=True)


async def test_concurrent_writes_reads_and_remove_during_write(store: SsdStore) -> None:
    """Many writes and reads in flight at once; a block removed while being written is not kept;
    a second write of a stored block returns the existing entry."""
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
    (the corrupt record deleted and counted), in request order."""
    for i in range(4):
        assert await store.write(NS, h(i), payload(i), block_checksum(payload(i))) is not None
    path = record_path(store, NS, h(2))
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 7] ^= 0x01
    path.write_bytes(raw)
    keys = [h(0), h(9), h(2), h(1), h(3)]
    into = [bytearray(BLOCK) for _ in keys]
    futures = store.read_many([(NS, k, memoryview(b)) for k, b in zip(keys, into)])
    assert await asyncio.gather(*futures) == [True, False, False, True, True]
    assert [bytes(into[i]) for i in (0, 3, 4)] == [bytes(payload(i)) for i in (0, 1, 3)]
    assert (store.checksum_failures, path.exists(), len(store)) == (1, False, 3)
    store.check_integrity(disk=True)


async def test_read_many_past_the_read_ahead_window(tmp_path: Path) -> None:
    """A batch longer than the read-ahead window (40 records, window 32) reads every record;
    one record grown past its recorded size is caught without an fstat."""
    store = SsdStore(tmp_path, 1 << 20)
    store.open()
    n, size = 40, 4096
    entries = await store.write_many([(NS, h(i), payload(i, size),
                                       block_checksum(payload(i, size))) for i in range(n)])
    assert all(entries)
    with open(record_path(store, NS, h(17)), "ab") as f:
        f.write(b"x")
    into = [bytearray(size) for _ in range(n)]
    ok = await asyncio.gather(*store.read_many([(NS, h(i), memoryview(b))
                                                for i, b in enumerate(into)]))
    assert ok == [i != 17 for i in range(n)]
    assert all(bytes(into[i]) == bytes(payload(i, size)) for i in range(n) if i != 17)
    assert (store.checksum_failures, len(store)) == (1, n - 1)
    store.check_integrity(disk=True)
    store.close()


async def test_read_many_bad_target_starts_nothing(store: SsdStore) -> None:
    """A wrong-sized target anywhere in the batch raises before any read starts."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    good = bytearray(BLOCK)
    with pytest.raises(ValueError, match="exactly one slot"):
        store.read_many([(NS, h(0), memoryview(good)), (NS, h(0), memoryview(bytearray(7)))])
    assert good == bytes(BLOCK)
    store.check_integrity(disk=True)


async def test_write_many_mixed_batch(tmp_path: Path) -> None:
    """One call: new blocks stored, a stored one returns its entry, a repeat within the call,
    a bad checksum, a block past the bound and one whose name is blocked by a directory get
    None; the others are unaffected and accounting matches the disk."""
    store = SsdStore(tmp_path, 5 * (HEADER_BYTES + BLOCK))
    store.open()
    first = await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    record_path(store, NS, h(5)).mkdir()
    blocks = [(NS, h(i), payload(i), block_checksum(payload(i))) for i in (0, 1, 2, 5)]
    blocks.insert(2, (NS, h(1), payload(1), block_checksum(payload(1))))  # repeat of h(1)
    blocks.append((NS, h(3), payload(3), block_checksum(payload(3)) ^ 1))  # bad checksum
    blocks.append((NS, h(4), payload(4), block_checksum(payload(4))))  # past the bound
    got = await store.write_many(blocks)
    assert [e is not None for e in got] == [True, True, False, True, False, False, False]
    assert got[0] == first
    assert (store.checksum_failures, store.write_errors, store.healthy) == (1, 1, False)
    record_path(store, NS, h(5)).rmdir()
    assert sorted(e.block_hash for e in (got[1], got[3]) if e) == [h(1), h(2)]
    assert store.used_bytes == 3 * (HEADER_BYTES + BLOCK)
    for i in (0, 1, 2):
        assert await read_back(store, NS, h(i)) == bytes(payload(i))
    store.check_integrity(disk=True)
    store.close()
