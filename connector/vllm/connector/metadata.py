"""What the adapter's two sides tell each other once per step.

Scheduler -> workers: ``TierdConnectorMetadata`` (the step's loads and saves). Workers ->
scheduler: ``TierdWorkerMetadata`` (which loads are done, which failed), merged across TP ranks
by vLLM with ``aggregate``. Both are plain ints, strings and bytes, so they pickle and
msgspec-encode across vLLM's process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True, slots=True)
class PinnedRun:
    """One TP rank's part of the scheduler's pin on a hit: the daemon (the one whose arena is
    named ``arena``) holds ``slot_ids[i]`` for block ``i`` under a lease until at least
    ``deadline`` (``time.monotonic`` of this host: the time the lookup was sent plus the lease's
    lifetime), with checksum ``checksums[i]``. The worker of that rank loads under it, with no
    daemon call of its own; the scheduler releases it once every worker has reported the
    load."""

    arena: str
    slot_ids: list[int]
    checksums: list[int]
    deadline: float


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks of one request to fill from tierd this step: ``block_hashes[i]`` goes into vLLM
    block ``block_ids[i]`` (freshly allocated, consecutive positions of the request's chain).
    The scheduler pinned them when it reported the hit; the pin lasts until every worker has
    reported this load in ``TierdWorkerMetadata.loaded``. ``pinned[r]``: rank ``r``'s part of
    that pin, which its worker loads under (none: each worker acquires the blocks itself).
    ``stream``: a hit with SSD blocks that vLLM loads asynchronously: not pinned by the
    scheduler; each worker acquires it chunk by chunk and copies each chunk as the daemon has
    read it (``streaming``), then reports the request through ``get_finished``. ``probe``: a
    hit the scheduler answered from the presence filter, not pinned: the worker pins it by a
    Probe (the request's counted lookup; its leading DRAM run only, no disk read) and reports
    every block after that run as a load error."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    stream: bool = False
    pinned: list[PinnedRun] = field(default_factory=list)
    probe: bool = False

    def pin_of(self, rank: int, arena: str) -> PinnedRun | None:
        """Rank ``rank``'s part of the scheduler's pin where it lies in ``arena`` (one made in
        another arena, before the daemon restarted, is not usable)."""
        pinned = self.pinned[rank] if rank < len(self.pinned) else None
        return pinned if pinned is not None and pinned.arena == arena else None


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Blocks of one request that this step's forward pass completes: after every layer has
    written them, ``block_ids[i]`` is stored in tierd under ``block_hashes[i]``.
    ``depends_on``: blocks of this step's loads (any request's) in the request's block table
    before them; if one of those fails to load, the save is dropped."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    depends_on: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TierdConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's work for the workers: loads happen in ``start_load_kv`` (before the
    forward pass), saves in ``save_kv_layer`` / ``wait_for_save`` (during and after it).

    ``evicted`` (write-back saves, ``write_back``): full blocks vLLM computed earlier and has
    now given to other tokens; workers save them in the step's first hook, before anything of
    the step writes vLLM's KV (a load into one of them included).
    ``recomputing``: requests whose failed load the scheduler has seen and vLLM has rolled
    back; from this step on their saves are blocks vLLM recomputed, so workers accept them
    again (until then a worker drops every save of a request whose load failed).
    ``failures_seen``: failed blocks the scheduler has taken into account; no later save names
    them in ``depends_on``, so workers may forget them.
    ``step``: this step's number (1, 2, ...), echoed in the workers' report.
    ``prefill_tokens``: prompt tokens this step's forward pass computes (workers time the
    step to measure the engine's prefill speed, ``core.prefill_speed``).
    ``verdict`` (TP > 1 only): ``(step, bad)``: every step up to ``step`` has been reported by
    all ranks; ``bad[request]`` is the last step whose saves of the request sit on a block some
    rank failed to load. Workers commit their held saves of those steps, except those."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    evicted: list[SaveSpec] = field(default_factory=list)
    recomputing: list[str] = field(default_factory=list)
    failures_seen: list[int] = field(default_factory=list)
    step: int = 0
    verdict: tuple[int, dict[str, int]] | None = None
    prefill_tokens: int = 0


@dataclass
class TierdWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's report of the workers. ``loaded``: request -> how many workers ran its
    planned load (the scheduler unpins once all have). ``failed``: vLLM block ids whose load
    failed on some worker (the same ids ``get_block_ids_with_load_errors`` gave vLLM).
    ``step``: the metadata's ``step`` the report is about."""

    loaded: dict[str, int] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    step: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> TierdWorkerMetadata:
        """Merge another worker's report of the same step into this one (returns self)."""
        assert isinstance(other, TierdWorkerMetadata), f"foreign worker metadata {type(other)}"
        for req_id, count in other.loaded.items():
            self.loaded[req_id] = self.loaded.get(req_id, 0) + count
        self.failed |= other.failed
        self.step = max(self.step, other.step)
        return self

    def is_empty(self) -> bool:
        return not self.loaded and not self.failed
