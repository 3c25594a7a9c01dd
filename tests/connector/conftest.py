"""Fixtures of the connector's daemon tests: a real daemon (shared-memory arena in the test's
directory, real SSD directory) on a temporary Unix socket, run in-process by
``tierd.commands.demo.EmbeddedDaemon``, and a tiny reference model."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tierd.commands.demo import EmbeddedDaemon
from tierd.connector.reference.model import LlamaModel, ModelConfig
from tierd.daemon.config import TierdConfig

TINY_E2E = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, max_position=1024)
"""32 KiB KV blocks of 16 tokens (fp32)."""


def daemon_config(workdir: str, **overrides: Any) -> TierdConfig:
    """A 16 MiB arena of 256 KiB slabs (8 blocks each) in ``workdir``, a 4 MiB SSD tier, no
    background maintenance, watermarks so low that one ``maintain`` demotes every block."""
    values: dict[str, Any] = dict(
        socket_path=os.path.join(workdir, "tierd.sock"), dram_bytes=16 << 20,
        slab_bytes=256 << 10, arena_directory=workdir, prefault=False,
        ssd_dir=os.path.join(workdir, "ssd"), ssd_bytes=4 << 20, ssd_io_threads=2,
        maintain_seconds=3600.0, lease_seconds=30.0, dram_high_watermark=1e-9,
        dram_low_watermark=1e-9, log_level="WARNING")
    values.update(overrides)
    return TierdConfig(**values)


@pytest.fixture
def workdir() -> Iterator[str]:
    """A short directory under /tmp (a Unix socket path must stay under 108 bytes)."""
    path = tempfile.mkdtemp(prefix="tierd-c")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_daemon(workdir: str) -> Iterator[Any]:
    """Factory ``make_daemon(**config overrides)``: each daemon is integrity-checked and stopped
    at teardown."""
    started: list[EmbeddedDaemon] = []

    def make(**overrides: Any) -> EmbeddedDaemon:
        daemon = EmbeddedDaemon(daemon_config(workdir, **overrides)).start()
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        try:
            if daemon.daemon is not None:
                daemon.check_integrity()
        finally:
            daemon.stop()


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    return LlamaModel(TINY_E2E)
