"""Reopening an SSD directory: a torn tail cut, garbage skipped, files of the old one-file-per-block
format deleted, and a restart after a real SIGKILL in the middle of a batch."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_kit import BLOCK, NS, h, payload, read_back, segments

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES

REPO = Path(__file__).resolve().parents[3]


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

