"""The raw-disk baseline the SSD benchmark measures against (``tierd.daemon.ssd.rawdisk``)."""

from __future__ import annotations

from pathlib import Path

from tierd.daemon.ssd.rawdisk import measure_raw_disk


def test_measure_raw_disk(tmp_path: Path) -> None:
    """The raw-disk baseline returns two positive rates and leaves no file behind."""
    write_gbps, read_gbps = measure_raw_disk(tmp_path, 4 << 20)
    assert write_gbps > 0 and read_gbps > 0
    assert list(tmp_path.iterdir()) == []

