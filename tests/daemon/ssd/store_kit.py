"""Blocks and records of the SSD tier's tests: keys, payloads, page-aligned memory, reading a
block back, and damaging or measuring the segment files under a store."""

from __future__ import annotations

import mmap
import random
from pathlib import Path

from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.record import HEADER_BYTES
from tierd.types import BlockHash, Namespace

NS = Namespace(b"N" * 16)
OTHER_NS = Namespace(b"O" * 16)
BLOCK = 64 * 1024
REC = HEADER_BYTES + BLOCK
"""One block's record in a segment (64 KiB: no padding)."""


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


async def read_back(store: SsdStore, ns: Namespace, bh: BlockHash,
                    size: int = BLOCK) -> bytes | None:
    """The block's bytes read from ``store``, or None on a miss."""
    into = bytearray(size)
    return bytes(into) if await store.read(ns, bh, memoryview(into)) else None

