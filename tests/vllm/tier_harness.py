"""vLLM 0.33's native tiered offloading with ``TierdTier``, driven as vLLM's scheduler drives it.

``TierEngine`` is one vLLM engine's scheduler-side offloading: vLLM's own
``TieringOffloadingSpec(OffloadingConfig(...)).get_manager()`` (a CPU primary tier in a real
``/dev/shm`` region, ``TierdTier`` loaded by ``module_path``), called under the manager's lock in
the order ``OffloadingConnectorScheduler`` calls it: ``on_new_request``, ``prepare_store`` /
``complete_store`` (the GPU -> primary copy is the one part done here by hand: rows written
straight into the primary region), the prefix lookup loop (HIT and HIT_PENDING count, RETRY
defers, MISS stops), ``prepare_load`` / ``complete_load``, ``on_request_finished``, and
``on_schedule_end`` once per step. Only vLLM's worker-side GPU copies are missing (they need
CUDA); the primary rows are what they would read and write.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

import numpy as np
from harness import BLOCK, HEAD, KV_HEADS, LAYERS
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
SLOT = 2 * LAYERS * KV_HEADS * HEAD * BLOCK * 2
"""Bytes of one chunk of the tiny model in fp16, all TP ranks together (6 KiB; a row is 8 KiB)."""


def offloading_config(model_dir: str, tier: dict[str, Any], *, tp: int = 1,
                      cpu_chunks: int = 32, engine_id: str | None = None,
                      events: bool = False, replicated: bool = False,
                      groups: tuple[OffloadingGroupConfig, ...] | None = None
                      ) -> OffloadingConfig:
    """vLLM's ``OffloadingConfig`` of the tiny model at TP ``tp`` (rank 0's view, as the
    scheduler builds it) with ``tier`` as its only secondary tier. ``replicated``: vLLM's
    replicated layout (a pure-MLA model under TP: every rank holds a chunk's whole KV, and a
    row one copy of it); ``groups``: other KV cache groups than the tiny model's one."""
    row = -(-SLOT // 4096) * 4096
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_chunks * row,
             "secondary_tiers": [{"type": "TierdTier", "module_path": "tierd.connector.vllm.tier",
                                  **tier}]}
    if groups is None:
        groups = (OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=LAYER_NAMES,
                                        group_id=0),)
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=SLOT if replicated else SLOT // tp,
        enable_kv_cache_events=events,
        extra_config=extra, engine_id=engine_id or f"tierd-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model_dir, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
        replicated_layout=replicated)


def new_keys(n: int) -> list[OffloadKey]:
    return [make_offload_key(os.urandom(32), 0) for _ in range(n)]


class TierEngine:
    """One engine's offloading manager (module doc)."""

    def __init__(self, model_dir: str, socket_path: str, *, connect: bool = True,
                 **kwargs: Any) -> None:
        """``connect``: wait until the tier has reached the daemon, as a running engine has
        (a tier still starting answers MISS)."""
        tier = {"socket_path": socket_path, "retry_seconds": 0.0, "timeout_seconds": 5.0,
                **kwargs.pop("tier", {})}
        self.config = offloading_config(model_dir, tier, **kwargs)
        self.spec = TieringOffloadingSpec(self.config)
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        if connect:
            assert self.tier.connect(), "no tierd daemon"
        # vLLM 0.33's manager lock (0.32's manager is entered from one thread and has none)
        self.lock = getattr(self.manager, "lock", contextlib.nullcontext())
        self._n = 0

    def rows(self) -> np.ndarray:
        """The primary region as uint8 rows (a fresh view: drop it before ``close``)."""
        return np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    def context(self) -> ReqContext:
        self._n += 1
        return ReqContext(req_id=f"req-{self._n}")

    def step(self) -> None:
        with self.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 30.0) -> None:
        """Step until the manager has nothing in flight."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "the tier kept work pending"
            time.sleep(0.002)

    def store(self, keys: list[OffloadKey], payloads: list[bytes]) -> None:
        """A request computes ``keys``: vLLM stores them into the primary tier (the rows
        written here stand in for its GPU copy), which cascades them to the tier."""
        ctx = self.context()
        with self.lock:
            self.manager.on_new_request(ctx)
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "the primary tier had no room"
        rows = self.rows()
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            data = payloads[keys.index(key)]
            rows[int(chunk), :len(data)] = np.frombuffer(data, dtype=np.uint8)
        del rows
        with self.lock:
            self.manager.complete_store(keys, ctx, True)
            self.manager.on_request_finished(ctx)
        self.settle()

    def lookup(self, keys: list[OffloadKey], ctx: ReqContext, timeout: float = 30.0,
               between: Any = None) -> int:
        """vLLM's prefix lookup, step after step until it answers: chunks that will load."""
        deadline = time.monotonic() + timeout
        while True:
            hits, deferred = 0, False
            with self.lock:
                for key in keys:
                    result = self.manager.lookup(key, ctx)
                    if result is LookupResult.MISS:
                        break
                    hits += 1 if result is not LookupResult.RETRY else 0
                    deferred |= result is not LookupResult.HIT
            if between is not None:
                between()
            self.step()
            if not deferred:
                return hits
            assert time.monotonic() < deadline, "lookups kept answering RETRY/HIT_PENDING"
            time.sleep(0.002)

    def load(self, keys: list[OffloadKey], between: Any = None) -> list[bytes]:
        """A new request with ``keys`` as its prompt's chunks: lookup (promoting from the tier)
        until vLLM would schedule it, then read the hit rows as vLLM's GPU load would."""
        ctx = self.context()
        with self.lock:
            self.manager.on_new_request(ctx)
        hits = self.lookup(keys, ctx, between=between)
        with self.lock:
            spec = self.manager.prepare_load(keys[:hits], ctx)
        rows = self.rows()
        out = [rows[int(chunk), :SLOT].tobytes() for chunk in spec.chunk_ids]
        del rows
        with self.lock:
            self.manager.complete_load(keys[:hits], ctx)
            self.manager.on_request_finished(ctx)
        self.settle()
        return out

    def close(self) -> None:
        self.manager.shutdown()
