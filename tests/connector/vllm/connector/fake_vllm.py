"""A fake vLLM 0.33 that drives TierdConnector the way vLLM's scheduler
and model runner call it, against a real daemon (real socket, real shared-memory arena); the
tests of this folder import it.

vLLM is not installed in the main suite, so the adapter subclasses the stand-in base classes
(``tests/vllm/`` runs the same adapter inside real vLLM). KV caches are what vLLM 0.33 hands
``register_kv_caches``: per layer a ``[blocks, kv_heads, block_size, 2*head_size]`` view (K|V
innermost) of one shared buffer, in several physical orders. Requests carry vLLM's block hashes
(sha256_cbor). Each step the fake engine calls, in vLLM's order:

    scheduler: get_num_new_matched_tokens -> (allocate) -> update_state_after_alloc
               -> build_connector_meta
    worker:    handle_preemptions -> bind_connector_metadata -> start_load_kv (only where
               the step has a synchronous load: vLLM's ``has_sync_kv_loads``) -> per layer:
               wait_for_layer_load, (attention writes the layer), save_kv_layer
               -> start_load_kv (where it has none) -> wait_for_save -> get_finished
               -> get_block_ids_with_load_errors -> get_kv_connector_stats
               -> build_connector_worker_meta -> clear_connector_metadata
    scheduler: update_connector_output (the workers' reports merged); request_finished
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from tierd.connector.vllm.connector import (
    TierdConnector,
    TierdConnectorMetadata,
    layout_from_vllm_config,
)
from tierd.connector.vllm.connector.base import KVConnectorRole
from tierd.connector.vllm.connector.stats import TierdConnectorStats
from tierd.connector.vllm.identity import model_identity_from_vllm
from tierd.hashing import block_hashes
from tierd.types import BlockHash
from tierd.wire.arena import ShmArena
from tierd.wire.client import TierdClient

LAYERS, HEADS, HEAD, BS = 3, 2, 16, 16
COUNTERS = ("loaded_blocks", "failed_blocks", "saved_blocks", "skipped_blocks", "dropped_blocks")
"""What ``FakeVllm.counters`` returns, in this order."""


# -- the fake vLLM ------------------------------------------------------------------------------

def fake_config(extra: dict[str, Any], tp: int = 1, rank: int = 0) -> SimpleNamespace:
    """vLLM's ``VllmConfig`` as the connector reads it (``kv_transfer_config``, the model and
    cache settings ``layout_from_vllm_config`` reads, the TP size and this worker's rank)."""
    model = SimpleNamespace(model="fake-llama", seed=0, dtype=torch.float16,
                            get_num_layers=lambda parallel: LAYERS,
                            get_num_kv_heads=lambda parallel: HEADS, get_head_size=lambda: HEAD)
    return SimpleNamespace(
        load_config=SimpleNamespace(load_format="dummy"),
        kv_transfer_config=SimpleNamespace(
            kv_connector="TierdConnector",
            kv_connector_module_path="tierd.connector.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra),
        model_config=model,
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto",
                                     prefix_caching_hash_algo="sha256_cbor"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, rank=rank))


@dataclass
class FakeRequest:
    """vLLM's ``Request`` as the connector reads it: ``block_hashes`` as vLLM's hasher keeps them
    (every full block, sha256_cbor); none when ``hashed`` is False."""

    request_id: str
    all_token_ids: list[int]
    hashed: bool = True
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[BlockHash]:
        return block_hashes(self.all_token_ids, BS) if self.hashed else []


def kv_views(order: str, num_blocks: int) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views of one fp16 buffer whose physical axis order is ``order``
    (letters L, B, H, N, C), as vLLM's ``allocate_kv_cache`` builds them; ``"separate"``: one
    contiguous tensor per layer (no shared buffer)."""
    sizes = {"L": LAYERS, "B": num_blocks, "H": HEADS, "N": BS, "C": 2 * HEAD}
    if order == "separate":
        return {f"model.layers.{i}.self_attn.attn": torch.zeros(
            [sizes[a] for a in "BHNC"], dtype=torch.float16) for i in range(LAYERS)}
    strides: dict[str, int] = {}
    total = 1
    for axis in reversed(order):
        strides[axis], total = total, total * sizes[axis]
    buffer = torch.zeros(total, dtype=torch.float16)
    shape, stride = tuple(sizes[a] for a in "BHNC"), tuple(strides[a] for a in "BHNC")
    return {f"model.layers.{i}.self_attn.attn":
            torch.as_strided(buffer, shape, stride, i * strides["L"]) for i in range(LAYERS)}


def fake_kv(tokens: torch.Tensor, positions: torch.Tensor, layer: int, rank: int) -> torch.Tensor:
    """What the fake attention writes for these tokens, ``[T, H, C]``: exact in fp16, distinct
    per token, position, layer, TP rank, head and K|V channel."""
    base = (tokens * 7 + positions * 3 + layer * 11 + rank * 17).view(-1, 1, 1)
    inner = torch.arange(HEADS).view(1, -1, 1) * 13 + torch.arange(2 * HEAD).view(1, 1, -1)
    return ((base + inner) % 97).to(torch.float16) / 4


_OPEN: weakref.WeakSet[FakeVllm] = weakref.WeakSet()
"""Instances not closed yet: ``usage`` waits for their scheduler sides' daemon calls."""


def ask(connector: TierdConnector, req: FakeRequest, local_hit: int) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` asked again while it answers None, as vLLM asks at each
    step; the answer."""
    for _ in range(2000):
        external, load_async = connector.get_num_new_matched_tokens(req, local_hit)
        if external is not None:
            return external, load_async
        time.sleep(0.002)
    raise AssertionError(f"no answer for {req.request_id}")


class FakeVllm:
    """One vLLM instance: the scheduler-side connector, one worker-side connector per TP rank
    (each with its own KV buffer in physical ``order``), a block allocator (``first_block``
    keeps two instances' block ids apart) and each request's block table. Its hits are pinned
    by a lookup first unless ``answer_from_filter=True`` is passed (the scenarios here are
    those of the pin; the real vLLM suite covers hits answered from the presence filter)."""

    def __init__(self, socket_path: str, first_block: int, order: str = "LBHNC", tp: int = 1,
                 num_blocks: int = 64, **extra: Any) -> None:
        extra = {"socket_path": socket_path, "answer_from_filter": False, **extra}
        self.config = fake_config(extra, tp)
        self.scheduler = TierdConnector(self.config, KVConnectorRole.SCHEDULER)
        _OPEN.add(self)
        self.workers = [TierdConnector(fake_config(extra, tp, rank), KVConnectorRole.WORKER)
                        for rank in range(tp)]
        self.kv = [kv_views(order, num_blocks) for _ in range(tp)]
        for worker, kv in zip(self.workers, self.kv):
            worker.register_kv_caches(kv)
        self.free = list(range(first_block, num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.kinds: dict[str, str] = {}        # "new" / "resumed" until its next step
        self.grown: dict[str, list[int]] = {}  # blocks a decode added since the last step
        self.preempted: set[str] = set()
        self.finished: set[str] = set()
        self.metas: list[TierdConnectorMetadata] = []
        self.logged = TierdConnectorStats()    # get_kv_connector_stats, summed
        self.computed_tokens = 0
        self.layer_seconds = 0.0
        """How long each layer's attention takes in the forward pass (a slow model)."""

    def admit(self, req: FakeRequest, local_hit: int = 0, shared: Sequence[int] = ()) -> int:
        """vLLM scheduling a waiting request: lookup beyond the local hit (held in ``shared``),
        allocation, update_state_after_alloc, and only then ``num_computed_tokens`` set (vLLM's
        order). A lookup that answers None (Acquires in flight) is asked again, as vLLM does at
        its next step. Returns the external tokens."""
        external, load_async = ask(self.scheduler, req, local_hit)
        assert load_async is False
        rid = req.request_id
        table = list(shared) + [self.free.pop(0)
                                for _ in range(-(-req.num_tokens // BS) - len(shared))]
        self.tables[rid] = table
        self.kinds[rid] = "resumed" if rid in self.preempted else "new"
        self.scheduler.update_state_after_alloc(
            req, SimpleNamespace(get_block_ids=lambda: (table,)), external)
        req.num_computed_tokens = local_hit + external
        return external

    def step(self, reqs: list[FakeRequest], budget: dict[str, int] | None = None,
             before_forward: Callable[[], None] | None = None, deliver: bool = True) -> Any:
        """One engine step computing each request's missing tokens (at most ``budget[id]``);
        returns vLLM's ``KVConnectorOutput``. ``deliver=False`` holds it back (async scheduling:
        the next step is scheduled before it arrives) until ``deliver``."""
        counts: dict[str, int] = {}
        new: list[Any] = []
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
        for req in reqs:
            rid = req.request_id
            counts[rid] = min((budget or {}).get(rid, req.num_tokens),
                              req.num_tokens - req.num_computed_tokens)
            kind, table, grown = self.kinds.pop(rid, ""), self.tables[rid], self.grown.pop(rid, [])
            if kind == "new":
                new.append(SimpleNamespace(req_id=rid, block_ids=(list(table),)))
                continue
            cached.req_ids.append(rid)
            cached.new_block_ids.append((list(table),) if kind else (grown,) if grown else None)
            if kind == "resumed":
                cached.resumed_req_ids.add(rid)
        meta = self.scheduler.build_connector_meta(SimpleNamespace(
            num_scheduled_tokens=counts, scheduled_new_reqs=new, scheduled_cached_reqs=cached))
        assert isinstance(meta, TierdConnectorMetadata)
        self.metas.append(meta)
        if before_forward is not None:
            before_forward()
        out = self.forward(meta, [(r, r.num_computed_tokens,
                                   r.num_computed_tokens + counts[r.request_id]) for r in reqs])
        for req in reqs:
            req.num_computed_tokens += counts[req.request_id]
        if deliver:
            self.deliver(out)
        return out

    def forward(self, meta: TierdConnectorMetadata,
                spans: list[tuple[FakeRequest, int, int]]) -> Any:
        """Every worker's part of one step; their reports merged as vLLM merges them."""
        errors: set[int] = set()
        stats, report = TierdConnectorStats(), None
        finished, self.finished = self.finished, set()
        sync = any(not spec.stream for spec in meta.loads)  # vLLM's has_sync_kv_loads
        for rank, (worker, kv) in enumerate(zip(self.workers, self.kv)):
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            if sync:
                worker.start_load_kv(None)
            for layer, (name, tensor) in enumerate(kv.items()):
                worker.wait_for_layer_load(name)
                for req, start, end in spans:
                    pos = torch.arange(start, end)
                    tokens = torch.tensor(req.all_token_ids[start:end], dtype=torch.long)
                    blocks = torch.tensor(self.tables[req.request_id])[pos // BS]
                    tensor[blocks, :, pos % BS] = fake_kv(tokens, pos, layer, rank)
                time.sleep(self.layer_seconds)
                worker.save_kv_layer(name, tensor, None)
            if not sync:  # vLLM starts loads after the forward pass when none is synchronous
                worker.start_load_kv(None)
            worker.wait_for_save()
            assert worker.get_finished(finished) == (None, None)
            errors |= worker.get_block_ids_with_load_errors()
            step_stats = worker.get_kv_connector_stats()
            if step_stats is not None:
                stats.aggregate(step_stats)
            part = worker.build_connector_worker_meta()
            if part is not None:
                report = part if report is None else report.aggregate(part)
            worker.clear_connector_metadata()
        self.computed_tokens += sum(end - start for _, start, end in spans)
        self.logged.aggregate(stats)
        return SimpleNamespace(invalid_block_ids=errors, kv_connector_stats=stats,
                               kv_connector_worker_meta=report)

    def deliver(self, out: Any) -> None:
        self.scheduler.update_connector_output(out)

    def prefill(self, req: FakeRequest, local_hit: int = 0,
                before_forward: Callable[[], None] | None = None) -> tuple[int, set[int]]:
        """Admit ``req``, run its whole prefill in one step and let its saves land (``settle``):
        (external tokens, load errors)."""
        external = self.admit(req, local_hit)
        errors = self.step([req], before_forward=before_forward).invalid_block_ids
        self.settle()
        return external, errors

    def decode(self, req: FakeRequest, token: int) -> None:
        """Append a sampled token (a new block when the last is full) and compute its KV."""
        req.all_token_ids.append(token)
        table = self.tables[req.request_id]
        if req.num_tokens > len(table) * BS:
            table.append(self.free.pop(0))
            self.grown.setdefault(req.request_id, []).append(table[-1])
        assert self.step([req]).invalid_block_ids == set()

    def preempt(self, req: FakeRequest) -> None:
        """vLLM preempting a running request: its blocks freed, its computed tokens reset."""
        self.free += self.tables.pop(req.request_id)
        self.preempted.add(req.request_id)
        req.num_computed_tokens = 0

    def finish(self, req: FakeRequest) -> None:
        self.finished.add(req.request_id)
        ids = self.tables.pop(req.request_id)
        assert self.scheduler.request_finished(req, ids) == (False, None)

    def block(self, block_id: int, rank: int = 0) -> torch.Tensor:
        """Every layer's K|V of one block, logically: ``[layers, H, N, C]``."""
        return torch.stack([t[block_id] for t in self.kv[rank].values()])

    def settle(self) -> TierdConnectorStats:
        """Wait for the Commits the workers handed off (``worker_counters`` does) and take the
        stats they add, as the next steps' ``get_kv_connector_stats`` would; returns the totals
        summed over TP ranks. Like vLLM, it keeps stepping (empty steps) while the scheduler side
        has pending push work: with TP > 1, Commits held for the verdict on their step."""
        for _ in range(4):
            if not self.scheduler.has_pending_push_work():
                break
            self.step([])
        assert not self.scheduler.has_pending_push_work(), "held Commits never got a verdict"
        total = TierdConnectorStats()
        for worker in self.workers:
            assert worker.worker_counters is not None
            total.aggregate(worker.worker_counters)
            self.logged.aggregate(worker.get_kv_connector_stats() or TierdConnectorStats())
        return total

    def counters(self) -> tuple[int, ...]:
        """``settle``, then the totals of ``COUNTERS``: they must equal what
        ``get_kv_connector_stats`` reported step by step."""
        total = self.settle()
        assert total.reduce() == self.logged.reduce(), "per-step stats must add up to the totals"
        return tuple(total.data[name] for name in COUNTERS)

    def drain(self) -> None:
        """Wait for the scheduler side's daemon calls in flight (its lookups and releases)."""
        side = self.scheduler._scheduler
        assert side is not None and side.drain(30.0), "a scheduler-side call never finished"

    def close(self) -> None:
        _OPEN.discard(self)
        self.scheduler.shutdown()
        for worker in self.workers:
            worker.shutdown()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 1009 + 5) % 32000 for i in range(n)]


def usage(socket_path: str) -> tuple[int, int]:
    """(blocks in the daemon's DRAM tier, blocks pinned in any tier), once every open
    ``FakeVllm``'s scheduler-side calls and its workers' saves have landed (a worker's stock
    of blank slots committed: held, it counts as used)."""
    for engine in list(_OPEN):
        engine.drain()
        for worker in engine.workers:
            assert worker.worker_counters is not None
    with TierdClient(socket_path=socket_path, timeout=10.0) as client:
        tiers = client.stats().tiers
    return (next(t.used_blocks for t in tiers if t.tier == "dram"),
            sum(t.pinned_blocks for t in tiers))


def corrupt(socket_path: str, config: Any, hashes: list[BlockHash], index: int) -> None:
    """Flip one byte of the stored slot of ``hashes[index]`` (``hashes``: a held chain)."""
    with TierdClient(socket_path=socket_path, timeout=10.0) as client:
        layout = layout_from_vllm_config(config, model_identity_from_vllm(config).model_id)
        engine = client.register_engine(layout, "corrupter")
        got = client.acquire(engine.engine_id, hashes)
        arena = ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
        view = arena.view(engine.geometry.offset(got.slot_ids[index]) + 100, 1)
        view[0] ^= 0xFF
        view.release()
        arena.close()
        client.release(engine.engine_id, got.lease_id)
        client.unregister_engine(engine.engine_id)


def lose_blocks(engine: FakeVllm, rank: int, kept: int, monkeypatch: Any) -> None:
    """Rank ``rank``'s worker cannot load under the scheduler's pin (as after a daemon restart:
    another arena) and the daemon answers its own Acquire with at most ``kept`` blocks (as
    after losing the rest): its load fails from there."""
    worker = engine.workers[rank]._worker
    client, load = worker.link.client, worker.load
    real = client.acquire
    monkeypatch.setattr(client, "acquire",
                        lambda eid, hashes, **kw: real(eid, hashes[:kept], **kw))
    monkeypatch.setattr(worker, "load", lambda meta: load(dataclasses.replace(
        meta, loads=[dataclasses.replace(spec, pinned=[]) for spec in meta.loads])))

