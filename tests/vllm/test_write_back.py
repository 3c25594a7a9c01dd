"""TierdConnector's write-back saves (``save_policy: write_back``) inside real vLLM 0.33: a
computed block goes to tierd only when vLLM gives its memory to other tokens, copied out
before the step that reuses it writes anything."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")

from harness import BLOCK, Daemon, Engine, make_request, vllm_config  # noqa: E402
from test_connector import PINNED, baseline, expire_first_load  # noqa: E402

pytestmark = pytest.mark.vllm

WRITE_BACK = {"save_policy": "write_back"}

ONE_PROMPT = 8
"""vLLM blocks of an engine that holds one prompt of ``prompt`` at a time (7 blocks with its
sampled tokens, and vLLM's null block)."""


def prompt(seed: int, blocks: int = 6) -> list[int]:
    """``blocks`` full blocks and a 5-token tail, distinct per ``seed``."""
    return [(i * 41 + seed * 113 + 7) % 997 for i in range(blocks * BLOCK + 5)]


def counter(engine: Engine, name: str) -> int:
    return int(engine.worker.worker_counters.data.get(name, 0))


def test_nothing_is_written_while_the_cache_holds_everything(model_dir: str,
                                                             daemon: Daemon) -> None:
    """Two prompts and one again (a local hit) in an engine whose cache holds them all: no
    block is written to tierd, so a second engine finds nothing to load."""
    engine = Engine.start(vllm_config(model_dir, daemon.socket_path, extra=WRITE_BACK))
    other = Engine.start(vllm_config(model_dir, daemon.socket_path))
    try:
        engine.run([make_request("a", prompt(0)), make_request("b", prompt(1))])
        engine.run([make_request("a-again", prompt(0))])
        assert counter(engine, "saved_blocks") == 0
        other.run([make_request("c", prompt(0))])
        assert counter(other, "loaded_blocks") == 0
    finally:
        engine.close()
        other.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_blocks_vllm_reuses_are_written_back_first_and_load_exact(model_dir: str,
                                                                  daemon: Daemon,
                                                                  tp: int) -> None:
    """An engine that holds one prompt at a time: the next prompt takes every block of the
    last one, whose 6 full blocks are written to tierd before they are overwritten (and only
    those). That engine and a fresh one load them back and sample the reference tokens. With
    TP 2 (no stock: a Reserve per step, Commits held for the verdict) on every rank."""
    want = baseline(model_dir, daemon, prompt(0), tp=tp)
    engine = Engine.start(vllm_config(model_dir, daemon.socket_path, extra=WRITE_BACK, tp=tp),
                          num_blocks=ONE_PROMPT)
    fresh = Engine.start(vllm_config(model_dir, daemon.socket_path, tp=tp))
    try:
        assert engine.run([make_request("a", prompt(0))])["a"] == want
        assert counter(engine, "saved_blocks") == 0
        engine.run([make_request("b", prompt(1))])
        assert counter(engine, "saved_blocks") == 6
        assert fresh.run([make_request("c", prompt(0))])["c"] == want
        assert counter(fresh, "loaded_blocks") == 6
        assert engine.run([make_request("a-again", prompt(0))])["a-again"] == want
        assert counter(engine, "loaded_blocks") == 6
        assert counter(engine, "saved_blocks") == 12  # "b"'s blocks, taken by "a-again"
        assert daemon.pinned_blocks() == 0
    finally:
        engine.close()
        fresh.close()


@pytest.mark.parametrize("with_connector", [False, True])
def test_a_reset_with_the_connector_drops_what_vllm_held_unsaved(model_dir: str, daemon: Daemon,
                                                                 with_connector: bool) -> None:
    """vLLM empties its prefix cache between two prompts of an engine that holds one at a
    time: reset with its connector (``reset_connector``, the API's ``reset_external``), the
    first prompt's blocks are forgotten and the second takes them with nothing written; reset
    alone, they are written back as the second takes them."""
    engine = Engine.start(vllm_config(model_dir, daemon.socket_path, extra=WRITE_BACK),
                          num_blocks=ONE_PROMPT)
    try:
        engine.run([make_request("a", prompt(0))])
        assert engine.scheduler.reset_prefix_cache(reset_connector=with_connector)
        engine.run([make_request("b", prompt(1))])
        assert counter(engine, "saved_blocks") == (0 if with_connector else 6)
    finally:
        engine.close()


def test_a_failed_load_then_eviction_stores_only_recomputed_blocks(model_dir: str,
                                                                    daemon: Daemon) -> None:
    """A write-back engine whose load of a stored prefix fails (its pin ran out) recomputes;
    the next prompt takes its blocks, so they are written back: a fresh engine loads the
    longer prompt and samples the reference tokens."""
    prefix = prompt(0)[:6 * BLOCK]
    longer = prefix + [(i * 5 + 3) % 991 for i in range(BLOCK + 3)]
    want = baseline(model_dir, daemon, longer)
    first = Engine.start(vllm_config(model_dir, daemon.socket_path))
    second = Engine.start(vllm_config(model_dir, daemon.socket_path,
                                      extra={**WRITE_BACK, **PINNED}), num_blocks=ONE_PROMPT + 1)
    fresh = Engine.start(vllm_config(model_dir, daemon.socket_path))
    try:
        first.run([make_request("a", prefix + [1])])
        expired = expire_first_load(second)
        assert second.run([make_request("b", longer)])["b"] == want
        assert expired and second.invalid_reported
        second.between = None
        second.run([make_request("filler", prompt(2, blocks=7))])
        assert counter(second, "saved_blocks") >= 1  # the block past the prefix
        assert fresh.run([make_request("c", longer)])["c"] == want
        assert counter(fresh, "loaded_blocks") == 7
    finally:
        first.close()
        second.close()
        fresh.close()


def test_write_back_is_refused_by_an_unknown_policy(model_dir: str, daemon: Daemon) -> None:
    """A misspelt ``save_policy`` is refused at start, naming the policies."""
    with pytest.raises(ValueError, match="write_through"):
        Engine.start(vllm_config(model_dir, daemon.socket_path,
                                 extra={"save_policy": "writeback"}))
