"""Fixtures of the fake-vLLM adapter tests (the fake engine is ``fake_vllm.py``, importable from
the tests of this folder): a real daemon, its socket, a factory of fake vLLM instances, and
every scenario run twice, through the host copies and through the CUDA path's logic."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tierd.connector.vllm.connector.worker import WorkerSide

sys.path.insert(0, os.path.dirname(__file__))  # the tests of this folder import fake_vllm

from fake_vllm import FakeVllm, usage  # noqa: E402


@pytest.fixture(autouse=True, params=["host", "device"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every scenario twice: with the host copies, and through the CUDA path's
    ``DeviceTransfer`` logic (no-op streams on these CPU tensors)."""
    if request.param == "device":
        monkeypatch.setattr(WorkerSide, "__init__",
                            functools.partialmethod(WorkerSide.__init__, device_path=True))
    return str(request.param)


@pytest.fixture
def daemon(make_daemon: Any) -> Any:
    return make_daemon()


@pytest.fixture
def sock(daemon: Any) -> str:
    return str(daemon.config.socket_path)


@pytest.fixture
def engines(sock: str) -> Iterator[Callable[..., FakeVllm]]:
    """Factory of FakeVllm instances on the daemon; at teardown no block may still be pinned,
    then all shut down."""
    made: list[FakeVllm] = []

    def make(first_block: int, **kwargs: Any) -> FakeVllm:
        made.append(FakeVllm(sock, first_block, **kwargs))
        return made[-1]

    yield make
    try:
        assert usage(sock)[1] == 0, "a pin outlived its scenario"
    finally:
        for engine in made:
            engine.close()

