"""What ``TierdHooks`` takes and reports: its config, its counters, and the daemon layout of a
paged pool. Plain values, importable from ``tierd.connector.reference.tierd_hooks`` too."""

from __future__ import annotations

from dataclasses import InitVar, dataclass

from tierd.connector.core.settings import ClientSettings
from tierd.gpu.layout import DTYPE_NAMES, KVCacheSpec
from tierd.model_identity import validate_model_id
from tierd.wire.layout import Layout


def layout_for(spec: KVCacheSpec, model_id: str, tp_rank: int = 0, tp_size: int = 1) -> Layout:
    """The daemon ``Layout`` of a paged pool of model ``model_id``: one pool row is one slot."""
    layout = Layout(spec.num_layers, spec.num_kv_heads, spec.head_size,
                    DTYPE_NAMES[spec.cache_dtype], spec.block_size, tp_rank, tp_size,
                    model_id=model_id)
    assert layout.block_bytes == spec.block_bytes, "pool row and daemon slot sizes disagree"
    return layout


_RENAMED = {"call_timeout_s": "timeout_seconds", "reconnect_min_s": "retry_seconds",
            "reconnect_max_s": "retry_max_seconds"}
"""Keys of earlier versions, refused with a ``ValueError`` naming what they are called now
(``ClientSettings``, the same as the vLLM connector's)."""


@dataclass(frozen=True)
class TierdHooksConfig(ClientSettings):
    """Where the daemon is (``ClientSettings``: ``socket_path``, ``address`` + ``token``,
    ``timeout_seconds``; a lost daemon is retried after ``retry_seconds``, doubling up to
    ``retry_max_seconds``) and how much the hooks may buffer. Staging memory is allocated once
    at ``register_kv_caches``. The earlier keys ``call_timeout_s``, ``reconnect_min_s`` and
    ``reconnect_max_s`` raise ``ValueError`` naming the new ones."""

    engine_name: str = "reference-engine"
    retry_seconds: float = 0.2
    retry_max_seconds: float | None = 5.0
    model_id: str | None = None
    """Overrides the engine's model id (``tierd.model_identity``: derived from the weights).
    Engines with equal ids share blocks: a wrong value serves one model's KV to another."""
    save_staging_bytes: int = 32 << 20
    """Bound of blocks waiting to be written to the daemon; past it new saves are dropped."""
    load_staging_bytes: int = 16 << 20
    """Staging for loads; a longer load is copied in several chunks."""
    max_queued_jobs: int = 256
    save_batch_s: float = 2.0
    """The worker gathers saves and hot-tier reports for up to this long (or until half the
    staging ring is waiting, or ``flush``), then writes the saves with one Reserve and one
    Commit and sends the reports merged into one: fewer round trips beside the engine's
    compute (each round trip costs CPU, engine and daemon together), at the price of other
    engines and routers seeing the blocks up to that much later. 0: send each step's work at
    once."""
    worker_nice: int = 10
    """Niceness added to the worker thread (Linux; 0: none). The worker only does background
    work (copies into the arena, round trips), so on a busy host it runs in the gaps the
    engine's compute leaves instead of taking a core from it."""
    tp_rank: int = 0
    tp_size: int = 1
    call_timeout_s: InitVar[float | None] = None
    reconnect_min_s: InitVar[float | None] = None
    reconnect_max_s: InitVar[float | None] = None

    def __post_init__(self, call_timeout_s: float | None, reconnect_min_s: float | None,
                      reconnect_max_s: float | None) -> None:
        old = {"call_timeout_s": call_timeout_s, "reconnect_min_s": reconnect_min_s,
               "reconnect_max_s": reconnect_max_s}
        for key, value in old.items():
            if value is not None:
                raise ValueError(f"TierdHooksConfig({key}=...) is now {_RENAMED[key]}: use "
                                 f"TierdHooksConfig({_RENAMED[key]}={value!r})")
        self.validate_client()
        if self.model_id is not None:
            validate_model_id(self.model_id)
        if self.retry_seconds <= 0:
            raise ValueError(f"retry_seconds={self.retry_seconds} must be positive")
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice={self.worker_nice} must lie in [0, 19]")
        if self.save_batch_s < 0:
            raise ValueError(f"save_batch_s={self.save_batch_s} must be >= 0 (0: no batching)")
        if self.max_queued_jobs < 1:
            raise ValueError(f"max_queued_jobs={self.max_queued_jobs} must be >= 1")


@dataclass(slots=True)
class TierdHooksStats:
    """Counters. Engine-thread fields and worker fields are written by one thread each."""

    lookups: int = 0
    filtered_lookups: int = 0
    """Lookups answered from the daemon's presence filter (certain misses): no round trip."""
    lookup_hit_blocks: int = 0
    loads: int = 0
    loaded_blocks: int = 0
    failed_load_blocks: int = 0
    checksum_failures: int = 0
    dropped_save_blocks: int = 0
    dropped_jobs: int = 0
    engine_thread_s: float = 0.0
    """Wall seconds the engine thread spent inside the hooks (round trips, copies, checksums):
    time the engine could not compute."""
    # worker thread:
    save_batches: int = 0
    """Reserve/Commit round trips made for saves (each carries every save gathered)."""
    saved_blocks: int = 0
    skipped_stored_blocks: int = 0
    unsaved_blocks: int = 0
    lease_expiries: int = 0
    rpc_errors: int = 0
    connects: int = 0
    disconnects: int = 0
    hot_reports: int = 0
    corrupt_dropped: int = 0
    """Blocks this engine found corrupt that the daemon confirmed and dropped."""
