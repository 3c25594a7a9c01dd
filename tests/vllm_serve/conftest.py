"""Fixtures of the real `vllm serve` tests: the models (built once, cached), one `tierd serve`
and four `vllm serve` processes for the whole module (each start costs ~1 min on CPU)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: run `make test-vllm-serve`")

from tierd.bench.serve_stack import VllmServe, stack_daemon  # noqa: E402
from tierd.bench.tierd_serve import TierdServe  # noqa: E402
from tierd.bench.tiny_llama import build  # noqa: E402

MODEL_CACHE = os.environ.get("TIERD_TEST_MODELS",
                             os.path.expanduser("~/.cache/tierd/test-models"))


@dataclass
class Stack:
    """``a`` and ``b`` serve model 1, ``c`` model 2 (the same config.json, other weights), all
    under one served name so only the weights tell them apart; ``d`` model 1 with a KV cache of
    48 blocks (preemptions); one daemon for all four."""

    daemon: TierdServe
    a: VllmServe
    b: VllmServe
    c: VllmServe
    d: VllmServe


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """Four vLLM instances started *before* their daemon (they must serve without it); the
    daemon is started by the first test."""
    workdir = tempfile.mkdtemp(prefix="tierd-vs-")
    first = build(MODEL_CACHE, "tiny-llama-v2-seed0", seed=0)
    second = build(MODEL_CACHE, "tiny-llama-v2-seed1", seed=1)
    daemon = stack_daemon(workdir)
    sock = daemon.socket_path
    servers = [VllmServe(sys.executable, workdir, model, "tiny", engine, sock)
               for model, engine in ((first, "a"), (first, "b"), (second, "c"))]
    servers.append(VllmServe(sys.executable, workdir, first, "tiny", "d", sock,
                             max_model_len=1280, kv_blocks=48))
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield Stack(daemon, *servers)
    finally:
        for server in servers:
            server.stop()
        daemon.stop()
        if os.environ.get("TIERD_KEEP_LOGS") is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir}")
