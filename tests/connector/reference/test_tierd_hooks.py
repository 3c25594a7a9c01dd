"""TierdHooks against a real daemon: write-through, loads from DRAM, corruption, a missing daemon,
a full staging ring, and hot-tier reports."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from tierd.connector.reference.engine import EngineConfig, LLMEngine, Request
from tierd.connector.reference.model import LlamaModel, model_identity
from tierd.connector.reference.tierd_hooks import TierdHooks, TierdHooksConfig, layout_for
from tierd.events import BlockRemoved, BlockStored, KVEvent
from tierd.types import BlockHash
from tierd.wire.arena import ShmArena
from tierd.wire.client import TierdClient

BS = 16


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = torch.randint(0, 512, (n,), generator=gen).tolist()
    return tokens


def hooks_for(socket_path: str, **overrides: Any) -> TierdHooks:
    values: dict[str, Any] = dict(socket_path=socket_path, timeout_seconds=5.0,
                                  save_staging_bytes=2 << 20, load_staging_bytes=1 << 20,
                                  retry_seconds=0.05, retry_max_seconds=0.2)
    values.update(overrides)
    return TierdHooks(TierdHooksConfig(**values))


def run(model: LlamaModel, hooks: TierdHooks | None, tokens: list[int],
        max_tokens: int = 8) -> Request:
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=BS), hooks)
    request = engine.add_request(tokens, max_tokens)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    return request


def test_write_through_then_load_from_dram(tiny_model: LlamaModel, make_daemon: Any) -> None:
    """A 100-token prompt, 8 tokens: 6 full blocks written through; a fresh engine loads all 6
    (96 tokens; the last prompt token is always computed) and generates identical tokens."""
    daemon = make_daemon()
    tokens = prompt(100, seed=1)
    want = run(tiny_model, None, tokens).output_token_ids
    saver = hooks_for(daemon.config.socket_path)
    assert run(tiny_model, saver, tokens).output_token_ids == want
    assert saver.flush()
    assert (saver.stats.saved_blocks, saver.stats.dropped_save_blocks) == (6, 0)
    saver.close()
    loader = hooks_for(daemon.config.socket_path)
    request = run(tiny_model, loader, tokens)
    assert (request.num_loaded_tokens, request.num_failed_load_blocks) == (96, 0)
    assert request.output_token_ids == want
    assert loader.flush()
    # 100 prompt + 7 fed back = 107 tokens: 6 full blocks, all already stored.
    assert (loader.stats.loaded_blocks, loader.stats.saved_blocks) == (6, 0)
    loader.close()
    daemon.check_integrity()


def test_corrupted_arena_slot_is_recomputed(tiny_model: LlamaModel, make_daemon: Any) -> None:
    """A byte flipped in block 2's arena slot after commit: the load keeps blocks 0-1, the
    checksum catches block 2, blocks 2-5 are recomputed and the tokens are identical."""
    daemon = make_daemon()
    tokens = prompt(100, seed=2)
    saver = hooks_for(daemon.config.socket_path)
    want = run(tiny_model, saver, tokens).output_token_ids
    assert saver.flush()
    saver.close()
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS))
    hashes = engine.add_request(tokens, 1).block_hashes
    with TierdClient(socket_path=daemon.config.socket_path) as client:  # same tenant and layout
        handle = client.register_engine(layout_for(engine.kv_cache.spec,
                                                   model_identity(engine.model).model_id))
        got = client.acquire(handle.engine_id, hashes)
        arena = ShmArena.attach(handle.arena_name, directory=handle.arena_directory)
        arena.view(handle.geometry.offset(got.slot_ids[2]) + 100, 1)[0] ^= 0x01
        arena.close()
        client.release(handle.engine_id, got.lease_id)
    loader = hooks_for(daemon.config.socket_path)
    request = run(tiny_model, loader, tokens)
    assert (request.num_loaded_tokens, request.num_failed_load_blocks) == (32, 4)
    assert (loader.stats.checksum_failures, loader.stats.loaded_blocks) == (1, 2)
    assert request.output_token_ids == want
    assert loader.flush()
    # The report made the daemon re-check and drop block 2; the recomputed block 2 was then
    # written through again, so a third engine loads all six blocks with no failure.
    assert loader.stats.corrupt_dropped == 1
    loader.close()
    third = hooks_for(daemon.config.socket_path)
    again = run(tiny_model, third, tokens)
    assert (again.num_loaded_tokens, again.num_failed_load_blocks) == (96, 0)
    assert third.stats.checksum_failures == 0 and again.output_token_ids == want
    third.close()
    daemon.check_integrity()


def test_daemon_absent_then_started(tiny_model: LlamaModel, workdir: str,
                                    make_daemon: Any) -> None:
    """No daemon at start: the engine runs as with NullHooks (identical tokens, nothing looked
    up); the daemon then starts on that socket and the hooks reconnect and write through."""
    socket_path = os.path.join(workdir, "tierd.sock")
    tokens = prompt(70, seed=3)
    want = run(tiny_model, None, tokens).output_token_ids
    hooks = hooks_for(socket_path)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS), hooks)
    assert not hooks.connected
    assert engine.generate([tokens], 8)[0] == want
    assert (hooks.stats.lookups, hooks.stats.saved_blocks) == (0, 0)
    make_daemon()
    assert hooks.wait_connected(timeout=30)
    other = prompt(70, seed=4)
    engine.generate([other], 8)
    assert hooks.flush()
    assert hooks.stats.saved_blocks == 4  # 70 + 7 = 77 tokens: 4 full blocks of the new prompt
    hooks.close()


def test_full_staging_ring_drops_and_counts(tiny_model: LlamaModel, make_daemon: Any) -> None:
    """A one-block staging ring cannot take a 4-block save: the 4 blocks are dropped, counted,
    the tokens unchanged and nothing reaches the daemon."""
    daemon = make_daemon()
    tokens = prompt(70, seed=5)
    want = run(tiny_model, None, tokens).output_token_ids
    hooks = hooks_for(daemon.config.socket_path, save_staging_bytes=32 << 10)
    assert run(tiny_model, hooks, tokens).output_token_ids == want
    assert hooks.flush()
    assert (hooks.stats.dropped_save_blocks, hooks.stats.saved_blocks) == (4, 0)
    hooks.close()


def test_hot_tier_events_reach_the_daemon(tiny_model: LlamaModel, make_daemon: Any) -> None:
    """With block events attached, the daemon's stats show the engine's 4 cached HBM blocks."""
    daemon = make_daemon()
    hooks = hooks_for(daemon.config.socket_path)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS), hooks)
    hooks.attach_block_events(engine.manager.take_events)
    engine.generate([prompt(70, seed=6)], 8)
    assert hooks.flush()
    with TierdClient(socket_path=daemon.config.socket_path) as client:
        engines = client.stats().engines
    assert [e.hbm_blocks for e in engines] == [4]
    hooks.close()


def test_hot_reports_of_several_steps_merge_into_one(tiny_model: LlamaModel,
                                                    make_daemon: Any) -> None:
    """With a long batching window, the hot-tier events of two prompts in a 9-block pool (the
    second evicts blocks of the first) wait until ``flush`` and go as one merged report; the
    daemon then counts exactly the blocks the events leave in the pool."""
    daemon = make_daemon()
    hooks = hooks_for(daemon.config.socket_path, save_batch_s=3600.0)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=9, block_size=BS), hooks)
    seen: list[KVEvent] = []

    def take_events() -> list[KVEvent]:
        events = engine.manager.take_events()
        seen.extend(events)
        return events

    hooks.attach_block_events(take_events)
    engine.generate([prompt(70, seed=10)], 8)
    engine.generate([prompt(100, seed=11)], 8)
    assert hooks.stats.hot_reports == 0
    assert hooks.flush()
    assert (hooks.stats.hot_reports, hooks.stats.save_batches) == (1, 1)
    held: set[BlockHash] = set()
    for event in seen:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
    assert any(isinstance(event, BlockRemoved) for event in seen), "the pool must evict"
    with TierdClient(socket_path=daemon.config.socket_path) as client:
        assert [e.hbm_blocks for e in client.stats().engines] == [len(held)]
    hooks.close()


def test_saves_of_several_steps_share_one_reservation(tiny_model: LlamaModel,
                                                      make_daemon: Any) -> None:
    """With a long batching window, two prompts' 4 + 6 blocks (saved in different steps) wait
    in staging until ``flush``, then go in one Reserve/Commit: 10 blocks stored, 1 batch."""
    daemon = make_daemon()
    hooks = hooks_for(daemon.config.socket_path, save_batch_s=3600.0)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS), hooks)
    engine.generate([prompt(70, seed=7)], 8)
    engine.generate([prompt(100, seed=8)], 8)
    assert (hooks.stats.save_batches, hooks.stats.saved_blocks) == (0, 0)
    assert hooks.flush()
    assert (hooks.stats.save_batches, hooks.stats.saved_blocks) == (1, 10)
    hooks.close()


def test_worker_runs_at_lower_priority(make_daemon: Any, tiny_model: LlamaModel) -> None:
    """The worker thread's niceness is the process's plus ``worker_nice`` (Linux)."""
    daemon = make_daemon()
    hooks = hooks_for(daemon.config.socket_path, worker_nice=7)
    LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS), hooks)
    assert hooks.wait_connected(timeout=30) and hooks._runner is not None
    assert hooks.flush()  # the worker has started and set its niceness
    if sys.platform == "linux":
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, hooks._runner.native_ids[0] or 0) == base + 7
    hooks.close()


def test_lookup_without_load_releases_its_lease(tiny_model: LlamaModel, make_daemon: Any) -> None:
    """A lookup pins the 6 stored blocks of a 100-token prompt under a lease; no load comes
    (as when allocation fails): after step_end the daemon shows 0 pinned blocks."""
    daemon = make_daemon()
    tokens = prompt(100, seed=9)
    saver = hooks_for(daemon.config.socket_path)
    run(tiny_model, saver, tokens)
    assert saver.flush()
    saver.close()
    hooks = hooks_for(daemon.config.socket_path)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS), hooks)
    request = engine.add_request(tokens, 1)
    with TierdClient(socket_path=daemon.config.socket_path) as client:
        def pinned() -> int:
            return next(t.pinned_blocks for t in client.stats().tiers if t.tier == "dram")

        assert hooks.lookup(request) == 6
        assert pinned() == 6
        hooks.step_end()
        assert hooks.flush()
        assert pinned() == 0
    hooks.close()


def test_certain_misses_skip_the_round_trip_and_are_still_counted(
        tiny_model: LlamaModel, make_daemon: Any) -> None:
    """A chain the daemon's presence filter says it does not hold is looked up with no Acquire;
    the node counts its tokens as queried (with the next Reserve). A stored chain still loads."""
    daemon = make_daemon()
    tokens = prompt(100, seed=11)
    saver = hooks_for(daemon.config.socket_path)
    with TierdClient(socket_path=daemon.config.socket_path) as client:
        before = client.stats()
        request = run(tiny_model, saver, tokens)
        assert saver.flush()
        after = client.stats()
    assert (saver.stats.lookups, saver.stats.filtered_lookups) == (1, 1)
    assert request.num_loaded_tokens == 0 and saver.stats.saved_blocks == 6
    # 100 prompt tokens, none hot: the 6 full blocks (96 tokens) were queried, none hit.
    assert after.query_tokens - before.query_tokens == 96
    assert after.hit_tokens == before.hit_tokens
    saver.close()
    loader = hooks_for(daemon.config.socket_path)
    again = run(tiny_model, loader, tokens)
    assert (loader.stats.filtered_lookups, again.num_loaded_tokens) == (0, 96)
    loader.close()


def test_two_models_of_one_shape_never_share(tiny_model: LlamaModel, make_daemon: Any) -> None:
    """A fine-tune (same config, other weights) on the daemon that holds the base model's blocks
    of the same prompt loads none of them and generates its own tokens; the base model still
    loads all 6. ``tierd stats`` counts each model's blocks apart, and the operator's
    ``model_id`` override shares on purpose."""
    from dataclasses import replace

    daemon = make_daemon()
    tokens = prompt(100, seed=9)
    tuned = LlamaModel(replace(tiny_model.cfg, seed=tiny_model.cfg.seed + 1))
    assert model_identity(tuned).model_id != model_identity(tiny_model).model_id
    want_tuned = run(tuned, None, tokens).output_token_ids
    saver = hooks_for(daemon.config.socket_path)
    run(tiny_model, saver, tokens)
    assert saver.flush() and saver.stats.saved_blocks == 6
    saver.close()
    other = hooks_for(daemon.config.socket_path)
    request = run(tuned, other, tokens)
    assert request.num_loaded_tokens == 0 and other.stats.lookup_hit_blocks == 0
    assert request.output_token_ids == want_tuned
    assert other.flush() and other.stats.saved_blocks == 6  # its own copy, beside the base's
    other.close()
    base = hooks_for(daemon.config.socket_path)
    assert run(tiny_model, base, tokens).num_loaded_tokens == 96
    base.close()
    shared = hooks_for(daemon.config.socket_path, model_id=model_identity(tiny_model).model_id)
    assert run(tuned, shared, tokens).num_loaded_tokens == 96  # the override: wrong on purpose
    shared.close()
    with TierdClient(socket_path=daemon.config.socket_path) as client:
        models = {m.model_id: m for m in client.stats().models}
    block = tiny_model.cfg.num_layers * 2 * 2 * 64 * BS * 4
    for model in (tiny_model, tuned):
        row = models[model_identity(model).model_id]
        assert (row.blocks["dram"], row.bytes["dram"]) == (6, 6 * block)
    daemon.check_integrity()


def test_the_measured_prefill_speed_reaches_the_savings(tiny_model: LlamaModel,
                                                         make_daemon: Any) -> None:
    """Engine A prefills a 300-token prompt (timed: its hooks report the engine's prefill
    speed); engine B loads its 18 blocks from tierd: the savings row counts 288 tokens at
    that reported speed, not the planner's."""
    daemon = make_daemon()
    tokens = prompt(300, seed=12)
    a = hooks_for(daemon.config.socket_path)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS), a)
    engine.generate([tokens], 1)
    assert a.flush()
    b = hooks_for(daemon.config.socket_path)
    loader = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=BS), b)
    loader.generate([tokens], 1)
    assert b.flush()
    with TierdClient(socket_path=daemon.config.socket_path) as client:
        rows = client.stats().savings
    assert [(r.tier, r.tokens, r.speed_source) for r in rows] == [("dram", 288, "reported")]
    assert rows[0].tokens_per_second > 0
    a.close()
    b.close()
