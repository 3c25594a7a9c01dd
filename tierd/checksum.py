"""The payload checksum every tier agrees on: xxh3-64 of a block's raw bytes.

Computed when a block is committed (by the engine, or by the daemon for an engine that names the
slots it wrote), stored with the block in every tier, verified by the engine as it copies a block
out of the DRAM arena and by the SSD tier on every read. A block
whose checksum does not verify is a miss, never used.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence

import xxhash

XXHASH_LIBRARY = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
"""python-xxhash's extension (already loaded), for native callers of its xxh3 functions: the same
code as ``block_checksum``, so the same checksums. ctypes releases the GIL for each call."""
_xxh3_at = (getattr(XXHASH_LIBRARY, "XXH3_64bits_dispatch", None)
            or XXHASH_LIBRARY.XXH3_64bits)
_xxh3_at.restype = ctypes.c_uint64
_xxh3_at.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data`` as an unsigned 64-bit int. Releases no GIL; ~10+ GB/s."""
    return xxhash.xxh3_64_intdigest(data)


def checksums_at(spans: Sequence[tuple[int, int] | None]) -> list[int | None]:
    """``block_checksum`` of each ``(address, length)`` span of memory the caller keeps mapped
    (None stays None), without holding the GIL, so other threads (the daemon's event loop) run
    meanwhile and several callers hash in parallel."""
    return [None if span is None else int(_xxh3_at(span[0], span[1])) for span in spans]

