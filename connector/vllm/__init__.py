"""tierd as a vLLM v1 KV connector: ``TierdConnector`` (see docs/vllm.md).

Enable it with::

    vllm serve MODEL --prefix-caching-hash-algo sha256_cbor --kv-transfer-config \\
      '{"kv_connector":"TierdConnector","kv_connector_module_path":"tierd.connector.vllm",
        "kv_role":"kv_both","kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"socket_path":"/run/tierd/tierd.sock"}}'

One module per role: ``connector`` (the ``KVConnectorBase_V1`` glue), ``scheduler`` (what to
load and save, pins), ``worker`` (the copies, checks, commits), ``kv_tensors`` (vLLM's KV views
and the slot byte order), ``metadata`` (what the two sides tell each other per step), ``stats``
(counters as vLLM's ``KVConnectorStats``), ``link`` (the daemon registration), ``config`` (the
``kv_connector_extra_config`` keys), ``base`` (vLLM's base classes, or stand-ins without vLLM).

Semantics: a best-effort cache with synchronous loads. ``get_num_new_matched_tokens`` answers
``(None, False)`` until its lookup job is done (vLLM asks again next step), then ``(tokens,
False)`` for a hit it has pinned; loads complete inside ``start_load_kv`` (on CUDA
they are queued there, and ``wait_for_layer_load`` waits per layer); blocks that
could not be loaded are returned by ``get_block_ids_with_load_errors`` in the same step (vLLM
recomputes them with ``kv_load_failure_policy: recompute``), and nothing computed on top of them
is saved. A hit still on SSD answers ``None`` (not yet) while the daemon stages it, so vLLM's
scheduler never waits for a disk. Saves are copied out of vLLM's KV within their step (the
Commit lands on a committer thread), so ``request_finished`` returns ``(False, None)``. A daemon
that is down (at start or later) means 0 matches and no saves, never an exception.
"""

from .config import TierdVllmConfig
from .connector import VLLM_VERSIONS_TESTED, TierdConnector, layout_from_vllm_config
from .metadata import TierdConnectorMetadata, TierdWorkerMetadata

__all__ = ["VLLM_VERSIONS_TESTED", "TierdConnector", "TierdConnectorMetadata",
           "TierdVllmConfig", "TierdWorkerMetadata", "layout_from_vllm_config"]
