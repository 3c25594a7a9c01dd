"""Suite-wide fixtures and markers. Area fixtures live in each test folder's own conftest."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA; skip them, with the reason, on a CPU-only machine."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Child processes a test starts (e.g. `tierd serve`): any still running is killed at
    teardown, whatever the test's outcome."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()
