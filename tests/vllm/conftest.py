"""Fixtures of the real-vLLM tests (the harness itself is ``harness.py``, importable from the
tests of this folder)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")
sys.path.insert(0, os.path.dirname(__file__))

from harness import Daemon, model_dir_in  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> Iterator[str]:
    """A local model directory holding only a tiny Llama `config.json` (no weights, no
    tokenizer: vLLM's own unit tests configure models the same way)."""
    root = tempfile.mkdtemp(prefix="tierd-vllm-")
    yield model_dir_in(root)
    shutil.rmtree(root, ignore_errors=True)



@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A running daemon; ``@pytest.mark.parametrize("daemon", [...], indirect=True)`` with
    "no-ssd" (DRAM only), "no-ssd-small" (a 4 MiB arena, DRAM only) or "demote-all" (every
    committed block moves to SSD at once)."""
    workdir = tempfile.mkdtemp(prefix="tierd-v")
    mode = getattr(request, "param", "")
    running = Daemon(workdir, ssd=not mode.startswith("no-ssd"), demote_all=mode == "demote-all",
                     dram_bytes=(4 if mode == "no-ssd-small" else 32) << 20)
    running.start()
    yield running
    running.stop()
    shutil.rmtree(workdir, ignore_errors=True)
