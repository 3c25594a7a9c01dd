"""Fixtures of the real-SGLang tests (the harness is ``harness.py``, importable from the tests
of this folder)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest

pytest.importorskip("sglang", reason="needs real SGLang: run `make test-sglang`")
sys.path.insert(0, os.path.dirname(__file__))

from harness import daemon_in  # noqa: E402
from tiny_model import model_dir_in  # noqa: E402

from tierd.bench.tierd_serve import TierdServe  # noqa: E402


@pytest.fixture(scope="session")
def models() -> Iterator[tuple[str, str]]:
    """Two checkpoints of one shape (one config, other weights): "base" and "tuned"."""
    root = tempfile.mkdtemp(prefix="tierd-sglang-")
    yield model_dir_in(root, "base", seed=1), model_dir_in(root, "tuned", seed=2)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def daemon() -> Iterator[TierdServe]:
    """A running daemon (32 MiB DRAM, 64 MiB SSD); stopped and removed after the test."""
    workdir = tempfile.mkdtemp(prefix="tierd-s")
    running = daemon_in(workdir)
    running.start()
    yield running
    running.stop()
    shutil.rmtree(workdir, ignore_errors=True)
