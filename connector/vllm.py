"""``TierdConnector``: tierd as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Enable it with::

    vllm serve MODEL --prefix-caching-hash-algo sha256_cbor --kv-transfer-config \\
      '{"kv_connector":"TierdConnector","kv_connector_module_path":"tierd.connector.vllm",
        "kv_role":"kv_both",
        "kv_connector_extra_config":{"socket_path":"/run/user/1000/tierd.sock"}}'

(keys of ``kv_connector_extra_config``: ``TierdVllmConfig``; see docs/vllm.md).

vLLM creates one instance in the scheduler process (role SCHEDULER) and one per worker (role
WORKER); they share nothing but the per-step ``TierdConnectorMetadata``. The scheduler instance
decides (``tierd.connector.vllm_scheduler``), the worker instances move bytes
(``tierd.connector.vllm_worker``, slot byte order in ``tierd.connector.vllm_copy``).

Semantics: best effort and synchronous. ``get_num_new_matched_tokens`` returns
``(tokens, False)``: loads complete inside ``start_load_kv``, so ``wait_for_layer_load`` has nothing
to wait for and ``get_finished`` reports nothing; blocks that could not be loaded are returned by
``get_block_ids_with_load_errors`` in the same step and vLLM recomputes them. Saves complete in
``wait_for_save``, so ``request_finished`` always returns ``(False, None)``: vLLM may free a
finished request's blocks at once. ``requires_kv_delivery`` is False: a lost save is a future miss.
A daemon that is down (at start or later) means 0 matches and no saves, never an exception.

Without vLLM installed the module still imports: it then subclasses the stand-in base classes of
``tierd.connector.vllm_meta`` (same method names and signatures), which is how tests drive it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from .vllm_copy import dtype_name
from .vllm_link import DaemonLink, TierdVllmConfig
from .vllm_meta import (HAVE_VLLM, KVConnectorBase_V1, KVConnectorMetadata,
                                       KVConnectorRole, TierdConnectorMetadata)
from .vllm_scheduler import SchedulerSide
from .vllm_worker import WorkerCounters, WorkerSide
from tierd.daemon.layout import Layout
from tierd.hashing import HASH_ALGOS, BlockHasher

__all__ = ["TierdConnector", "TierdConnectorMetadata", "TierdVllmConfig",
           "layout_from_vllm_config"]

_log = logging.getLogger(__name__)


def layout_from_vllm_config(vllm_config: Any, tp_rank: int = 0) -> Layout:
    """The tierd ``Layout`` of TP rank ``tp_rank`` of the model vLLM serves (per-rank KV heads).
    The scheduler looks blocks up under rank 0's layout, the namespace worker 0 saves into."""
    model, cache, parallel = (vllm_config.model_config, vllm_config.cache_config,
                              vllm_config.parallel_config)
    return Layout(num_layers=int(model.get_num_layers(parallel)),
                  num_kv_heads=int(model.get_num_kv_heads(parallel)),
                  head_size=int(model.get_head_size()),
                  dtype=dtype_name(model.dtype, getattr(cache, "cache_dtype", "auto")),
                  block_size=int(cache.block_size), tp_rank=tp_rank,
                  tp_size=int(parallel.tensor_parallel_size))


def _config_from(vllm_config: Any, kv_transfer_config: Any) -> TierdVllmConfig:
    extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
    theirs = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
    if "hash_algo" not in extra and theirs in HASH_ALGOS:
        extra["hash_algo"] = theirs
    elif theirs is not None and theirs not in HASH_ALGOS:
        _log.warning("vLLM hashes blocks with %r: tierd shares them between vLLM instances with "
                     "the same setting only; use --prefix-caching-hash-algo sha256_cbor", theirs)
    config = TierdVllmConfig.from_extra_config(extra, os.environ)
    BlockHasher(int(vllm_config.cache_config.block_size), algo=config.hash_algo,
                seed=config.hash_seed)  # raises ValueError naming the fix for a bad block size
    return config


def _tp_rank(vllm_config: Any) -> int:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if HAVE_VLLM:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    return int(getattr(vllm_config.parallel_config, "rank", 0)) % size


class TierdConnector(KVConnectorBase_V1):
    """tierd's vLLM connector; see the module doc for semantics. Each method says which side
    (scheduler or worker process) vLLM calls it on; calling the other side's is a bug."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        """Parse ``kv_connector_extra_config`` (``ValueError`` naming the fix if bad). The
        scheduler instance registers with the daemon now; a worker when its caches arrive."""
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = _config_from(vllm_config, self._kv_transfer_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            link = DaemonLink(self._config, layout_from_vllm_config(vllm_config),
                              f"{self._config.engine_name}-scheduler", attach=False)
            link.connect()
            self._scheduler = SchedulerSide(self._config, link)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache, not a hand-off; a dropped save is only a future miss."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: ``save_kv_layer`` runs per layer, which full CUDA graphs would skip."""
        return True

    @property
    def worker_counters(self) -> WorkerCounters | None:
        """Load/save totals of a worker instance (None before ``register_kv_caches``)."""
        return self._worker.counters if self._worker is not None else None

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker: take the per-layer caches (``kv_cache_layout``, uniform layers) and reach
        the daemon. ``ValueError`` naming the fix for a layout tierd cannot store."""
        rank = _tp_rank(self._vllm_config)
        self._worker = WorkerSide(self._config, kv_caches,
                                  getattr(self._vllm_config.cache_config, "cache_dtype", "auto"),
                                  rank, int(self._vllm_config.parallel_config.tensor_parallel_size))
        looked_up = layout_from_vllm_config(self._vllm_config)
        mine = self._worker.link.layout
        if dataclasses.replace(mine, tp_rank=0) != looked_up:
            _log.warning("tierd: the caches (%s) differ from the model config (%s); the scheduler "
                         "looks up under the latter, so loads will miss", mine, looked_up)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker: load this step's planned blocks; synchronous (returns when they are in
        place or reported as errors)."""
        meta = self._step_meta()
        if self._worker is not None and meta is not None and meta.loads:
            self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker: nothing to wait for (``start_load_kv`` is synchronous)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Worker: copy this layer's part of the blocks this step completes into tierd slots."""
        meta = self._step_meta()
        if self._worker is not None and meta is not None:
            self._worker.save_layer(layer_name, kv_layer, meta.saves)

    def wait_for_save(self) -> None:
        """Worker: commit this step's saves (one round trip); vLLM may then reuse the blocks."""
        if self._worker is not None:
            self._worker.finish_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker: (None, None); no transfer outlives its step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker: block ids whose load failed this step (each reported once)."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Either side: unregister from the daemon and unmap the arena."""
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
        """Scheduler: (tokens tierd can supply beyond ``num_computed_tokens``, False). Full
        blocks only, never the last prompt token; one Lookup; 0 when the daemon is down."""
        return self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Scheduler: plan the load of ``num_external_tokens`` into the allocated blocks."""
        self._scheduler_side().after_alloc(request, blocks.get_block_ids()[0],
                                           num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Scheduler: this step's loads and saves, for every worker."""
        return self._scheduler_side().build(scheduler_output)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler: forget the request; (False, None): its blocks may be freed at once."""
        self._scheduler_side().finished(request)
        return False, None

    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side method called on a worker connector"
        return self._scheduler
