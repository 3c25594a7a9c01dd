"""Fixtures of the SSD tier's tests (their helpers are ``store_kit.py``, importable from the
tests of this folder)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierd.daemon.ssd import SsdStore

sys.path.insert(0, os.path.dirname(__file__))  # the tests of this folder import store_kit


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SsdStore]:
    """An open store of 1 MiB over a fresh directory."""
    s = SsdStore(tmp_path / "ssd", 1 << 20)
    assert s.open() == []
    yield s
    s.close()
