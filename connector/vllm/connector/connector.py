"""``TierdConnector``: the ``KVConnectorBase_V1`` glue between vLLM and the adapter's halves.

vLLM creates one instance in the scheduler process (role SCHEDULER) and one per worker (role
WORKER); they share nothing but the per-step metadata (``metadata``). The scheduler instance
decides (``scheduler``), the worker instances move bytes (``worker``, byte order in
``kv_tensors``); each method here only forwards to its side.

Semantics: a best-effort cache with synchronous loads. ``get_num_new_matched_tokens`` answers
``(None, False)`` until its lookup job is done (vLLM asks again next step), then ``(tokens,
False)`` for a hit it has pinned; loads complete inside ``start_load_kv`` (on CUDA
they are queued there, and ``wait_for_layer_load`` waits per layer); blocks that
could not be loaded are returned by ``get_block_ids_with_load_errors`` in the same step (vLLM
recomputes them with ``kv_load_failure_policy: recompute``), and nothing computed on top of them
is saved. A hit still on SSD answers ``None`` (not yet) while the daemon stages it, so vLLM's
scheduler never waits for a disk. Saves are copied out of vLLM's KV within their step (the
Commit lands at the next step or from a committer thread), so ``request_finished`` returns
``(False, None)``. A daemon that is down (at start or later) means 0 matches and no saves, never
an exception.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar

import torch

from tierd.connector.core import hook_times
from tierd.connector.core.link import DaemonLink
from tierd.hashing import HASH_ALGOS
from tierd.wire.layout import Layout

from ..config import TierdVllmConfig
from ..identity import model_identity_from_vllm
from .base import (
    HAVE_VLLM,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from .kv_tensors import KV_FORMAT, dtype_name
from .metadata import SaveSpec, TierdConnectorMetadata, TierdWorkerMetadata
from .scheduler import SchedulerSide
from .stats import TierdConnectorStats
from .worker import WorkerSide

_log = logging.getLogger(__name__)

VLLM_VERSIONS_TESTED = ("0.32.0", "0.33.0")
"""vLLM releases tierd's tests run against: 0.33.0 (``make test-vllm``: its scheduler and KV
tensors) and 0.32.0's CPU build (``make test-vllm-serve``: real ``vllm serve``)."""


def layout_from_vllm_config(vllm_config: Any, model_id: str, tp_rank: int = 0) -> Layout:
    """The tierd ``Layout`` of TP rank ``tp_rank`` of the model vLLM serves (per-rank KV heads),
    as the workers will find it in their KV tensors; ``model_id``: its identity
    (``model_identity_from_vllm``)."""
    model, cache, parallel = (vllm_config.model_config, vllm_config.cache_config,
                              vllm_config.parallel_config)
    return Layout(num_layers=int(model.get_num_layers(parallel)),
                  num_kv_heads=int(model.get_num_kv_heads(parallel)),
                  head_size=int(model.get_head_size()),
                  dtype=dtype_name(model.dtype, getattr(cache, "cache_dtype", "auto")),
                  block_size=int(cache.block_size), tp_rank=tp_rank,
                  tp_size=int(parallel.tensor_parallel_size), kv_format=KV_FORMAT,
                  model_id=model_id)


def _config_from(vllm_config: Any, kv_transfer_config: Any) -> TierdVllmConfig:
    """The extra config, its ``model_id`` resolved (derived unless given)."""
    extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
    config = TierdVllmConfig.from_extra_config(extra)
    identity = model_identity_from_vllm(vllm_config, config.model_id)
    _log.info("tierd: model id %s (%s, %.0f ms); engines share blocks only under the same id",
              identity.model_id, identity.source, identity.seconds * 1e3)
    config = replace(config, model_id=identity.model_id)
    theirs = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
    if theirs is not None and theirs not in HASH_ALGOS:
        _log.warning("vLLM hashes blocks with %r: tierd shares them between vLLM instances with "
                     "the same setting only; use --prefix-caching-hash-algo sha256_cbor", theirs)
    if getattr(kv_transfer_config, "kv_load_failure_policy", "fail") == "fail":
        _log.warning("tierd: vLLM's kv_load_failure_policy is 'fail': a block that cannot be "
                     "loaded (the daemon restarted or died mid-request) fails the request; set "
                     "\"kv_load_failure_policy\":\"recompute\" in --kv-transfer-config so vLLM "
                     "recomputes it instead")
    return config


def _tp_rank(vllm_config: Any) -> int:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if HAVE_VLLM:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_tensor_model_parallel_rank())
    return int(getattr(vllm_config.parallel_config, "rank", 0)) % size


def _hit_source(tier: str) -> Any:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return {"dram": CacheHitSource.HOST, "hbm": CacheHitSource.HOST,
            "ssd": CacheHitSource.DISK}.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)


class TierdConnector(KVConnectorBase_V1):
    """tierd's vLLM connector (see the module docstring). Each method says which side
    (scheduler or worker process) vLLM calls it on; calling the other side's is a bug."""

    if HAVE_VLLM:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource as _Source

        _cache_hit_source: ClassVar[Any] = _Source.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        """Parse ``kv_connector_extra_config`` (``ValueError`` naming the fix if bad). The
        scheduler instance registers with the daemon now (one registration per TP rank's
        layout, to pin every rank's blocks); a worker when its caches arrive."""
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = _config_from(vllm_config, self._kv_transfer_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Per layer, vLLM calls two hooks; on a step that saves nothing (most steps) and with
        # host KV (nothing to wait for) they return at once on these.
        self._layer_saves: list[SaveSpec] | None = None  # the bound step's saves, if any
        self._layer_waits = False                       # loads are queued per layer (CUDA)
        if role == KVConnectorRole.SCHEDULER:
            size = int(vllm_config.parallel_config.tensor_parallel_size)
            name = f"{self._config.engine_name}-scheduler"
            model_id = self._model_id
            links = [DaemonLink(self._config, layout_from_vllm_config(vllm_config, model_id, rank),
                                name if rank == 0 else f"{name}-tp{rank}", attach=False,
                                presence=rank == 0)
                     for rank in range(size)]
            for link in links:
                link.connect()
            # Host KV: SSD hits stream (asynchronous loads); CUDA KV: they are staged. A hit
            # answered from the filter may fail its load: only where vLLM then recomputes.
            device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
            recompute = getattr(self._kv_transfer_config, "kv_load_failure_policy",
                                "fail") == "recompute"
            write_back = self._config.save_policy == "write_back"
            if write_back and device != "cpu":
                _log.warning("tierd: save_policy write_back is for host KV; with %s KV blocks "
                             "are written through", device)
            self._scheduler = SchedulerSide(links, load=self._config.load,
                                            save=self._config.save, stream=device == "cpu",
                                            lookup_wait=self._config.lookup_wait_seconds,
                                            from_filter=self._config.answer_from_filter
                                            and recompute,
                                            write_back=write_back and device == "cpu")

    @property
    def _model_id(self) -> str:
        assert self._config.model_id is not None, "_config_from resolves the model id"
        return self._config.model_id

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache, not a hand-off; a dropped save is only a future miss."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: ``save_kv_layer`` runs per layer, which full CUDA graphs would skip."""
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: sleep mode remaps vLLM's KV buffer, and tierd holds views of it; vLLM then
        refuses ``--enable-sleep-mode`` with this connector at start-up."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """None: tierd copies any ``KVCacheLayout`` (slots have one canonical order). Asking for
        a block-major layout would make a block one copy, but FlashAttention and the CPU
        backend (vLLM 0.33's defaults) support none, so vLLM would drop the wish with a
        warning; with layer-major layouts a block is one copy per layer and run of blocks."""
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierdConnectorStats:
        """Rebuild the workers' counters (``TierdConnectorStats.data``) in vLLM's logger."""
        return TierdConnectorStats(data=dict(data or {}))

    @property
    def worker_counters(self) -> TierdConnectorStats | None:
        """Load/save totals of a worker instance (None before ``register_kv_caches``), after
        waiting for the Commits it has handed off."""
        if self._worker is None:
            return None
        self._worker.flush()
        return self._worker.totals

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker: take vLLM's per-layer KV views (any ``KVCacheLayout``, uniform layers) and
        reach the daemon. ``ValueError`` naming the fix for caches tierd cannot store."""
        cache = self._vllm_config.cache_config
        rank = _tp_rank(self._vllm_config)
        self._worker = WorkerSide(self._config, kv_caches, int(cache.block_size),
                                  getattr(cache, "cache_dtype", "auto"), rank,
                                  int(self._vllm_config.parallel_config.tensor_parallel_size))
        self._layer_waits = self._worker.waits_per_layer
        looked_up = layout_from_vllm_config(self._vllm_config, self._model_id, rank)
        if self._worker.link.layout != looked_up:
            _log.warning("tierd: the caches (%s) differ from the model config (%s); the scheduler "
                         "pins under the latter, so loads will miss", self._worker.link.layout,
                         looked_up)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Worker: the step's first hook, before vLLM prepares its inputs: send what the step
        will wait for (the Probes of its probed loads, the Reserve of its saves where no
        synchronous load comes first) and the last steps' Commits (``WorkerSide.begin``), so
        the daemon answers meanwhile. Saves never outlive their step, so preempted requests
        hold nothing here."""
        if self._worker is not None and isinstance(kv_connector_metadata, TierdConnectorMetadata):
            self._worker.begin(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Worker: take this step's metadata right before its forward pass (``begin`` if
        ``handle_preemptions`` did not; ``WorkerSide.bound``)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, TierdConnectorMetadata):
            self._worker.bound(connector_metadata)
            self._layer_saves = connector_metadata.saves or None

    def clear_connector_metadata(self) -> None:
        """Worker: the step is over; its metadata is forgotten."""
        super().clear_connector_metadata()
        self._layer_saves = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker: load this step's planned blocks. On CPU synchronous (returns when they are
        in place or reported as errors); on CUDA the copies are queued on a side stream after
        the checksums (``wait_for_layer_load`` orders the forward pass after them)."""
        meta = self._step_meta()
        if self._worker is not None and meta is not None:
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker: on CUDA, make the forward pass's stream wait until this step's loads of
        ``layer_name`` are in place (the host does not wait); nothing on CPU."""
        if self._layer_waits:
            assert self._worker is not None
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Worker: copy this layer's part of the blocks this step completes into tierd slots
        (from the registered view of ``layer_name``, which ``kv_layer`` is)."""
        saves = self._layer_saves
        if saves is not None:
            assert self._worker is not None
            self._worker.save_layer(layer_name, saves)

    def wait_for_save(self) -> None:
        """Worker: hand this step's Commit over (sent at the next step) and return; the bytes
        are in the arena already, so vLLM may reuse its blocks at once."""
        if self._worker is not None:
            self._worker.finish_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker: (None, requests whose streamed load ended): saves never outlive their step;
        a streamed load's failed blocks are load errors of this same step. Stops the streamed
        loads of ``finished_req_ids`` (aborted) and forgets those requests."""
        if self._worker is None:
            return None, None
        return None, self._worker.finished_loads(finished_req_ids) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker: block ids whose load failed this step (each reported once)."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> TierdConnectorStats | None:
        """Worker: load/save counters since the last call, for vLLM's logs and metrics."""
        return self._worker.take_stats() if self._worker is not None else None

    def build_connector_worker_meta(self) -> TierdWorkerMetadata | None:
        """Worker: this step's report to the scheduler side (loads done, loads failed)."""
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        """Either side: release pins, unregister from the daemon and unmap the arena."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _step_meta(self) -> TierdConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierdConnectorMetadata), f"foreign metadata {type(meta)}"
        return meta

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler: (tokens tierd holds beyond ``num_computed_tokens`` for this request,
        whether they load asynchronously). Full blocks only, never the last prompt token; 0 when
        the daemon is down. A DRAM hit is pinned and loads synchronously; a hit with SSD blocks
        loads asynchronously with host KV (streamed), or is None until staged with CUDA KV."""
        side = self._scheduler_side()
        tokens = side.num_new_matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and side.streams(request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Scheduler: plan the load of ``num_external_tokens`` into the allocated blocks."""
        self._scheduler_side().after_alloc(request, blocks.get_block_ids()[0],
                                           num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any,
                                       num_external_tokens: int) -> dict[Any, int]:
        """Scheduler: the loaded tokens by where tierd held them (DRAM: host, SSD: disk)."""
        out: dict[Any, int] = {}
        for tier, tokens in self._scheduler_side().hit_tiers(request.request_id,
                                                             num_external_tokens).items():
            source = _hit_source(tier)
            out[source] = out.get(source, 0) + tokens
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Scheduler: this step's loads and saves, for every worker."""
        return self._scheduler_side().build(scheduler_output)

    def has_pending_push_work(self) -> bool:
        """Scheduler: True while workers hold Commits that wait for a verdict (TP > 1), so vLLM
        keeps stepping until they land."""
        return self._scheduler is not None and self._scheduler.has_pending_verdicts()

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler: take the workers' report of a step (unpin finished loads, rewind saves
        after a failed one)."""
        report: KVConnectorWorkerMetadata | None = getattr(connector_output,
                                                           "kv_connector_worker_meta", None)
        if isinstance(report, TierdWorkerMetadata):
            self._scheduler_side().on_worker_report(report)

    def reset_cache(self) -> bool:
        """Scheduler: vLLM emptied its prefix cache with ``reset_connector``
        (``/reset_prefix_cache?reset_external=true``): write-back's unsaved blocks are dropped,
        not saved (vLLM no longer vouches for that KV); the daemon's blocks stay, shared with
        every engine of the model. True: done."""
        self._scheduler_side().reset()
        return True

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler: forget the request and release its pin; (False, None): its blocks may be
        freed at once."""
        self._scheduler_side().finished(request)
        return False, None

    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side method called on a worker connector"
        return self._scheduler


SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                   "get_external_cache_hit_sources", "build_connector_meta",
                   "has_pending_push_work", "update_connector_output", "request_finished")
"""The scheduler side's hooks vLLM calls as it runs (timed with ``TIERD_HOOK_TIMES``)."""
WORKER_HOOKS = ("handle_preemptions", "bind_connector_metadata", "start_load_kv",
                "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                "get_block_ids_with_load_errors", "get_kv_connector_stats",
                "build_connector_worker_meta", "clear_connector_metadata")
"""The worker side's hooks vLLM calls at every step (timed with ``TIERD_HOOK_TIMES``)."""

hook_times.install(TierdConnector, SCHEDULER_HOOKS + WORKER_HOOKS)
