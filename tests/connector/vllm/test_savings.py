"""Savings through the fake vLLM: a hit the scheduler pins and a worker then loads counts its
tokens once in the daemon's savings (the scheduler's pin is a hold)."""

from __future__ import annotations

from typing import Any

from fake_vllm import FakeRequest, prompt

from tierd.daemon.client import TierdClient


def _served(sock: str) -> list[tuple[str, int]]:
    with TierdClient(socket_path=sock, timeout=10.0) as client:
        return [(r.tier, r.tokens) for r in client.stats().savings]


def test_a_loaded_hit_counts_once(sock: str, engines: Any) -> None:
    """A saves 6 blocks (nothing served); B's 100-token prompt loads them (96 tokens): 96 DRAM
    tokens served, not 192 (scheduler pin and worker acquire)."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    assert _served(sock) == []
    assert b.prefill(FakeRequest("b", prompt(100))) == (96, set())
    assert b.counters()[0] == 6
    assert _served(sock) == [("dram", 96)]
