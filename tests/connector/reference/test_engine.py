"""The reference engine: greedy tokens are identical however the prefix KV got into the pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tierd.connector.reference.engine import EngineConfig, LLMEngine, Request, measure_ttft
from tierd.connector.reference.hooks import KVTransferHooks
from tierd.connector.reference.model import DenseCausalAttention, LlamaModel, ModelConfig
from tierd.gpu import KVCache, gather_blocks, scatter_blocks
from tierd.types import BlockHash

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=64, max_position=1024)
BS = 16


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel(TINY)


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist()
    return tokens


def _engine(model: LlamaModel, hooks: KVTransferHooks | None = None,
            **overrides: Any) -> LLMEngine:
    config = EngineConfig(**{"num_blocks": 64, "block_size": BS, **overrides})
    return LLMEngine(model, config, hooks)


def _dense_greedy(model: LlamaModel, prompt: list[int], max_tokens: int) -> list[int]:
    """No paging, no cache: recompute the whole sequence with plain causal attention per token."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            hidden = model(torch.tensor(tokens), torch.arange(len(tokens)),
                           DenseCausalAttention([len(tokens)]))
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt):]


def _alone(model: LlamaModel, prompt: list[int], max_tokens: int) -> list[int]:
    engine = _engine(model)
    out: list[list[int]] = engine.generate([prompt], max_tokens)
    engine.check_integrity()
    return out[0]


class DictHooks:
    """A fake outside tier: ``save`` copies block bytes (pool rows) into a dict by hash,
    ``lookup``/``load`` serve them back. ``fail_at`` makes that block index of a load fail;
    ``corrupt`` loads zeros and claims success (to show the tests can see wrong KV)."""

    def __init__(self, store: dict[BlockHash, torch.Tensor] | None = None,
                 fail_at: int | None = None, corrupt: bool = False) -> None:
        self.store = {} if store is None else store
        self.fail_at, self.corrupt = fail_at, corrupt
        self.kv_cache: KVCache | None = None
        self.calls: list[str] = []

    def register_kv_caches(self, kv_cache: KVCache, model_id: str) -> None:
        self.kv_cache = kv_cache

    def lookup(self, request: Request) -> int:
        self.calls.append("lookup")
        count = 0
        for block_hash in request.block_hashes[request.num_computed_tokens // BS:]:
            if block_hash not in self.store:
                break
            count += 1
        return count

    def load(self, request: Request, block_ids: Sequence[int],
             block_hashes: Sequence[BlockHash]) -> list[bool]:
        self.calls.append(f"load {len(block_ids)}")
        assert self.kv_cache is not None
        rows = torch.stack([self.store[h] for h in block_hashes])
        if self.corrupt:
            rows.zero_()
        scatter_blocks(self.kv_cache, torch.tensor(block_ids), rows)
        return [i != self.fail_at for i in range(len(block_ids))]

    def save(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        self.calls.append(f"save {len(block_ids)}")
        assert self.kv_cache is not None
        rows = torch.empty(len(block_ids), self.kv_cache.spec.block_bytes, dtype=torch.uint8)
        gather_blocks(self.kv_cache, torch.tensor(block_ids), rows)
        self.store.update(zip(block_hashes, rows))

    def request_finished(self, request: Request) -> None:
        self.calls.append("finished")

    def step_end(self) -> None:
        self.calls.append("step_end")


def test_paged_engine_equals_dense_reference(model: LlamaModel) -> None:
    """A 70-token prompt, 12 greedy tokens: paged engine == full-sequence dense recompute."""
    prompt = _prompt(70, seed=1)
    want = _dense_greedy(model, prompt, 12)
    assert len(set(want)) > 3, "the model must not collapse to one token, or the tests prove little"
    assert _alone(model, prompt, 12) == want


def test_hot_prefix_hit_gives_identical_tokens(model: LlamaModel) -> None:
    """Same prompt twice, then a prompt sharing 48 tokens: hits of 64 and 48 tokens, same tokens."""
    prompt = _prompt(70, seed=2)
    other = prompt[:48] + _prompt(30, seed=3)
    engine = _engine(model)
    first = engine.add_request(prompt, 10)
    while engine.has_unfinished():
        engine.step()
    again = engine.add_request(prompt, 10)
    branch = engine.add_request(other, 10)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert (first.num_hot_hit_tokens, again.num_hot_hit_tokens, branch.num_hot_hit_tokens) == (
        0, 64, 48)
    assert again.output_token_ids == first.output_token_ids == _alone(model, prompt, 10)
    assert branch.output_token_ids == _alone(model, other, 10)
    assert (engine.prefix_stats.queries, engine.prefix_stats.hits) == (70 + 70 + 78, 64 + 48)


def test_continuous_batching_with_chunked_prefill(model: LlamaModel) -> None:
    """Five prompts, 32-token budget, 3 seqs at once, two arriving mid-run: same as each alone."""
    prompts = [_prompt(n, seed=10 + n) for n in (23, 70, 41, 100, 5)]
    engine = _engine(model, max_num_batched_tokens=32, max_num_seqs=3)
    requests = [engine.add_request(p, 8) for p in prompts[:3]]
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    requests += [engine.add_request(p, 8) for p in prompts[3:]]
    steps = 3
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        steps += 1
    assert [r.output_token_ids for r in requests] == [_alone(model, p, 8) for p in prompts]
    assert steps >= (23 + 70 + 41 + 100 + 5) // 32, "prefill really was chunked by the budget"


def test_preemption_recomputes_identically(model: LlamaModel) -> None:
    """A 10-block pool for three 50-token prompts forces preemption; tokens are unchanged."""
    prompts = [_prompt(50, seed=20 + i) for i in range(3)]
    engine = _engine(model, num_blocks=10, max_num_batched_tokens=64)
    outs = engine.generate(prompts, 12)
    engine.check_integrity()
    assert engine.num_preemptions == 1
    assert outs == [_alone(model, p, 12) for p in prompts]


def test_cache_salt_isolates_prefixes(model: LlamaModel) -> None:
    """The same prompt under another tenant's salt gets no hot hit; the same salt does."""
    prompt = _prompt(70, seed=4)
    engine = _engine(model)
    engine.generate([prompt], 2, cache_salt="tenant-a")
    other = engine.add_request(prompt, 2, cache_salt="tenant-b")
    same = engine.add_request(prompt, 2, cache_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    assert (other.num_hot_hit_tokens, same.num_hot_hit_tokens) == (0, 64)


def test_hooks_load_saved_blocks_into_a_new_engine(model: LlamaModel) -> None:
    """Blocks saved by one engine load into a fresh one: 4 blocks loaded, identical tokens."""
    prompt = _prompt(70, seed=5)
    saver = DictHooks()
    want = _engine(model, saver).generate([prompt], 20)[0]
    # 70 prompt + 19 fed-back tokens = 89 computed: blocks 0..4 full, each saved exactly once.
    full = (70 + 20 - 1) // BS
    assert len(saver.store) == full
    assert saver.calls[:4] == ["lookup", "save 4", "step_end", "step_end"]
    loader = DictHooks(saver.store)
    engine = _engine(model, loader)
    request = engine.add_request(prompt, 20)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert (request.num_hot_hit_tokens, request.num_loaded_tokens) == (0, 64)
    assert loader.calls[:2] == ["lookup", "load 4"]
    assert request.output_token_ids == want == _alone(model, prompt, 20)
    again = engine.add_request(prompt, 20)  # loaded blocks are now hot-tier hits
    while engine.has_unfinished():
        engine.step()
    assert (again.num_hot_hit_tokens, again.num_loaded_tokens) == (64, 0)
    assert again.output_token_ids == want


@pytest.mark.parametrize("budget", [1024, 16])
def test_failed_load_is_recomputed(model: LlamaModel, budget: int) -> None:
    """Block 1 of 4 fails to load: block 0 is used, blocks 1-3 recomputed, tokens identical."""
    prompt = _prompt(70, seed=6)
    saver = DictHooks()
    want = _engine(model, saver).generate([prompt], 12)[0]
    engine = _engine(model, DictHooks(saver.store, fail_at=1), max_num_batched_tokens=budget)
    request = engine.add_request(prompt, 12)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert (request.num_loaded_tokens, request.num_failed_load_blocks) == (16, 3)
    assert request.output_token_ids == want


def test_load_never_covers_the_last_prompt_token(model: LlamaModel) -> None:
    """A 64-token prompt with all 4 blocks stored loads only 3: the last token is computed."""
    prompt = _prompt(64, seed=12)
    saver = DictHooks()
    want = _engine(model, saver).generate([prompt], 6)[0]
    engine = _engine(model, DictHooks(saver.store))
    request = engine.add_request(prompt, 6)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert (request.num_loaded_tokens, request.num_failed_load_blocks) == (48, 0)
    assert request.output_token_ids == want


def test_bad_requests_raise_value_error(model: LlamaModel) -> None:
    """Empty prompt, zero tokens, more tokens than the pool, a reused id: ValueError each."""
    engine = _engine(model, num_blocks=4)
    engine.add_request([1, 2, 3], 1, request_id="a")
    for prompt, max_tokens, rid in (([], 1, None), ([1], 0, None), ([1] * 60, 5, None),
                                    ([1], 1, "a")):
        with pytest.raises(ValueError):
            engine.add_request(prompt, max_tokens, request_id=rid)
    engine.generate([], 1)
    engine.check_integrity()
    assert not engine.has_unfinished()


def test_corrupt_load_changes_tokens(model: LlamaModel) -> None:
    """Control: zeros claimed as good KV do change the output, so the tests above can see it."""
    prompt = _prompt(70, seed=7)
    saver = DictHooks()
    want = _engine(model, saver).generate([prompt], 12)[0]
    got = _engine(model, DictHooks(saver.store, corrupt=True)).generate([prompt], 12)[0]
    assert got != want


def test_fp8_kv_runs_and_mostly_agrees(model: LlamaModel) -> None:
    """fp8 e4m3 and e5m2 KV generate the requested tokens; agreement with fp32 KV is printed."""
    prompts = [_prompt(70, seed=8), _prompt(33, seed=9)]
    want = [_alone(model, p, 16) for p in prompts]
    for dtype in ("fp8", "fp8_e5m2"):
        engine = _engine(model, kv_cache_dtype=dtype)
        got = engine.generate(prompts, 16)
        engine.check_integrity()
        assert [len(g) for g in got] == [16, 16]
        assert engine.kv_cache.k_caches[0].element_size() == 1
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        print(f"{dtype}: {same}/32 tokens equal to fp32 KV")


def test_ttft_helper_reports_hits(model: LlamaModel) -> None:
    """measure_ttft: a cold then a hot run of one prompt; same first token, 64-token hit."""
    prompt = _prompt(70, seed=11)
    engine = _engine(model)
    cold = measure_ttft(engine, prompt)
    hot = measure_ttft(engine, prompt)
    assert (cold.num_hot_hit_tokens, hot.num_hot_hit_tokens) == (0, 64)
    assert cold.first_token == hot.first_token == _alone(model, prompt, 1)[0]
    assert cold.ttft_s > 0 and hot.ttft_s > 0
    assert not engine.has_unfinished()
