"""The vLLM adapter driven the way vLLM's scheduler and model runner call it, against a real
daemon (real socket, real shared-memory arena), with KV caches as torch CPU tensors.

vLLM is not installed here, so ``TierdConnector`` subclasses the stand-in base classes; the fake
engine below makes the documented calls in vLLM's order:

    scheduler: get_num_new_matched_tokens -> (allocate) -> update_state_after_alloc
               -> build_connector_meta
    worker:    bind_connector_metadata -> start_load_kv -> per layer: wait_for_layer_load,
               (attention writes the layer), save_kv_layer -> wait_for_save -> get_finished
               -> get_block_ids_with_load_errors -> clear_connector_metadata
    scheduler: request_finished
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tierd.connector.vllm import TierdConnector, layout_from_vllm_config
from tierd.connector.vllm_meta import (HAVE_VLLM, KVConnectorRole, LoadSpec, SaveSpec,
                                       StandinKVConnectorBase, TierdConnectorMetadata)
from tierd.daemon.arena import ShmArena
from tierd.daemon.client import TierdClient
from tierd.daemon.config import TierdConfig
from tierd.daemon.server import Daemon
from tierd.hashing import block_hashes
from tierd.types import BlockHash

LAYERS, HEADS, HEAD, BS = 3, 2, 16, 16
SEED = "tierd-vllm-test"
"""NONE_HASH seed of both the fake vLLM's hashes and the connector's own (``hash_seed``)."""


# -- a real daemon on a temporary socket ------------------------------------------------------

@dataclass
class RunningDaemon:
    daemon: Daemon
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    socket_path: str

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def dram_blocks(self) -> int:
        with TierdClient(socket_path=self.socket_path, timeout=10.0) as client:
            return next(t.used_blocks for t in client.stats().tiers if t.tier == "dram")

    def check_integrity(self) -> None:
        async def check() -> None:
            self.daemon.store.check_integrity()
        self.call(check())

    def stop(self) -> None:
        self.call(self.daemon.stop(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def start_daemon(workdir: str) -> RunningDaemon:
    config = TierdConfig(socket_path=os.path.join(workdir, "tierd.sock"), dram_bytes=16 << 20,
                         slab_bytes=64 << 10, prefault=False, ssd_dir="",
                         maintain_seconds=3600.0, lease_seconds=30.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    daemon = asyncio.run_coroutine_threadsafe(Daemon.start(config), loop).result(timeout=60)
    return RunningDaemon(daemon, loop, thread, config.socket_path)


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tierd-v")  # short: a socket path must stay < 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(workdir: str) -> Iterator[RunningDaemon]:
    running = start_daemon(workdir)
    yield running
    try:
        running.check_integrity()
    finally:
        running.stop()


# -- the fake vLLM ------------------------------------------------------------------------------

class FakeModelConfig:
    dtype = torch.float16

    def get_num_layers(self, parallel: Any) -> int:
        return LAYERS

    def get_num_kv_heads(self, parallel: Any) -> int:
        return HEADS

    def get_head_size(self) -> int:
        return HEAD


@dataclass
class FakeCacheConfig:
    block_size: int = BS
    cache_dtype: str = "auto"
    prefix_caching_hash_algo: str = "sha256_cbor"


@dataclass
class FakeParallelConfig:
    tensor_parallel_size: int = 1
    rank: int = 0


@dataclass
class FakeKVTransferConfig:
    kv_connector_extra_config: dict[str, Any]
    kv_connector: str = "TierdConnector"
    kv_connector_module_path: str = "tierd.connector.vllm"
    kv_role: str = "kv_both"


@dataclass
class FakeVllmConfig:
    kv_transfer_config: FakeKVTransferConfig
    model_config: FakeModelConfig = field(default_factory=FakeModelConfig)
    cache_config: FakeCacheConfig = field(default_factory=FakeCacheConfig)
    parallel_config: FakeParallelConfig = field(default_factory=FakeParallelConfig)


@dataclass
class FakeRequest:
    """vLLM's ``Request`` as the connector reads it. ``with_hashes``: carries vLLM's chain
    hashes (prefix caching on); otherwise the connector hashes the tokens itself."""

    request_id: str
    all_token_ids: list[int]
    with_hashes: bool = True
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[BlockHash]:
        return block_hashes(self.all_token_ids, BS, seed=SEED) if self.with_hashes else []


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class NewRequestData:
    req_id: str
    block_ids: tuple[list[int], ...]


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)


def fake_kv(tokens: torch.Tensor, positions: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
    """What the fake attention layer writes for these tokens: exact in fp16, distinct per
    token, position, layer, K/V, head and dimension."""
    base = (tokens * 7 + positions * 3 + layer * 11 + kv * 5).view(-1, 1, 1)
    inner = (torch.arange(HEADS).view(1, -1, 1) * 13 + torch.arange(HEAD).view(1, 1, -1))
    return ((base + inner) % 97).to(torch.float16) / 4


@dataclass
class Step:
    """One request's part of a step: compute tokens [start, end) into ``block_ids``."""

    request: FakeRequest
    block_ids: list[int]
    start: int
    end: int


class FakeVllm:
    """One vLLM instance: scheduler connector, one worker connector, its own paged caches and
    block allocator (``first_block`` makes two instances use different block ids)."""

    def __init__(self, socket_path: str, first_block: int, num_blocks: int = 64,
                 **extra: Any) -> None:
        config = FakeVllmConfig(FakeKVTransferConfig(
            {"socket_path": socket_path, "hash_seed": SEED, **extra}))
        self.config = config
        self.scheduler = TierdConnector(config, KVConnectorRole.SCHEDULER)
        self.worker = TierdConnector(config, KVConnectorRole.WORKER)
        self.kv = {f"model.layers.{i}.self_attn.attn":
                   torch.zeros(2, num_blocks, BS, HEADS, HEAD, dtype=torch.float16)
                   for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(first_block, num_blocks))
        self.computed_tokens = 0
        self.block_ids: dict[str, list[int]] = {}

    def prefill(self, request: FakeRequest, local_hit: int = 0) -> tuple[int, set[int]]:
        """Schedule ``request`` from the waiting queue and run its prefill in one step.
        Returns (external tokens the connector matched, block ids reported as failed loads)."""
        external, load_async = self.scheduler.get_num_new_matched_tokens(request, local_hit)
        assert load_async is False and external is not None
        ids = [self.free.pop(0) for _ in range(-(-request.num_tokens // BS))]
        self.block_ids[request.request_id] = ids
        self.scheduler.update_state_after_alloc(request, FakeBlocks(ids), external)
        request.num_computed_tokens = local_hit + external
        out = SchedulerOutput({request.request_id: request.num_tokens - local_hit - external},
                              scheduled_new_reqs=[NewRequestData(request.request_id, (ids,))])
        meta = self.scheduler.build_connector_meta(out)
        errors = self.forward(meta, [Step(request, ids, local_hit + external, request.num_tokens)])
        request.num_computed_tokens = request.num_tokens
        return external, errors

    def preempt_and_resume(self, request: FakeRequest) -> tuple[int, list[int]]:
        """Free the request's blocks (preemption), then schedule it again from the waiting queue
        into fresh blocks: it shows up as a resumed cached request listing all its blocks."""
        self.free += self.block_ids.pop(request.request_id)
        request.num_computed_tokens = 0
        external, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        ids = [self.free.pop(0) for _ in range(-(-request.num_tokens // BS))]
        self.block_ids[request.request_id] = ids
        self.scheduler.update_state_after_alloc(request, FakeBlocks(ids), external)
        request.num_computed_tokens = external
        rid = request.request_id
        out = SchedulerOutput({rid: request.num_tokens - external},
                              scheduled_cached_reqs=CachedRequestData([rid], [(ids,)], {rid}))
        meta = self.scheduler.build_connector_meta(out)
        assert self.forward(meta, [Step(request, ids, external, request.num_tokens)]) == set()
        request.num_computed_tokens = request.num_tokens
        return external, ids

    def recompute_from(self, request: FakeRequest, errors: set[int]) -> None:
        """What vLLM does after load errors: recompute from the first failed block on."""
        ids = self.block_ids[request.request_id]
        first = min(ids.index(b) for b in errors) * BS
        request.num_computed_tokens = first
        self.cached_step(request, None, request.num_tokens - first)

    def decode(self, request: FakeRequest, token: int) -> None:
        """Append a sampled token and run the step that computes its KV."""
        request.all_token_ids.append(token)
        ids = self.block_ids[request.request_id]
        new = None
        if request.num_tokens > len(ids) * BS:
            new = [self.free.pop(0)]
            ids += new
        self.cached_step(request, new, 1)

    def cached_step(self, request: FakeRequest, new_ids: list[int] | None, count: int) -> None:
        rid = request.request_id
        out = SchedulerOutput({rid: count}, scheduled_cached_reqs=CachedRequestData(
            [rid], [None if new_ids is None else (new_ids,)]))
        meta = self.scheduler.build_connector_meta(out)
        start = request.num_computed_tokens
        step = Step(request, self.block_ids[rid], start, start + count)
        assert self.forward(meta, [step]) == set()
        request.num_computed_tokens = start + count

    def forward(self, meta: Any, steps: list[Step]) -> set[int]:
        """The worker side of one step: load, per-layer compute and save, then the checks."""
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(forward_context=None)
        for layer, (name, kv) in enumerate(self.kv.items()):
            worker.wait_for_layer_load(name)
            for step in steps:
                positions = torch.arange(step.start, step.end)
                tokens = torch.tensor(step.request.all_token_ids[step.start:step.end])
                blocks = torch.tensor(step.block_ids)[positions // BS]
                for k in (0, 1):
                    kv[k, blocks, positions % BS] = fake_kv(tokens, positions, layer, k)
            worker.save_kv_layer(name, kv, attn_metadata=None)
        self.computed_tokens += sum(step.end - step.start for step in steps)
        worker.wait_for_save()
        assert worker.get_finished(set()) == (None, None)
        errors: set[int] = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        return errors

    def finish(self, request: FakeRequest) -> None:
        ids = self.block_ids.pop(request.request_id)
        assert self.scheduler.request_finished(request, ids) == (False, None)

    def block(self, block_id: int) -> torch.Tensor:
        """Every layer's K and V of one block: [layers, 2, BS, HEADS, HEAD]."""
        return torch.stack([kv[:, block_id] for kv in self.kv.values()])

    def counters(self) -> tuple[int, int, int, int, int]:
        c = self.worker.worker_counters
        assert c is not None
        return c.loaded_blocks, c.failed_blocks, c.saved_blocks, c.skipped_blocks, c.dropped_blocks

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 1009 + 5) % 32000 for i in range(n)]


@pytest.fixture
def engines(daemon: RunningDaemon) -> Iterator[Any]:
    """Factory of FakeVllm instances on the daemon; all shut down at teardown."""
    made: list[FakeVllm] = []

    def make(first_block: int, **extra: Any) -> FakeVllm:
        made.append(FakeVllm(daemon.socket_path, first_block, **extra))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


# -- scenarios ----------------------------------------------------------------------------------

@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed: the real base classes are used")
def test_imports_without_vllm_and_metadata_pickles() -> None:
    """Without vLLM, TierdConnector subclasses the stand-ins (vLLM's role values), and the step
    metadata survives pickling (vLLM ships it to worker processes)."""
    assert issubclass(TierdConnector, StandinKVConnectorBase)
    assert [(r.name, r.value) for r in KVConnectorRole] == [("SCHEDULER", 0), ("WORKER", 1)]
    meta = TierdConnectorMetadata(loads=[LoadSpec("r", [3, 4], [b"x" * 32, b"y" * 32])],
                                  saves=[SaveSpec("r", [5], [b"z" * 32])])
    assert pickle.loads(pickle.dumps(meta)) == meta


@pytest.mark.parametrize("with_hashes", [True, False])
def test_prefix_saved_by_one_instance_loads_bit_exact_into_another(
        daemon: RunningDaemon, engines: Any, with_hashes: bool) -> None:
    """A computes and saves 6 full blocks; B loads them into other block ids, bit-exact, and
    computes only the 4-token tail (vLLM's hashes, or the connector's own)."""
    a, b = engines(0), engines(20)
    req_a = FakeRequest("a", prompt(100), with_hashes=with_hashes)
    assert a.prefill(req_a) == (0, set())
    assert a.counters() == (0, 0, 6, 0, 0)
    assert daemon.dram_blocks() == 6
    req_b = FakeRequest("b", prompt(100), with_hashes=with_hashes)
    assert b.prefill(req_b) == (96, set())
    assert b.counters() == (6, 0, 0, 0, 0)
    assert b.computed_tokens == 4
    ids_a, ids_b = a.block_ids["a"], b.block_ids["b"]
    assert ids_a == list(range(0, 7)) and ids_b == list(range(20, 27))
    for block_a, block_b in zip(ids_a, ids_b):
        assert torch.equal(a.block(block_a), b.block(block_b))
    assert b.block(ids_b[0]).abs().sum() > 0
    a.finish(req_a)
    b.finish(req_b)


def test_matches_stop_before_last_token_and_after_local_hit(engines: Any) -> None:
    """96 tokens = 6 full blocks stored: a match covers 5 (the last token's block is computed);
    beyond a 2-block local hit it is 3 blocks; a local hit of 5 blocks leaves nothing."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(96)))
    assert a.counters() == (0, 0, 6, 0, 0)
    sched = b.scheduler
    req = FakeRequest("b", prompt(96))
    assert sched.get_num_new_matched_tokens(req, 0) == (80, False)
    assert sched.get_num_new_matched_tokens(req, 32) == (48, False)
    assert sched.get_num_new_matched_tokens(req, 80) == (0, False)
    assert sched.get_num_new_matched_tokens(FakeRequest("c", prompt(97)), 0) == (96, False)
    assert sched.get_num_new_matched_tokens(FakeRequest("d", prompt(96, salt=1)), 0) == (0, False)
    partial = FakeRequest("e", prompt(40) + prompt(56, salt=2))
    assert sched.get_num_new_matched_tokens(partial, 0) == (32, False)


def test_decode_blocks_are_saved_once_as_they_fill(engines: Any) -> None:
    """Prefill 30 tokens saves 1 block; decoding saves block 1 exactly when token 32 is
    computed and block 2 at token 48; nothing is saved twice."""
    a = engines(0)
    req = FakeRequest("a", prompt(30), with_hashes=False)
    a.prefill(req)
    assert a.counters() == (0, 0, 1, 0, 0)
    saved = []
    for token in range(18):  # positions 30..47
        a.decode(req, 7 + token)
        saved.append(a.counters()[2])
    assert saved == [1, 2] + [2] * 15 + [3]
    b = engines(20)
    assert b.scheduler.get_num_new_matched_tokens(FakeRequest("b", list(req.all_token_ids)
                                                              + [1], with_hashes=False),
                                                  0) == (48, False)


def test_preempted_request_resumes_from_tierd(engines: Any) -> None:
    """A request preempted after a 40-token prefill and 10 decode steps resumes into other
    blocks: 3 blocks load (its 50 tokens leave the last one to compute), the 2 tail tokens are
    recomputed, the KV equals what it was, and block 3 is saved when decode fills it."""
    a = engines(0)
    req = FakeRequest("a", prompt(40))
    a.prefill(req)
    for token in range(10):
        a.decode(req, 100 + token)
    assert a.counters() == (0, 0, 3, 0, 0)
    before = {i: a.block(b).clone() for i, b in enumerate(a.block_ids["a"][:3])}
    computed = a.computed_tokens
    external, ids = a.preempt_and_resume(req)
    assert external == 48 and a.computed_tokens - computed == 2
    assert ids == [4, 5, 6, 7]
    assert all(torch.equal(a.block(ids[i]), before[i]) for i in range(3))
    assert a.counters() == (3, 0, 3, 0, 0)
    for token in range(14):  # positions 50..63: block 3 fills at the last one
        a.decode(req, 200 + token)
    assert a.counters() == (3, 0, 4, 0, 0)


def test_corrupt_slot_is_reported_and_never_written(daemon: RunningDaemon, engines: Any) -> None:
    """Block 3 of 6 is corrupted in the arena: B writes blocks 0-2, reports 3-5 for recompute
    and leaves them untouched; after vLLM's recompute B matches A bit-exact."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    hashes = block_hashes(prompt(100), BS, seed=SEED)
    with TierdClient(socket_path=daemon.socket_path, timeout=10.0) as client:
        engine = client.register_engine(layout_from_vllm_config(a.config), "corrupter")
        got = client.acquire(engine.engine_id, hashes)
        arena = ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
        view = arena.view(engine.geometry.offset(got.slot_ids[3]) + 100, 1)
        view[0] ^= 0xFF
        view.release()
        arena.close()
        client.release(engine.engine_id, got.lease_id)
        client.unregister_engine(engine.engine_id)
    req = FakeRequest("b", prompt(100))
    external, errors = b.prefill(req)
    ids_a, ids_b = a.block_ids["a"], b.block_ids["b"]
    assert external == 96 and errors == set(ids_b[3:6])
    assert b.counters() == (3, 3, 0, 0, 0)
    for i in range(3):
        assert torch.equal(a.block(ids_a[i]), b.block(ids_b[i]))
    for i in range(3, 6):
        assert b.block(ids_b[i]).abs().sum() == 0
    b.recompute_from(req, errors)
    assert b.computed_tokens == 4 + 52
    for block_a, block_b in zip(ids_a, ids_b):
        assert torch.equal(a.block(block_a), b.block(block_b))


class JumpingClock:
    """The daemon's clock, 100 s later at every reading: any lease expires before release."""

    def __init__(self) -> None:
        self._base, self._n = time.monotonic(), itertools.count(1)

    def __call__(self) -> float:
        return self._base + 100.0 * next(self._n)


def test_expired_lease_fails_the_whole_load(daemon: RunningDaemon, engines: Any) -> None:
    """The lease expires on the daemon before B releases it: all 6 blocks are reported and
    none is written, though every checksum would match."""
    a, b = engines(0), engines(20)
    a.prefill(FakeRequest("a", prompt(100)))
    store = daemon.daemon.store
    real_clock = store._clock
    store._clock = JumpingClock()
    try:
        external, errors = b.prefill(FakeRequest("b", prompt(100)))
    finally:
        store._clock = real_clock
    ids_b = b.block_ids["b"]
    assert external == 96 and errors == set(ids_b[:6])
    assert b.counters() == (0, 6, 0, 0, 0)
    assert all(b.block(i).abs().sum() == 0 for i in ids_b[:6])


def test_daemon_down_means_no_match_no_save_then_reconnects(workdir: str) -> None:
    """No daemon at start: 0 matches, 6 planned saves dropped, no exception; once a daemon
    listens (retry_seconds 0) the next request is saved and then matched."""
    socket_path = os.path.join(workdir, "tierd.sock")
    a = FakeVllm(socket_path, 0, retry_seconds=0.0)
    assert a.prefill(FakeRequest("a", prompt(100))) == (0, set())
    assert a.counters() == (0, 0, 0, 0, 6)
    running = start_daemon(workdir)
    try:
        assert a.prefill(FakeRequest("b", prompt(100, salt=1))) == (0, set())
        assert a.counters() == (0, 0, 6, 0, 6)
        assert a.scheduler.get_num_new_matched_tokens(
            FakeRequest("c", prompt(100, salt=1)), 0) == (96, False)
        running.check_integrity()
    finally:
        a.close()
        running.stop()


def test_already_stored_blocks_are_skipped(engines: Any) -> None:
    """Two instances compute the same prompt cold (B with loading off): B's 6 saves are
    skipped as already stored."""
    a, b = engines(0), engines(20, load=False)
    a.prefill(FakeRequest("a", prompt(100)))
    assert b.prefill(FakeRequest("b", prompt(100))) == (0, set())
    assert b.counters() == (0, 0, 0, 6, 0)


def test_bad_extra_config_names_the_known_keys(daemon: RunningDaemon) -> None:
    """An unknown kv_connector_extra_config key is a ValueError listing the valid ones."""
    config = FakeVllmConfig(FakeKVTransferConfig({"socket": daemon.socket_path}))
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key.*socket_path"):
        TierdConnector(config, KVConnectorRole.SCHEDULER)
