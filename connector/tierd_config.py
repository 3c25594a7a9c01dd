"""What ``TierdHooks`` takes and reports: its config, its counters, and the daemon layout of a
paged pool. Plain values, importable from ``tierd.connector.tierd_hooks`` too."""

from __future__ import annotations

from dataclasses import dataclass

from tierd.daemon.layout import Layout
from tierd.gpu.layout import DTYPE_NAMES, KVCacheSpec
from tierd.model_identity import validate_model_id


def layout_for(spec: KVCacheSpec, model_id: str, tp_rank: int = 0, tp_size: int = 1) -> Layout:
    """The daemon ``Layout`` of a paged pool of model ``model_id``: one pool row is one slot."""
    layout = Layout(spec.num_layers, spec.num_kv_heads, spec.head_size,
                    DTYPE_NAMES[spec.cache_dtype], spec.block_size, tp_rank, tp_size,
                    model_id=model_id)
    assert layout.block_bytes == spec.block_bytes, "pool row and daemon slot sizes disagree"
    return layout


@dataclass(frozen=True)
class TierdHooksConfig:
    """Where the daemon is and how much the hooks may buffer.

    ``socket_path`` (default: ``tierd serve``'s default socket) or ``address`` ("host:port",
    needs ``token``); ``token`` selects the tenant. Staging memory is allocated once at
    ``register_kv_caches``."""

    socket_path: str | None = None
    address: str | None = None
    token: str | None = None
    engine_name: str = "reference-engine"
    model_id: str | None = None
    """Overrides the engine's model id (``tierd.model_identity``: derived from the weights).
    Engines with equal ids share blocks: a wrong value serves one model's KV to another."""
    call_timeout_s: float = 5.0
    save_staging_bytes: int = 32 << 20
    """Bound of blocks waiting to be written to the daemon; past it new saves are dropped."""
    load_staging_bytes: int = 16 << 20
    """Staging for loads; a longer load is copied in several chunks."""
    max_queued_jobs: int = 256
    save_batch_s: float = 2.0
    """The worker gathers saves and hot-tier reports for up to this long (or until half the
    staging ring is waiting, or ``flush``), then writes the saves with one Reserve and one
    Commit and sends the reports merged into one: fewer round trips beside the engine's
    compute (a lone round trip costs ~2 ms of CPU, engine and daemon together, on the 2-core
    hosts), at the price of other engines and routers seeing the blocks up to that much
    later. 0: send each step's work at once."""
    worker_nice: int = 10
    """Niceness added to the worker thread (Linux; 0: none). The worker only does background
    work (copies into the arena, round trips), so on a busy host it runs in the gaps the
    engine's compute leaves instead of taking a core from it."""
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 5.0
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.model_id is not None:
            validate_model_id(self.model_id)
        if self.call_timeout_s <= 0 or self.reconnect_min_s <= 0:
            raise ValueError("call_timeout_s and reconnect_min_s must be positive")
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice={self.worker_nice} must lie in [0, 19]")
        if self.save_batch_s < 0:
            raise ValueError(f"save_batch_s={self.save_batch_s} must be >= 0 (0: no batching)")
        if self.reconnect_max_s < self.reconnect_min_s or self.max_queued_jobs < 1:
            raise ValueError("need reconnect_max_s >= reconnect_min_s and max_queued_jobs >= 1")


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
