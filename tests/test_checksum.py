"""The block checksum and its in-place form agree, byte for byte, with the native helpers and
without them."""

from __future__ import annotations

import ctypes
import os

import pytest

from tierd import checksum
from tierd.checksum import block_checksum, checksums_at


@pytest.fixture(params=["native", "python-xxhash"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``checksums_at`` on the native helpers' xxh3 (built at install), then on python-xxhash."""
    if request.param == "native":
        assert checksum._native_xxh3() is not None, "the native helpers are not built"
    else:
        monkeypatch.setattr(checksum, "_native_xxh3", lambda: None)
    return str(request.param)


def test_checksums_at_match_block_checksum(path: str) -> None:
    """Spans of 0, 1, 16 KiB + 3 and 2 MiB bytes (and a None) hash as ``block_checksum`` of
    the same bytes; one flipped byte changes its span's checksum only."""
    sizes = [0, 1, (16 << 10) + 3, 2 << 20]
    buffers = [ctypes.create_string_buffer(os.urandom(n), n) if n else
               ctypes.create_string_buffer(1) for n in sizes]
    spans: list[tuple[int, int] | None] = [(ctypes.addressof(b), n)
                                           for b, n in zip(buffers, sizes)]
    want = [block_checksum(bytes(b)[:n]) for b, n in zip(buffers, sizes)]
    assert checksums_at(spans + [None]) == want + [None]
    buffers[2][100] = bytes([buffers[2].raw[100] ^ 1])
    got = checksums_at(spans)
    assert got[2] != want[2] and got[:2] + got[3:] == want[:2] + want[3:]
