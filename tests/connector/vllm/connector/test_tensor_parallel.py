"""Tensor parallelism 2 through the fake vLLM: a hit pinned under every rank until the merged
report, and a load failed on one rank stored on none."""

from __future__ import annotations

from typing import Any

import torch
from fake_vllm import FakeRequest, lose_blocks, prompt, usage


def test_tp2_hit_is_pinned_on_every_rank_until_both_workers_report(sock: str,
                                                                   engines: Any) -> None:
    """TP 2: the hit is pinned under both ranks' layouts until the merged report unpins it."""
    a, b = engines(0, tp=2), engines(20, tp=2, order="LBNHC")
    a.prefill(FakeRequest("a", prompt(100)))
    assert a.counters() == (0, 0, 12, 0, 0) and usage(sock) == (12, 0)
    pinned: list[int] = []
    assert b.prefill(FakeRequest("b", prompt(100)),
                     before_forward=lambda: pinned.append(usage(sock)[1])) == (96, set())
    assert pinned == [12] and usage(sock) == (12, 0)
    assert b.counters() == (12, 0, 0, 0, 0)
    for rank in (0, 1):
        for block_a, block_b in zip(a.tables["a"], b.tables["b"]):
            assert torch.equal(a.block(block_a, rank), b.block(block_b, rank))
    assert not torch.equal(b.block(20, 0), b.block(20, 1))


def test_tp2_failed_load_on_one_rank_is_stored_on_no_rank(sock: str, engines: Any,
                                                          monkeypatch: Any) -> None:
    """TP 2, rank 0's load misses from block 3: no rank stores X's blocks computed on top."""
    a, b = engines(0, tp=2), engines(20, tp=2)
    a.prefill(FakeRequest("a", prompt(96) + [1]))
    x = FakeRequest("x", prompt(96) + prompt(35, salt=1))
    lose_blocks(b, 0, 3, monkeypatch)
    external, errors = b.prefill(x)
    assert external == 96 and errors == set(b.tables["x"][3:6])
    assert b.counters() == (3 + 6, 3, 0, 0, 2 + 2) and usage(sock) == (12, 0)

