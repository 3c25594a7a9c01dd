"""TierdConnector (``tierd.connector.vllm``) driven the way vLLM 0.33's scheduler and model runner
call it, against a real daemon (real socket, real shared-memory arena).

vLLM is not installed in the main suite, so the adapter subclasses the stand-in base classes
(``tests/vllm/`` runs the same adapter inside real vLLM). KV caches are what vLLM 0.33 hands
``register_kv_caches``: per layer a ``[blocks, kv_heads, block_size, 2*head_size]`` view (K|V
innermost) of one shared buffer, in several physical orders. Requests carry vLLM's block hashes
(sha256_cbor). Each step the fake engine calls, in vLLM's order:

    scheduler: get_num_new_matched_tokens -> (allocate) -> update_state_after_alloc
               -> build_connector_meta
    worker:    bind_connector_metadata -> start_load_kv -> per layer: wait_for_layer_load,
               (attention writes the layer), save_kv_layer -> wait_for_save -> get_finished
               -> get_block_ids_with_load_errors -> get_kv_connector_stats
               -> build_connector_worker_meta -> clear_connector_metadata
    scheduler: update_connector_output (the workers' reports merged); request_finished
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tierd.connector.vllm import (
    TierdConnector,
    TierdConnectorMetadata,
    TierdWorkerMetadata,
    layout_from_vllm_config,
)
from tierd.connector.vllm.base import HAVE_VLLM, KVConnectorRole, StandinKVConnectorBase
from tierd.connector.vllm.identity import model_identity_from_vllm
from tierd.connector.vllm.metadata import LoadSpec, SaveSpec
from tierd.connector.vllm.stats import TierdConnectorStats
from tierd.connector.vllm.worker import WorkerSide
from tierd.daemon.arena import ShmArena
from tierd.daemon.client import TierdClient
from tierd.hashing import block_hashes
from tierd.types import BlockHash

LAYERS, HEADS, HEAD, BS = 3, 2, 16, 16
COUNTERS = ("loaded_blocks", "failed_blocks", "saved_blocks", "skipped_blocks", "dropped_blocks")


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
            kv_connector="TierdConnector", kv_connector_module_path="tierd.connector.vllm",
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


class FakeVllm:
    """One vLLM instance: the scheduler-side connector, one worker-side connector per TP rank
    (each with its own KV buffer in physical ``order``), a block allocator (``first_block``
    keeps two instances' block ids apart) and each request's block table."""

    def __init__(self, socket_path: str, first_block: int, order: str = "LBHNC", tp: int = 1,
                 num_blocks: int = 64, **extra: Any) -> None:
        extra = {"socket_path": socket_path, **extra}
        self.config = fake_config(extra, tp)
        self.scheduler = TierdConnector(self.config, KVConnectorRole.SCHEDULER)
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

    def admit(self, req: FakeRequest, local_hit: int = 0, shared: Sequence[int] = ()) -> int:
        """vLLM scheduling a waiting request: lookup beyond the local hit (held in ``shared``),
        allocation, update_state_after_alloc, and only then ``num_computed_tokens`` set (vLLM's
        order). Returns the external tokens."""
        external, load_async = self.scheduler.get_num_new_matched_tokens(req, local_hit)
        assert load_async is False and external is not None
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
        for rank, (worker, kv) in enumerate(zip(self.workers, self.kv)):
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            for layer, (name, tensor) in enumerate(kv.items()):
                worker.wait_for_layer_load(name)
                for req, start, end in spans:
                    pos = torch.arange(start, end)
                    tokens = torch.tensor(req.all_token_ids[start:end], dtype=torch.long)
                    blocks = torch.tensor(self.tables[req.request_id])[pos // BS]
                    tensor[blocks, :, pos % BS] = fake_kv(tokens, pos, layer, rank)
                worker.save_kv_layer(name, tensor, None)
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

    def close(self) -> None:
        self.scheduler.shutdown()
        for worker in self.workers:
            worker.shutdown()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 1009 + 5) % 32000 for i in range(n)]


def usage(socket_path: str) -> tuple[int, int]:
    """(blocks in the daemon's DRAM tier, blocks pinned in any tier)."""
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
    """The daemon answers rank ``rank``'s worker Acquire with at most ``kept`` blocks (as after
    losing the rest): its load fails from there."""
    client = engine.workers[rank]._worker.link.client
    real = client.acquire
    monkeypatch.setattr(client, "acquire",
                        lambda eid, hashes, **kw: real(eid, hashes[:kept], **kw))


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


# -- scenarios ----------------------------------------------------------------------------------

@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed: the real base classes are used")
def test_imports_without_vllm_and_metadata_pickles() -> None:
    """Without vLLM the connector subclasses the stand-ins; both metadata types pickle."""
    assert issubclass(TierdConnector, StandinKVConnectorBase)
    assert [(r.name, r.value) for r in KVConnectorRole] == [("SCHEDULER", 0), ("WORKER", 1)]
    meta = TierdConnectorMetadata(loads=[LoadSpec("r", [3, 4], [b"x" * 32, b"y" * 32])],
                                  saves=[SaveSpec("r", [5], [b"z" * 32], [3])],
                                  recomputing=["q"])
    assert pickle.loads(pickle.dumps(meta)) == meta
    report = pickle.loads(pickle.dumps(TierdWorkerMetadata({"r": 1}, {4})))
    assert report.aggregate(TierdWorkerMetadata({"r": 1, "s": 1}, {7})) == TierdWorkerMetadata(
        {"r": 2, "s": 1}, {4, 7})


@pytest.mark.parametrize("saver, loader", [("LBHNC", "LBNHC"), ("LBNHC", "BLNHC"),
                                           ("BLNHC", "LBHNC"), ("LBNHC", "separate")])
def test_prefix_saved_in_one_order_loads_bit_exact_in_another(sock: str, engines: Any,
                                                              saver: str, loader: str) -> None:
    """A (KV buffer in ``saver`` order) saves 6 blocks; B (``loader``) loads them bit-exact."""
    a, b = engines(0, order=saver), engines(20, order=loader)
    assert a.kv[0]["model.layers.1.self_attn.attn"].stride() != \
        b.kv[0]["model.layers.1.self_attn.attn"].stride()
    req_a, req_b = FakeRequest("a", prompt(100)), FakeRequest("b", prompt(100))
    assert a.prefill(req_a) == (0, set())
    assert a.counters() == (0, 0, 6, 0, 0) and usage(sock) == (6, 0)
    assert b.prefill(req_b) == (96, set())
    assert b.counters() == (6, 0, 0, 0, 0) and b.computed_tokens == 4
    ids_a, ids_b = a.tables["a"], b.tables["b"]
    assert ids_a == list(range(0, 7)) and ids_b == list(range(20, 27))
    for block_a, block_b in zip(ids_a, ids_b):
        assert torch.equal(a.block(block_a), b.block(block_b))
    assert b.block(ids_b[0]).abs().sum() > 0
    a.finish(req_a)
    b.finish(req_b)
    assert usage(sock) == (6, 0)


def test_matches_stop_before_last_token_and_after_local_hit(sock: str, engines: Any) -> None:
    """6 blocks stored: a 96-token prompt matches 5, beyond a 2-block local hit 3, beyond 5 none."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(96)))
    assert a.counters() == (0, 0, 6, 0, 0)
    req = FakeRequest("b", prompt(96))
    asks = [(req, 0), (req, 32), (req, 80), (FakeRequest("c", prompt(97)), 0),
            (FakeRequest("d", prompt(96, salt=1)), 0),
            (FakeRequest("e", prompt(40) + prompt(56, salt=2)), 0)]
    assert [b.scheduler.get_num_new_matched_tokens(r, n) for r, n in asks] == [
        (80, False), (48, False), (0, False), (96, False), (0, False), (32, False)]
    assert usage(sock) == (6, 6)  # c pins blocks 0-5, e 0-1; b's last lookup dropped its pin
    for r, _ in asks:
        assert b.scheduler.request_finished(r, []) == (False, None)
    assert usage(sock) == (6, 0)


def test_decode_blocks_are_saved_once_as_they_fill(sock: str, engines: Any) -> None:
    """A 30-token prefill saves block 0; decoding saves block 1 at token 32, block 2 at 48."""
    a = engines(0)
    req = FakeRequest("a", prompt(30))
    a.prefill(req)
    assert a.counters() == (0, 0, 1, 0, 0)
    saved = []
    for token in range(18):  # positions 30..47
        a.decode(req, 7 + token)
        saved.append(a.counters()[2])
    assert saved == [1, 2] + [2] * 15 + [3]
    assert a.counters() == (0, 0, 3, 0, 0) and usage(sock) == (3, 0)
    probe = FakeRequest("b", list(req.all_token_ids) + [1])
    b = engines(20)
    assert b.scheduler.get_num_new_matched_tokens(probe, 0) == (48, False)
    assert b.scheduler.request_finished(probe, []) == (False, None)


def test_preempted_request_resumes_from_tierd(sock: str, engines: Any) -> None:
    """Preempted after 50 tokens, a request resumes into other blocks loading 3 of its 4."""
    a = engines(0)
    req = FakeRequest("a", prompt(40))
    a.prefill(req)
    for token in range(10):
        a.decode(req, 100 + token)
    assert a.counters() == (0, 0, 3, 0, 0)
    before = [a.block(b).clone() for b in a.tables["a"][:3]]
    computed = a.computed_tokens
    a.preempt(req)
    assert a.admit(req) == 48
    assert a.step([req]).invalid_block_ids == set()
    ids = a.tables["a"]
    assert ids == [4, 5, 6, 7] and a.computed_tokens - computed == 2
    assert a.metas[-1].saves == [] and a.metas[-1].loads == [
        LoadSpec("a", [4, 5, 6], [bytes(h) for h in req.block_hashes[:3]])]
    assert all(torch.equal(a.block(ids[i]), before[i]) for i in range(3))
    assert a.counters() == (3, 0, 3, 0, 0) and usage(sock) == (3, 0)
    for token in range(14):  # positions 50..63: block 3 fills at the last one
        a.decode(req, 200 + token)
    assert a.counters() == (3, 0, 4, 0, 0)


def test_corrupt_slot_is_reported_and_recomputed(sock: str, engines: Any) -> None:
    """Block 3 of 6 is corrupt: B keeps 0-2, reports 3-5, and after the recompute equals A."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    corrupt(sock, a.config, block_hashes(prompt(100), BS), 3)
    req = FakeRequest("b", prompt(100))
    external, errors = b.prefill(req)
    ids_a, ids_b = a.tables["a"], b.tables["b"]
    assert external == 96 and errors == set(ids_b[3:6])
    assert b.counters() == (3, 3, 0, 0, 0) and usage(sock)[1] == 0
    for i in range(3):
        assert torch.equal(a.block(ids_a[i]), b.block(ids_b[i]))
    req.num_computed_tokens = 3 * BS  # vLLM (recompute policy) rewinds to the failed block
    assert b.step([req]).invalid_block_ids == set()
    assert b.metas[-1].recomputing == ["b"] and b.computed_tokens == 4 + 52
    assert b.counters() == (3, 3, 1, 2, 0)  # block 3 dropped by the daemon, stored again
    for block_a, block_b in zip(ids_a, ids_b):
        assert torch.equal(a.block(block_a), b.block(block_b))


def test_corrupt_block_is_dropped_and_stored_again_by_the_recompute(sock: str,
                                                                    engines: Any) -> None:
    """B finds block 3 corrupt: the daemon drops it, B's recompute stores it, C loads all 6."""
    a, b, c = engines(0), engines(20), engines(40)
    a.prefill(FakeRequest("a", prompt(100)))
    corrupt(sock, a.config, block_hashes(prompt(100), BS), 3)
    req = FakeRequest("b", prompt(100))
    assert b.prefill(req) == (96, set(b.tables["b"][3:6]))
    assert usage(sock) == (5, 0)
    req.num_computed_tokens = 3 * BS
    b.step([req])
    assert b.counters() == (3, 3, 1, 2, 0)
    assert c.prefill(FakeRequest("c", prompt(100))) == (96, set())
    assert c.counters() == (6, 0, 0, 0, 0)


def test_failed_load_drops_dependent_saves_until_recomputing(sock: str, engines: Any,
                                                             monkeypatch: Any) -> None:
    """X's load misses from block 3: saves on top of it (X's, Y's) are dropped until recomputing."""
    a, b = engines(0), engines(20)
    prefix = prompt(96)
    a.prefill(FakeRequest("a", prefix + [1]))
    x = FakeRequest("x", prefix + prompt(67, salt=1))  # 10 full blocks, prefilled in 2 chunks
    y = FakeRequest("y", prefix + prompt(35, salt=2))  # shares X's loading blocks (local hit)
    z = FakeRequest("z", prompt(40, salt=3))           # unrelated
    assert b.admit(x) == 96
    ids = b.tables["x"]
    assert b.admit(y, local_hit=96, shared=ids[:6]) == 0 and b.admit(z) == 0
    lose_blocks(b, 0, 3, monkeypatch)
    first = b.step([x, y, z], budget={"x": 32}, deliver=False)
    monkeypatch.undo()
    assert first.invalid_block_ids == set(ids[3:6])
    assert first.kv_connector_worker_meta == TierdWorkerMetadata({"x": 1}, set(ids[3:6]), step=1)
    saves = {s.req_id: s for s in b.metas[-1].saves}
    assert (saves["x"].block_ids, saves["x"].depends_on) == (ids[6:8], ids[:6])
    assert (saves["y"].block_ids[-2:], saves["y"].depends_on) == (b.tables["y"][6:8], ids[:6])
    assert (saves["z"].block_ids, saves["z"].depends_on) == (b.tables["z"][:2], [])
    second = b.step([x], deliver=False)  # async scheduling: planned before the failure is known
    assert b.metas[-1].recomputing == [] and b.metas[-1].saves == [  # X's load is unreported
        SaveSpec("x", ids[8:10], [bytes(h) for h in x.block_hashes[8:10]], ids[:6])]
    dropped = len(saves["x"].block_ids) + len(saves["y"].block_ids) + 2
    assert b.counters() == (3, 3, 2, 0, dropped)
    assert usage(sock) == (6 + 2, 6)  # A's prefix and Z's blocks; X's hit still pinned
    b.deliver(first)
    b.deliver(second)
    assert usage(sock) == (8, 0)
    x.num_computed_tokens, y.num_computed_tokens = 3 * BS, 96  # vLLM's rewind (recompute)
    assert b.step([x, y]).invalid_block_ids == set()
    assert b.metas[-1].recomputing == ["x", "y"]
    assert [(s.req_id, s.block_ids) for s in b.metas[-1].saves] == [
        ("x", ids[3:10]), ("y", b.tables["y"][3:8])]
    assert b.counters() == (3, 3, 2 + 6, 3 + 3, dropped)  # 3-5 were stored already
    assert usage(sock) == (14, 0)


def test_expired_lease_fails_the_whole_load(daemon: Any, sock: str, engines: Any) -> None:
    """The lease expires before B releases it: all 6 verified blocks are reported for recompute."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    store = daemon.daemon.store
    real_clock, jumps = store._clock, itertools.count(time.monotonic() + 100.0, 100.0)

    def jump() -> None:  # the daemon's clock, 100 s later at every reading
        store._clock = lambda: next(jumps)

    try:
        external, errors = b.prefill(FakeRequest("b", prompt(100)), before_forward=jump)
    finally:
        store._clock = real_clock
    ids_b = b.tables["b"]
    assert external == 96 and errors == set(ids_b[:6])
    assert b.counters() == (0, 6, 0, 0, 0) and usage(sock) == (6, 0)


def test_daemon_down_means_no_match_no_save_then_reconnects(workdir: str,
                                                            make_daemon: Any) -> None:
    """No daemon: 0 matches, 6 saves dropped; once one listens, saves and matches resume."""
    socket_path = os.path.join(workdir, "tierd.sock")
    a = FakeVllm(socket_path, 0, retry_seconds=0.0, timeout_seconds=30.0)  # a loaded host
    try:
        assert a.prefill(FakeRequest("a", prompt(100))) == (0, set())
        assert a.counters() == (0, 0, 0, 0, 6)
        make_daemon()
        assert a.prefill(FakeRequest("b", prompt(100, salt=1))) == (0, set())
        assert a.counters() == (0, 0, 6, 0, 6)
        probe = FakeRequest("c", prompt(100, salt=1))
        assert a.scheduler.get_num_new_matched_tokens(probe, 0) == (96, False)
        assert usage(socket_path) == (6, 6)
        a.scheduler.request_finished(probe, [])
        assert usage(socket_path) == (6, 0)
    finally:
        a.close()


def test_already_stored_blocks_are_skipped(engines: Any) -> None:
    """B (loading off) computes A's prompt cold: its 6 saves are skipped as already stored."""
    a, b = engines(0), engines(20, load=False)
    a.prefill(FakeRequest("a", prompt(100)))
    assert b.prefill(FakeRequest("b", prompt(100))) == (0, set())
    assert b.counters() == (0, 0, 0, 6, 0)


def test_request_without_block_hashes_is_neither_loaded_nor_saved(engines: Any) -> None:
    """A request carrying no block hashes gets 0 matches and plans no save."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    assert b.prefill(FakeRequest("b", prompt(100), hashed=False)) == (0, set())
    assert b.metas[-1] == TierdConnectorMetadata(step=len(b.metas))
    assert b.counters() == (0, 0, 0, 0, 0)


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


def test_async_local_hit_on_a_failed_load_is_not_stored(sock: str, engines: Any,
                                                        monkeypatch: Any) -> None:
    """Y, admitted on X's blocks before X's failed load is reported (async), stores nothing."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(96) + [1]))
    x = FakeRequest("x", prompt(96) + [1])
    assert b.admit(x) == 96
    lose_blocks(b, 0, 3, monkeypatch)
    first = b.step([x], deliver=False)
    monkeypatch.undo()
    y = FakeRequest("y", prompt(96) + prompt(35, salt=2))
    assert b.admit(y, local_hit=96, shared=b.tables["x"][:6]) == 0
    second = b.step([y], deliver=False)
    b.deliver(first)
    b.deliver(second)
    b.settle()
    assert usage(sock) == (6, 0)


def test_local_prefix_cache_hit_is_not_saved_again(engines: Any) -> None:
    """A request with a 2-block local hit (no tierd hit beyond it) saves its blocks 2-5 only."""
    a = engines(0)
    a.prefill(FakeRequest("a", prompt(100)))
    req = FakeRequest("b", prompt(32) + prompt(68, salt=1))
    assert a.admit(req, local_hit=32, shared=a.tables["a"][:2]) == 0
    a.step([req])
    assert [s.block_ids for s in a.metas[-1].saves] == [a.tables["b"][2:6]]
    assert a.counters() == (0, 0, 10, 0, 0)


@pytest.mark.parametrize("extra, match", [
    ({"socket": "/x"}, r"unknown kv_connector_extra_config key\(s\) \['socket'\].*known keys: "
                       r"\['address', .*'socket_path'"),
    ({"hash_algo": "sha256"}, r"key 'hash_algo' was removed: vLLM 0.33 hashes every block "
                              r"itself \(--prefix-caching-hash-algo\); drop it")])
def test_bad_extra_config_names_the_fix(extra: dict[str, Any], match: str) -> None:
    """An unknown extra-config key lists the known ones; a removed one says why and to drop it."""
    with pytest.raises(ValueError, match=match):
        TierdConnector(fake_config(extra), KVConnectorRole.SCHEDULER)
