"""The start-up scan on real directories: files it must not trust (symlinks, hard links, other
owners, non-regular files), damage in sealed segments, the newest segment's torn tail, segment
ids at the top of their range."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.daemon.ssd.segment import segment_id
from tierd.types import BlockHash, Namespace

NS = Namespace(b"N" * 16)
BLOCK = 4096
REC = HEADER_BYTES + BLOCK


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def payload(i: int) -> memoryview:
    return memoryview(random.Random(i).randbytes(BLOCK))


async def fill(directory: Path, ids: range, *, segment_bytes: int = 1 << 20) -> None:
    """A store over ``directory`` that writes the blocks ``ids`` one batch at a time, closed."""
    store = SsdStore(directory, 1 << 30, segment_bytes=segment_bytes)
    store.open()
    for i in ids:
        assert await store.write(NS, h(i), payload(i), block_checksum(payload(i))) is not None
    store.check_integrity(disk=True)
    store.close()


async def read_all(store: SsdStore, ids: range | list[int]) -> dict[int, bool]:
    """Per block id, whether it reads back bit-exact."""
    out = {}
    for i in ids:
        into = bytearray(BLOCK)
        out[i] = await store.read(NS, h(i), memoryview(into)) and bytes(into) == bytes(payload(i))
    return out


def flip_bit(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def test_symlink_and_hard_link_named_like_segments_leave_their_targets_intact(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A symlink and a hard link to files outside the directory, named like the next segments:
    the restart skips each with one warning, never truncates or removes them, and the outside
    files stay byte-identical; the real segment's blocks are all found."""
    ssd = tmp_path / "ssd"
    await fill(ssd, range(3))
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"not a segment, " * 1000)
    linked = tmp_path / "linked.bin"
    linked.write_bytes(os.urandom(3 * REC))
    before = (outside.read_bytes(), linked.read_bytes())
    (ssd / "seg-0000000000000001.kvs").symlink_to(outside)
    os.link(linked, ssd / "seg-0000000000000002.kvs")

    store = SsdStore(ssd, 1 << 30)
    with caplog.at_level("WARNING", logger="tierd.daemon.ssd.scan"):
        entries = store.open()
    assert [e.block_hash for e in entries] == [h(0), h(1), h(2)]
    warnings = [r.getMessage() for r in caplog.records if r.name == "tierd.daemon.ssd.scan"]
    assert len(warnings) == 2
    assert "seg-0000000000000001.kvs (a symlink)" in warnings[0]
    assert "seg-0000000000000002.kvs (2 hard links" in warnings[1]
    assert (store.skipped_files, store.torn_bytes, store.damaged_bytes) == (2, 0, 0)
    assert await read_all(store, range(3)) == {0: True, 1: True, 2: True}
    p = payload(3)
    assert await store.write(NS, h(3), p, block_checksum(p)) is not None  # in a fresh segment
    store.check_integrity(disk=True)
    store.close()
    assert (outside.read_bytes(), linked.read_bytes()) == before
    assert names(ssd) == [f"seg-000000000000000{i}.kvs" for i in range(4)]
    assert (ssd / "seg-0000000000000001.kvs").is_symlink()


async def test_non_regular_and_foreign_owned_entries_are_skipped(tmp_path: Path) -> None:
    """A directory, a FIFO and a file of another uid named like segments are skipped and left
    as they were (the FIFO never blocks the scan); the daemon's own segment is found."""
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    ssd = tmp_path / "ssd"
    await fill(ssd, range(2))
    (ssd / "seg-0000000000000005.kvs").mkdir()
    os.mkfifo(ssd / "seg-0000000000000006.kvs")
    foreign = ssd / "seg-0000000000000007.kvs"
    foreign.write_bytes(os.urandom(REC))
    content = foreign.read_bytes()
    os.chown(foreign, os.geteuid() + 4242, -1)

    store = SsdStore(ssd, 1 << 30)
    assert [e.block_hash for e in store.open()] == [h(0), h(1)]
    assert store.skipped_files == 3
    assert foreign.read_bytes() == content and foreign.stat().st_uid == os.geteuid() + 4242
    p = payload(9)
    assert await store.write(NS, h(9), p, block_checksum(p)) is not None
    span = store.locate(NS, h(9))
    assert span is not None and span.path.name == "seg-0000000000000008.kvs"
    store.check_integrity(disk=True)
    store.close()


@pytest.mark.parametrize("damaged", [0, 57, 199])
async def test_bit_flip_in_a_sealed_segment_loses_only_that_record(
        tmp_path: Path, damaged: int) -> None:
    """One bit flipped in the header of record #k of a sealed segment of 200 records (the first,
    one in the middle, the last): after a restart the other 199 and the newer segment's block
    read back bit-exact, the segment is not truncated, its damage counts as garbage."""
    await fill(tmp_path, range(201), segment_bytes=200 * REC)  # 200 in segment 0, 1 in segment 1
    seg0 = tmp_path / "seg-0000000000000000.kvs"
    size = seg0.stat().st_size
    flip_bit(seg0, damaged * REC + 40)  # in the header's namespace: it no longer verifies

    store = SsdStore(tmp_path, 1 << 30)
    entries = store.open()
    kept = [i for i in range(201) if i != damaged]
    assert [e.block_hash for e in entries] == [h(i) for i in kept]
    assert seg0.stat().st_size == size
    assert (store.torn_bytes, store.damaged_bytes) == (0, REC)
    assert store.physical_bytes - store.used_bytes == REC
    assert await read_all(store, kept) == {i: True for i in kept}
    assert store.checksum_failures == 0
    store.check_integrity(disk=True)
    store.close()


async def test_damage_spanning_records_resyncs_on_the_next_header(tmp_path: Path) -> None:
    """Zeros over two and a half records in the middle of a sealed segment: the three records
    touched are lost, every record after them is kept."""
    await fill(tmp_path, range(21), segment_bytes=20 * REC)
    seg0 = tmp_path / "seg-0000000000000000.kvs"
    with open(seg0, "r+b") as f:
        f.seek(5 * REC)
        f.write(bytes(2 * REC + REC // 2))
    store = SsdStore(tmp_path, 1 << 30)
    found = [int.from_bytes(e.block_hash, "big") for e in store.open()]
    assert found == [i for i in range(21) if i not in (5, 6, 7)]
    assert store.damaged_bytes == 3 * REC
    reads = await read_all(store, found)
    assert reads == {i: True for i in found}
    store.check_integrity(disk=True)
    store.close()


async def test_torn_tail_is_cut_only_in_the_newest_segment(tmp_path: Path) -> None:
    """Half a record appended to a sealed segment and to the newest one: the restart cuts only
    the newest one's tail; the sealed one keeps its bytes (garbage) and every record."""
    await fill(tmp_path, range(6), segment_bytes=3 * REC)
    seg0, seg1 = sorted(tmp_path.glob("seg-*.kvs"))
    record = seg0.read_bytes()[:REC]
    for seg in (seg0, seg1):
        with open(seg, "ab") as f:
            f.write(record[:REC // 2])
    sizes = [seg0.stat().st_size, seg1.stat().st_size]
    store = SsdStore(tmp_path, 1 << 30)
    assert len(store.open()) == 6
    assert [seg0.stat().st_size, seg1.stat().st_size] == [sizes[0], sizes[1] - REC // 2]
    assert (store.torn_bytes, store.damaged_bytes) == (REC // 2, REC // 2)
    store.check_integrity(disk=True)
    store.close()


async def test_segment_ids_at_the_top_are_renumbered_and_every_file_found(
        tmp_path: Path) -> None:
    """Segments named seg-ffffffffffffffff.kvs and (an older version's overflow)
    seg-10000000000000000.kvs: the restart renumbers them from 0 in order and finds every block;
    a 17-digit spelling of id 0 is not a segment (left alone); the store writes on, and a second
    restart finds everything again."""
    await fill(tmp_path, range(4), segment_bytes=2 * REC)  # segments 0 and 1
    seg0, seg1 = sorted(tmp_path.glob("seg-*.kvs"))
    seg0.rename(tmp_path / "seg-ffffffffffffffff.kvs")
    seg1.rename(tmp_path / "seg-10000000000000000.kvs")
    (tmp_path / "seg-00000000000000000.kvs").write_bytes(b"a 17-digit spelling of id 0")
    assert segment_id("seg-00000000000000000.kvs") is None

    store = SsdStore(tmp_path, 1 << 30, segment_bytes=2 * REC)
    assert [e.block_hash for e in store.open()] == [h(i) for i in range(4)]
    assert names(tmp_path) == sorted(["seg-0000000000000000.kvs", "seg-0000000000000001.kvs",
                                      "seg-00000000000000000.kvs"])
    p = payload(4)
    assert await store.write(NS, h(4), p, block_checksum(p)) is not None
    span = store.locate(NS, h(4))
    assert span is not None and span.path.name == "seg-0000000000000002.kvs"
    store.check_integrity(disk=True)
    store.close()
    again = SsdStore(tmp_path, 1 << 30)
    assert [e.block_hash for e in again.open()] == [h(i) for i in range(5)]
    assert await read_all(again, range(5)) == {i: True for i in range(5)}
    again.check_integrity(disk=True)
    again.close()
