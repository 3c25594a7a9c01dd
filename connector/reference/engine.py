"""The reference engine: continuous batching, chunked prefill and greedy decoding over a paged
KV pool, with a hot-tier prefix cache and ``KVTransferHooks`` for outside tiers.

One ``step()`` schedules, runs one forward pass and samples::

    schedule   running requests first (decode, or their next prefill chunk), then waiting ones,
               within ``max_num_batched_tokens``; a new request takes its hot-tier prefix hit
               (``kv_cache_manager``), then asks ``hooks.lookup`` for more and loads it
    forward    all scheduled tokens as one varlen batch; each layer writes its new K/V into the
               pool, then attends over the pool (``PagedAttention``)
    sample     argmax for each request whose tokens are now all computed
    save       blocks that became full this step go to ``hooks.save``; finished requests free
               their blocks (still hittable until reused)

Block hashes come from ``tierd.hashing.BlockHasher`` (one per request, fed as tokens appear).
Blocks are cached (made hittable) when the step that computes them is scheduled, as in vLLM: a
later request in the same batch that hits them reads them after the layer wrote them, because
each layer writes every token's K/V before any attention. Loaded blocks are cached only after
``load`` reported them good.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from tierd.connector.reference.hooks import KVTransferHooks, NullHooks
from tierd.connector.reference.kv_cache_manager import KVCacheManager, PrefixCacheStats
from tierd.connector.reference.model import LlamaModel, model_identity
from tierd.gpu import (
    KVCache,
    KVCacheDtype,
    allocate_kv_cache,
    paged_attention,
    reshape_and_cache,
)
from tierd.hashing import BlockHasher, HashAlgo
from tierd.types import BlockHash


@dataclass(frozen=True)
class EngineConfig:
    """Pool size and scheduling limits. ``max_num_batched_tokens`` is the token budget of one
    step: a longer prompt is prefilled in chunks of at most that many tokens."""

    num_blocks: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 16
    kv_cache_dtype: KVCacheDtype = "auto"
    """``auto``: the model's dtype; ``fp8`` (= ``fp8_e4m3``) or ``fp8_e5m2`` store
    ``saturate(x / kv_scale)`` in one byte."""
    kv_scale: float = 1.0
    """Per-tensor FP8 scale for every layer's K and V (vLLM's default 1.0; ignored for auto)."""
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "sha256_cbor"
    hash_seed: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        if self.kv_scale <= 0:
            raise ValueError(f"kv_scale={self.kv_scale} must be positive")


RequestStatus = Literal["waiting", "running", "finished"]


@dataclass(slots=True, eq=False)
class Request:
    """One generation request. Hooks may read every field; only the engine writes them."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None
    hasher: BlockHasher
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Hashes of every full block of ``all_token_ids`` (grows during decode)."""
    num_computed_tokens: int = 0
    """Tokens whose K/V is in the pool (hit, loaded or computed)."""
    num_allocated_tokens: int = 0
    status: RequestStatus = "waiting"
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    num_hot_hit_tokens: int = 0
    """Tokens of the prompt hit in the hot tier at the (last) admission."""
    num_loaded_tokens: int = 0
    """Tokens loaded through ``hooks.load`` at the (last) admission."""
    num_failed_load_blocks: int = 0
    """Blocks ``lookup`` promised that were recomputed instead (failed or after a failure)."""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def ttft(self) -> float | None:
        """Seconds from ``add_request`` to the first generated token (None before it)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.block_hashes += self.hasher.append([token_id])


@dataclass(slots=True)
class _Scheduled:
    request: Request
    num_new_tokens: int
    to_save: list[tuple[int, BlockHash]]


class PagedAttention:
    """``AttentionBackend`` over the engine's ``tierd.gpu`` pool for one step's varlen batch:
    each layer first writes every new token's K/V (``reshape_and_cache``), then attends
    causally over each sequence's cached prefix plus its new tokens (``paged_attention``)."""

    def __init__(self, kv_cache: KVCache, *, slot_mapping: list[int],
                 block_tables: list[list[int]], seq_lens: list[int],
                 query_lens: list[int]) -> None:
        self.kv_cache = kv_cache
        dev = kv_cache.device
        self.slot_mapping = torch.tensor(slot_mapping, dtype=torch.int64, device=dev)
        width = max(len(table) for table in block_tables)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                         dtype=torch.int32, device=dev)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        self.query_start_loc = (None if all(n == 1 for n in query_lens) else
                                torch.tensor([0, *itertools.accumulate(query_lens)], device=dev))
        self.scale = kv_cache.spec.head_size ** -0.5

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv = self.kv_cache
        k_cache, v_cache = kv.k_caches[layer], kv.v_caches[layer]
        k_scale, v_scale = kv.k_scales[layer], kv.v_scales[layer]
        reshape_and_cache(k, v, k_cache, v_cache, self.slot_mapping,
                          k_scale=k_scale, v_scale=v_scale)
        out: Tensor = paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens,
                                      self.scale, query_start_loc=self.query_start_loc,
                                      k_scale=k_scale, v_scale=v_scale)
        return out


class LLMEngine:
    """Greedy generation with ``model`` over a paged pool; see the module docstring for a step.

    Not thread-safe. ``kv_cache`` is the pool (``tierd.gpu.layout.KVCache``: per-layer K/V
    views over one ``[num_blocks, block_bytes]`` byte tensor) that hooks gather from and scatter
    into; ``manager`` is the block manager (its ``stats`` count prefix queries/hits)."""

    def __init__(self, model: LlamaModel, config: EngineConfig | None = None,
                 hooks: KVTransferHooks | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.hooks: KVTransferHooks = hooks or NullHooks()
        cfg = model.cfg
        self.device = model.embed_tokens.weight.device
        """Where the pool and every step's tensors live: the model's device (CPU or CUDA)."""
        self.kv_cache = allocate_kv_cache(
            cfg.num_layers, self.config.num_blocks, cfg.num_kv_heads, cfg.head_dim,
            self.config.block_size, cfg.torch_dtype, device=self.device,
            kv_cache_dtype=self.config.kv_cache_dtype)
        if self.config.kv_cache_dtype != "auto":
            self.kv_cache.k_scales[:] = [self.config.kv_scale] * cfg.num_layers
            self.kv_cache.v_scales[:] = [self.config.kv_scale] * cfg.num_layers
        self.manager = KVCacheManager(self.config.num_blocks, self.config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id."""
        self._ids = itertools.count()
        self.num_preemptions = 0
        """Times a running request lost its blocks for lack of space (it is recomputed)."""
        self._step_timings: deque[tuple[int, float]] = deque(maxlen=1024)
        self.hooks.register_kv_caches(self.kv_cache, model_identity(model).model_id)
        attach = getattr(self.hooks, "attach_step_timings", None)  # optional (hooks module doc)
        if attach is not None:
            attach(self.take_step_timings)

    def take_step_timings(self) -> list[tuple[int, float]]:
        """(prompt tokens computed, seconds) of each forward pass since the last call (the
        last 1,024 at most), oldest first: the engine's prefill speed, measured."""
        out = list(self._step_timings)
        self._step_timings.clear()
        return out

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.manager.stats

    def add_request(self, prompt_token_ids: Sequence[int], max_tokens: int, *,
                    request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """Queue a prompt for ``max_tokens`` greedy tokens; the clock for ``ttft`` starts now.
        ``cache_salt`` (e.g. the tenant) goes into block 0's hash: no cross-salt hits."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty: give at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: ask for at least one token")
        total = len(prompt_token_ids) + max_tokens
        if total > self.model.cfg.max_position:
            raise ValueError("prompt + max_tokens exceeds the model's max_position; shorten it")
        if -(-total // self.config.block_size) > self.config.num_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens cannot fit in the pool of "
                             f"{self.config.num_blocks} blocks; raise EngineConfig.num_blocks")
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is in use: pick another")
        hasher = BlockHasher(self.config.block_size, algo=self.config.hash_algo,
                             seed=self.config.hash_seed, cache_salt=cache_salt)
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids),
                          max_tokens, cache_salt, hasher)
        request.block_hashes = hasher.append(request.prompt_token_ids)
        self.waiting.append(request)
        self.requests[request.request_id] = request
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """Schedule, run one forward pass, sample; returns the requests that finished."""
        batch = self._schedule()
        assert batch or not self.has_unfinished(), (
            "nothing schedulable: a request needs more blocks than the pool has; raise num_blocks")
        assert not self.manager.take_copies(), "no forks here, so no copy-on-write"
        if batch:
            self._execute(batch)
        finished = [s.request for s in batch if s.request.status == "finished"]
        saves = [pair for s in batch for pair in s.to_save]
        if saves:
            self.hooks.save([b for b, _ in saves], [h for _, h in saves])
        for request in finished:
            self.running.remove(request)
            self.hooks.request_finished(request)
            self.manager.free(request.request_id)
            del self.requests[request.request_id]
        self.hooks.step_end()
        return finished

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, *,
                 cache_salt: str | None = None) -> list[list[int]]:
        """Run every prompt to ``max_tokens`` (batched) and return their generated tokens."""
        requests = [self.add_request(p, max_tokens, cache_salt=cache_salt) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [r.output_token_ids for r in requests]

    def check_integrity(self) -> None:
        """Assert the block manager and the engine's request bookkeeping agree."""
        self.manager.check_integrity()
        for request in self.running:
            table = self.manager.block_table(request.request_id)
            assert len(table) * self.config.block_size >= request.num_allocated_tokens, (
                f"{request.request_id}: table shorter than its allocation")
            assert request.num_computed_tokens <= request.num_tokens, "computed past the end"
        for request in self.waiting:
            assert request.num_computed_tokens == 0, "a waiting request holds no KV"

    # --- scheduling -------------------------------------------------------------------------

    def _schedule(self) -> list[_Scheduled]:
        budget = self.config.max_num_batched_tokens
        batch: list[_Scheduled] = []
        for request in list(self.running):
            if budget == 0 or request.status != "running":
                continue
            num_new = min(budget, request.num_tokens - request.num_computed_tokens)
            # Out of blocks: preempt the newest running request until this one fits or is itself
            # the newest. Victims come after it in `running`, so none is in the batch yet.
            while not self._allocate(request, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                assert all(s.request is not victim for s in batch), "victim already scheduled"
                self._preempt(victim)
                if victim is request:
                    break
            else:
                batch.append(_Scheduled(request, num_new, self._cache(request, num_new)))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            scheduled = self._admit(self.waiting[0], budget)
            if scheduled is None:
                break
            self.waiting.popleft()
            self.running.append(scheduled.request)
            batch.append(scheduled)
            budget -= scheduled.num_new_tokens
        return batch

    def _admit(self, request: Request, budget: int) -> _Scheduled | None:
        """First scheduling of a waiting request: hot hit, external lookup and load."""
        bs, rid, hashes = self.config.block_size, request.request_id, request.block_hashes
        hit = None
        num_ext = 0
        if self.config.enable_prefix_caching:
            hit = self.manager.get_computed_blocks(hashes, request.num_tokens)
            request.num_computed_tokens = hit.num_tokens
            room = (request.num_tokens - 1) // bs - hit.num_tokens // bs
            num_ext = max(0, min(self.hooks.lookup(request), room))
        hot = request.num_computed_tokens
        ext_end = hot + num_ext * bs
        total = ext_end + min(budget, request.num_tokens - ext_end)
        if self.manager.allocate_slots(rid, total, hit, hashes, cache=False) is None:
            request.num_computed_tokens = 0
            return None
        request.num_allocated_tokens = total
        request.status = "running"
        request.num_hot_hit_tokens, request.num_loaded_tokens = hot, 0
        if num_ext:
            first = hot // bs
            block_ids = self.manager.block_table(rid)[first:first + num_ext]
            ok = self.hooks.load(request, block_ids, hashes[first:first + num_ext])
            assert len(ok) == num_ext, f"load returned {len(ok)} flags for {num_ext} blocks"
            num_ok = next((i for i, good in enumerate(ok) if not good), num_ext)
            request.num_failed_load_blocks += num_ext - num_ok
            request.num_loaded_tokens = num_ok * bs
            request.num_computed_tokens = hot + num_ok * bs
            self.manager.mark_cached(rid, hashes, request.num_computed_tokens)
        num_new = min(budget, total - request.num_computed_tokens)
        return _Scheduled(request, num_new, self._cache(request, num_new))

    def _allocate(self, request: Request, num_tokens: int) -> bool:
        total = max(num_tokens, request.num_allocated_tokens)
        if self.manager.allocate_slots(request.request_id, total, cache=False) is None:
            return False
        request.num_allocated_tokens = total
        return True

    def _cache(self, request: Request, num_new: int) -> list[tuple[int, BlockHash]]:
        """Make the blocks this step fills hittable now; return them for ``hooks.save``."""
        if not self.config.enable_prefix_caching:
            return []
        end = request.num_computed_tokens + num_new
        cached = self.manager.mark_cached(request.request_id, request.block_hashes, end)
        return [(c.block_id, c.block_hash) for c in cached]

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and requeue it first; it is recomputed (or re-hit) later."""
        self.running.remove(request)
        self.manager.free(request.request_id)
        self.num_preemptions += 1
        request.status, request.num_computed_tokens, request.num_allocated_tokens = "waiting", 0, 0
        self.waiting.appendleft(request)

    # --- execution --------------------------------------------------------------------------

    def _execute(self, batch: list[_Scheduled]) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in batch:
            start = s.request.num_computed_tokens
            span = range(start, start + s.num_new_tokens)
            tokens += s.request.all_token_ids[start:start + s.num_new_tokens]
            positions += span
            slots += self.manager.slot_mapping(s.request.request_id, span)
        attention = PagedAttention(
            self.kv_cache, slot_mapping=slots,
            block_tables=[self.manager.block_table(s.request.request_id) for s in batch],
            seq_lens=[s.request.num_computed_tokens + s.num_new_tokens for s in batch],
            query_lens=[s.num_new_tokens for s in batch],
        )
        prefill = sum(max(0, min(s.num_new_tokens, len(s.request.prompt_token_ids)
                                 - s.request.num_computed_tokens)) for s in batch)
        began = time.perf_counter()
        with torch.inference_mode():
            dev = self.device
            hidden = self.model(torch.tensor(tokens, device=dev),
                                torch.tensor(positions, device=dev), attention)
            ends = list(itertools.accumulate(s.num_new_tokens for s in batch))
            sampling = [i for i, s in enumerate(batch)
                        if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens]
            next_tokens: Tensor | None = None
            if sampling:
                rows = torch.tensor([ends[i] - 1 for i in sampling], device=dev)
                next_tokens = self.model.compute_logits(hidden[rows]).argmax(dim=-1)
        sampled = next_tokens.tolist() if next_tokens is not None else []  # waits for a GPU
        now = time.perf_counter()
        self._step_timings.append((prefill, now - began))
        for s in batch:
            s.request.num_computed_tokens += s.num_new_tokens
        for i, token in zip(sampling, sampled):
            request = batch[i].request
            request.append_token(int(token))
            if request.first_token_time is None:
                request.first_token_time = now
            if len(request.output_token_ids) >= request.max_tokens:
                request.status = "finished"


@dataclass(frozen=True)
class TTFTResult:
    """One measured request: time to first token and where its prefix came from."""

    ttft_s: float
    first_token: int
    num_prompt_tokens: int
    num_hot_hit_tokens: int
    num_loaded_tokens: int


def measure_ttft(engine: LLMEngine, prompt_token_ids: Sequence[int], *,
                 cache_salt: str | None = None) -> TTFTResult:
    """Time from ``add_request`` to the first generated token of one prompt (it runs alone
    if the engine is idle; other queued requests keep stepping alongside). The request
    finishes with that token, so its blocks stay in the pool as hits for the next call."""
    request = engine.add_request(prompt_token_ids, 1, cache_salt=cache_salt)
    while request.first_token_time is None:
        engine.step()
    ttft = request.ttft
    assert ttft is not None, "the loop ends at the first token"
    return TTFTResult(ttft, request.output_token_ids[0], len(request.prompt_token_ids),
                      request.num_hot_hit_tokens, request.num_loaded_tokens)



def _main() -> None:
    """``python -m tierd.connector.reference.engine``: default 2,048-token prefill on 2 threads
    (cold TTFT, median of 5 fresh engines), the same prompt as a hot-tier hit, and 32 decode
    steps of a batch of 8, beside the dense (no paging) forward of the same prompt."""
    import statistics

    from tierd.connector.reference.model import DenseCausalAttention, ModelConfig

    torch.set_num_threads(2)
    model = LlamaModel(ModelConfig())
    gen = torch.Generator().manual_seed(0)
    prompt: list[int] = torch.randint(0, model.cfg.vocab_size, (2048,), generator=gen).tolist()
    cold, hot = [], []
    for _ in range(5):
        engine = LLMEngine(model, EngineConfig(num_blocks=256))
        cold.append(measure_ttft(engine, prompt).ttft_s)
        hot.append(measure_ttft(engine, prompt).ttft_s)
    dense = []
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            hidden = model(torch.tensor(prompt), torch.arange(len(prompt)),
                           DenseCausalAttention([len(prompt)]))
            model.compute_logits(hidden[-1:])
            dense.append(time.perf_counter() - start)
    engine = LLMEngine(model, EngineConfig(num_blocks=256))
    requests = [engine.add_request(prompt[i * 64:(i + 1) * 64], 33) for i in range(8)]
    while any(not r.output_token_ids for r in requests):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    decode = (time.perf_counter() - start) / 32
    params = sum(p.numel() for p in model.parameters())
    cold_s = statistics.median(cold)
    print(f"model: {params / 1e6:.1f}M params, {model.cfg.num_layers} layers, 2 threads")
    print(f"prefill 2048 tokens (cold TTFT): median {cold_s:.3f} s, best {min(cold):.3f} s "
          f"(runs {', '.join(f'{t:.3f}' for t in cold)}; target about 1 s)")
    print(f"hot-tier hit of the same prompt: median {statistics.median(hot) * 1e3:.1f} ms "
          f"({cold_s / statistics.median(hot):.0f}x faster)")
    print(f"dense forward (no paging, one 2048-token SDPA): "
          f"median {statistics.median(dense):.3f} s")
    print(f"decode step, batch 8: {decode * 1e3:.1f} ms")


if __name__ == "__main__":
    _main()
