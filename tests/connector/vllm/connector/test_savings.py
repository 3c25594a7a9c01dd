"""Savings through the fake vLLM: a hit the scheduler pins and a worker then loads under that pin
counts its tokens once in the daemon's savings (the pin is a hold; its release reports them)."""

from __future__ import annotations

from typing import Any

from fake_vllm import FakeRequest, prompt, usage

from tierd.wire.client import TierdClient


def _served(sock: str) -> list[tuple[str, int]]:
    """The daemon's savings rows, once the scheduler sides' calls have landed (``usage`` waits
    for them: the pin's release reports what the workers loaded)."""
    usage(sock)
    with TierdClient(socket_path=sock, timeout=10.0) as client:
        return [(r.tier, r.tokens) for r in client.stats().savings]


def test_a_loaded_hit_counts_once(sock: str, engines: Any) -> None:
    """A saves 6 blocks (nothing served); B's 100-token prompt loads them (96 tokens): 96 DRAM
    tokens served, once."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    assert _served(sock) == []
    assert b.prefill(FakeRequest("b", prompt(100))) == (96, set())
    assert b.counters()[0] == 6
    assert _served(sock) == [("dram", 96)]


def test_workers_report_the_measured_prefill_speed(sock: str, engines: Any) -> None:
    """A 300-token prefill is timed, its forward pass included (3 layers of 50 ms, and no load:
    vLLM calls start_load_kv after the forward pass), so its worker reports at most 2,000
    tokens a second, and B's later load is counted at that reported speed, not the planner's
    figure; a 100-token prefill alone is too short to be timed (the planner's figure stays)."""
    a, b = engines(0), engines(40)
    a.prefill(FakeRequest("a", prompt(100)))
    b.prefill(FakeRequest("b", prompt(100)))
    usage(sock)
    with TierdClient(socket_path=sock, timeout=10.0) as client:
        assert [r.speed_source for r in client.stats().savings] == ["planner"]
    a.layer_seconds = 0.05
    a.prefill(FakeRequest("long", prompt(300, salt=3)))
    b.prefill(FakeRequest("b2", prompt(100)))
    usage(sock)
    with TierdClient(socket_path=sock, timeout=10.0) as client:
        rows = client.stats().savings
    assert [(r.tier, r.speed_source) for r in rows] == [("dram", "reported")]
    assert 0 < rows[0].tokens_per_second <= 300 / 0.15 and rows[0].tokens == 192
