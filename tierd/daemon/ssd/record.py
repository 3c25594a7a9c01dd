"""One SSD record: its header, its footprint in a segment, and the payload chosen for it (pure
functions; the segment files that hold records are in ``segment``).

A record is a 512-byte header, then the payload (lz4-compressed where that pays), then zeros up
to the next multiple of 512 bytes (``ALIGN``), so every record and every payload starts 512-byte
aligned in its segment and can be read and written with ``O_DIRECT`` straight from and into a
DRAM slot. The header, all little-endian:

    magic "TKVB" | version u16 | flags u16 (bit 0: lz4) | namespace len u8 | hash len u8 | 2 pad
    | payload len u64 (uncompressed) | stored len u64 (payload bytes on disk, before padding)
    | checksum u64 (``block_checksum`` of the uncompressed payload) | namespace 16 B
    | hash 32 B (zero padded) | zeros up to byte 504 | header checksum u64 (xxh3-64 of 0..503)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Literal

import lz4.block
import xxhash

from tierd.types import BlockHash, Namespace
from tierd.wire.layout import NAMESPACE_LEN

MAGIC = b"TKVB"
VERSION = 2  # 1: one file per block, 128-byte headers
ALIGN = 512  # logical block size: records, payloads and O_DIRECT transfers are multiples of it
HEADER_BYTES = 512
FLAG_LZ4 = 1
HASH_LENS = (16, 32)
_FIELDS = struct.Struct("<4sHHBB2xQQQ16s32s")  # 84 bytes, then zeros, then the header checksum
_HCS_AT = HEADER_BYTES - 8
_AUTO_SAMPLE = 64 << 10  # "auto" compresses a sample this big first; gives up below 10% saved
_AUTO_MIN_SAVING = 0.10

Compression = Literal["off", "lz4", "auto"]


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


def footprint(stored_len: int) -> int:
    """Bytes a record of ``stored_len`` payload bytes takes in its segment: header, payload,
    padding. What it counts against the SSD bound."""
    return HEADER_BYTES + padded(stored_len)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """What a record says about itself; equal to what the index expects, or the record is bad."""

    flags: int
    namespace: Namespace
    block_hash: BlockHash
    payload_len: int  # uncompressed bytes
    stored_len: int  # payload bytes on disk, padding excluded
    checksum: int  # block_checksum of the uncompressed payload
    size: int = field(init=False, repr=False, compare=False)  # footprint(stored_len)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", footprint(self.stored_len))  # read per record per I/O

    def pack_into(self, buf: memoryview) -> None:
        """Write the ``HEADER_BYTES`` header into ``buf`` (exactly that long)."""
        assert len(buf) == HEADER_BYTES, f"a header needs {HEADER_BYTES} bytes, got {len(buf)}"
        body = _FIELDS.pack(MAGIC, VERSION, self.flags, len(self.namespace),
                            len(self.block_hash), self.payload_len, self.stored_len,
                            self.checksum, self.namespace, self.block_hash).ljust(_HCS_AT, b"\0")
        buf[:_HCS_AT] = body
        buf[_HCS_AT:] = xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")

    def pack(self) -> bytes:
        raw = bytearray(HEADER_BYTES)
        self.pack_into(memoryview(raw))
        return bytes(raw)

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> RecordHeader | None:
        """The header at the start of ``raw``; None if short, foreign, of another version, corrupt
        or self-contradictory (a compression flag that disagrees with the lengths)."""
        if len(raw) < HEADER_BYTES:
            return None
        body = raw[:_HCS_AT]
        if xxhash.xxh3_64_intdigest(body) != int.from_bytes(raw[_HCS_AT:HEADER_BYTES], "little"):
            return None
        magic, version, flags, ns_len, hash_len, payload_len, stored_len, checksum, ns, bh = (
            _FIELDS.unpack_from(body))
        if (magic != MAGIC or version != VERSION or ns_len != NAMESPACE_LEN
                or hash_len not in HASH_LENS or not 0 < stored_len <= payload_len
                or bool(flags & FLAG_LZ4) != (stored_len < payload_len)):
            return None
        return RecordHeader(flags, Namespace(ns[:ns_len]), BlockHash(bh[:hash_len]),
                            payload_len, stored_len, checksum)


def choose_payload(payload: memoryview, compression: Compression) -> tuple[int, memoryview | bytes]:
    """(flags, bytes to store): lz4 only if it is strictly smaller (``lz4``) or saves >= 10%
    (``auto``, which first compresses a 64 KiB sample taken from four places in the block, so
    incompressible KV such as raw fp16/bf16 costs little)."""
    if compression == "off":
        return 0, payload
    if compression == "auto" and len(payload) > _AUTO_SAMPLE:
        piece, step = _AUTO_SAMPLE // 4, len(payload) // 4  # spread: layouts are not uniform
        sample = b"".join(payload[i * step : i * step + piece] for i in range(4))
        if len(lz4.block.compress(sample, store_size=False)) > (1 - _AUTO_MIN_SAVING) * len(sample):
            return 0, payload
    packed = lz4.block.compress(payload, store_size=False)
    limit = len(payload) * (1 - _AUTO_MIN_SAVING) if compression == "auto" else len(payload) - 1
    return (FLAG_LZ4, packed) if len(packed) <= limit else (0, payload)


def check_key(namespace: Namespace, block_hash: BlockHash) -> None:
    """ValueError unless the namespace and hash have lengths a header can hold."""
    if len(namespace) != NAMESPACE_LEN or len(block_hash) not in HASH_LENS:
        raise ValueError(f"namespace must be {NAMESPACE_LEN} bytes and block hash 16 or 32 bytes, "
                         f"got {len(namespace)} and {len(block_hash)}")
