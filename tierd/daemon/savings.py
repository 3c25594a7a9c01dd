"""What the cache saved: prefill tokens served from each tier, per tenant and model, and the
prefill seconds they saved the engines.

Every block an ``Acquire`` hands to an engine is a block the engine did not prefill. The store's
insight hooks tell ``Savings.served`` of each lease's blocks (``Insight.tally``), split by where
they came from ("dram": already in the arena; "ssd": read from SSD for this acquire). A block's
tokens saved ``block_size / speed`` seconds, where ``speed`` is the engine's measured prefill
speed (its connector reports it with ``ReportHotBlocks``: "reported") or, where none was
reported, the node's ``recompute_tokens_per_second`` (the planner's figure for a 7-8B model on
one GPU: "planner"). Each row carries the speed its latest tokens were counted at and its
source.

An engine split over tensor-parallel ranks loads each block once per rank (each rank its own
heads, under its own layout): only rank 0's acquires are counted, so a token is saved once per
engine whichever node each rank uses. An acquire that only holds blocks for a later one (vLLM's
scheduler pins what its workers then acquire: ``AcquireRequest.hold``) serves nothing and is
not counted.

Exported as ``tierd_prefill_tokens_served_total{tenant,model,tier}`` and
``tierd_prefill_seconds_saved_total{tenant,model,tier}``, and in ``tierd stats``. Bounded: at
most ``max_rows`` (tenant, model, tier) rows; models past it are not counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from tierd.types import Namespace, Tier
from tierd.wire.replies import Saved, SpeedSource

if TYPE_CHECKING:
    from tierd.daemon.engines import EngineTable
    from tierd.daemon.node_types import NodeConfig


@dataclass(slots=True)
class _Row:
    tokens: int = 0
    seconds: float = 0.0
    speed: float = 0.0
    source: SpeedSource = "planner"


@dataclass(slots=True)
class _Namespace:
    """What ``served`` needs of a namespace: its two rows, tokens per block, prefill speed and
    its source; ``counts``: False for a tensor-parallel rank other than 0 (not counted)."""

    dram: _Row
    ssd: _Row
    block_size: int
    speed: float
    source: SpeedSource
    counts: bool


class Savings:
    """The savings counters of one node; ``served`` runs at ``Insight.tally`` (a dict lookup and
    a few adds). Not thread-safe but for the scrape, which reads a copy."""

    def __init__(self, engines: EngineTable, registry: CollectorRegistry, config: NodeConfig,
                 max_rows: int = 4096) -> None:
        self._engines = engines
        self._default_speed = config.recompute_tokens_per_second
        self._max_rows = max_rows
        self._rows: dict[tuple[str, str, Tier], _Row] = {}
        self._of: dict[Namespace, _Namespace] = {}   # namespace -> its rows (a cache)
        self._speed: dict[Namespace, float] = {}     # namespace -> reported tokens per second
        registry.register(self)

    def report_speed(self, namespace: Namespace, tokens_per_second: float) -> None:
        """An engine of ``namespace`` measured its prefill at ``tokens_per_second`` (> 0)."""
        if not tokens_per_second > 0 or tokens_per_second == float("inf"):
            raise ValueError(f"prefill_tokens_per_second must be a positive number, got "
                             f"{tokens_per_second}")
        if namespace not in self._speed and len(self._speed) >= self._max_rows:
            self._speed.pop(next(iter(self._speed)))
        self._speed[namespace] = tokens_per_second
        if namespace in self._of:
            self._of[namespace].speed, self._of[namespace].source = tokens_per_second, "reported"

    def speed(self, namespace: Namespace) -> tuple[float, SpeedSource]:
        """The prefill speed seconds saved are counted at, and where it comes from: reported,
        else the planner's default."""
        reported = self._speed.get(namespace)
        return (reported, "reported") if reported is not None else (self._default_speed,
                                                                    "planner")

    def served(self, namespace: Namespace, dram_blocks: int, ssd_blocks: int) -> None:
        """An acquire of ``namespace``'s engine handed out blocks already in DRAM and blocks
        read from SSD for it."""
        entry = self._of.get(namespace) or self._learn(namespace)
        if entry is None or not entry.counts:
            return
        for row, blocks in ((entry.dram, dram_blocks), (entry.ssd, ssd_blocks)):
            if blocks:
                tokens = blocks * entry.block_size
                row.tokens += tokens
                row.seconds += tokens / entry.speed
                row.speed, row.source = entry.speed, entry.source

    def rows(self, tenant: str | None = None) -> list[Saved]:
        """Every row (of ``tenant`` only, if given), by tenant, model, tier."""
        return [Saved(t, m, tier, r.tokens, r.seconds, r.speed, r.source)
                for (t, m, tier), r in sorted(list(self._rows.items()))
                if (tenant is None or t == tenant) and r.tokens]

    def check_integrity(self) -> None:
        assert len(self._rows) <= self._max_rows, "savings rows over their bound"
        assert len(self._speed) <= self._max_rows, "reported speeds over their bound"
        assert len(self._of) <= self._max_rows, "namespace cache over its bound"
        rows = set(map(id, self._rows.values()))
        assert all(id(e.dram) in rows and id(e.ssd) in rows for e in self._of.values()), \
            "a namespace counts into a row that is not reported"

    def _learn(self, namespace: Namespace) -> _Namespace | None:
        """The rows, block size and speed of ``namespace`` from its registered engines (an
        acquire comes from one), cached. None past ``max_rows`` rows: not counted."""
        info = next((e for e in self._engines.infos() if e.namespace == namespace), None)
        if info is None:
            return None
        tenant, model = info.tenant, info.layout.model_id
        if (tenant, model, "dram") not in self._rows and len(self._rows) + 2 > self._max_rows:
            return None
        if len(self._of) >= self._max_rows:
            self._of.clear()
        entry = self._of[namespace] = _Namespace(
            self._rows.setdefault((tenant, model, "dram"), _Row()),
            self._rows.setdefault((tenant, model, "ssd"), _Row()),
            info.layout.block_size, *self.speed(namespace), info.layout.tp_rank == 0)
        return entry

    # -- Prometheus collector ----------------------------------------------------------------

    def describe(self) -> list[CounterMetricFamily]:
        return list(self.collect())

    def collect(self) -> Iterator[CounterMetricFamily]:
        tokens = CounterMetricFamily("tierd_prefill_tokens_served",
                                     "Prefill tokens handed to engines from a tier",
                                     labels=["tenant", "model", "tier"])
        seconds = CounterMetricFamily("tierd_prefill_seconds_saved",
                                      "Engine prefill seconds those tokens saved",
                                      labels=["tenant", "model", "tier"])
        for row in self.rows():
            tokens.add_metric([row.tenant, row.model_id, row.tier], row.tokens)
            seconds.add_metric([row.tenant, row.model_id, row.tier], row.seconds)
        yield tokens
        yield seconds
