"""The payload checksum every tier agrees on: xxh3-64 of a block's raw bytes.

Computed when a block is committed (by the engine, or by the daemon for an engine that names the
slots it wrote), stored with the block in every tier, verified by the engine as it copies a block
out of the DRAM arena and by the SSD tier on every read. A block whose checksum does not verify
is a miss, never used.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import xxhash

from tierd.connector.native.library import shared_library


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data`` as an unsigned 64-bit int (python-xxhash)."""
    return xxhash.xxh3_64_intdigest(data)


def checksums_at(spans: Sequence[tuple[int, int] | None]) -> list[int | None]:
    """``block_checksum`` of each ``(address, length)`` span of memory the caller keeps mapped
    (None stays None), read in place. With the native helpers (``tierd.connector.native``)
    each hash runs without the GIL, so other threads (the daemon's event loop) run meanwhile and
    several callers hash in parallel; without them python-xxhash hashes, holding the GIL for
    short spans."""
    at = _native_xxh3()
    if at is not None:
        return [None if span is None else int(at(span[0], span[1])) for span in spans]
    digest, char = xxhash.xxh3_64_intdigest, ctypes.c_char
    return [None if span is None else digest((char * span[1]).from_address(span[0]))
            for span in spans]


@functools.cache
def _native_xxh3() -> Callable[[int, int], int] | None:
    """The native ``tierd_xxh3_64(address, length)``, or None where it is not built."""
    lib = shared_library()
    if lib is None:
        return None
    fn = lib.tierd_xxh3_64
    fn.restype = ctypes.c_uint64
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return fn
