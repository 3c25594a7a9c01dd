"""What the cache saved: prefill tokens served from each tier, per tenant and model, and the
prefill seconds they saved the engines.

Every block an ``Acquire`` hands to an engine is a block the engine did not prefill. The tier
index tells ``Savings.served`` of each lease's blocks, split by where they came from ("dram":
already in the arena; "ssd": read from SSD for this acquire). A block's tokens saved
``block_size / speed`` seconds, where ``speed`` is the engine's measured prefill speed (its
connector reports it with ``ReportHotBlocks``) or, where none was reported, the node's
``recompute_tokens_per_second`` (the planner's figure for a 7-8B model on one GPU).

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
from tierd.wire.replies import Saved

if TYPE_CHECKING:
    from tierd.daemon.engines import EngineTable
    from tierd.daemon.node_types import NodeConfig
    from tierd.daemon.tier_index import TierIndex


@dataclass(slots=True)
class _Row:
    tokens: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Namespace:
    """What ``served`` needs of a namespace: its two rows, tokens per block, prefill speed."""

    dram: _Row
    ssd: _Row
    block_size: int
    speed: float


class Savings:
    """The savings counters of one node; ``served`` runs on the acquire path (a dict lookup and
    two adds). Not thread-safe but for the scrape, which reads a copy."""

    def __init__(self, tiers: TierIndex, engines: EngineTable, registry: CollectorRegistry,
                 config: NodeConfig, max_rows: int = 4096) -> None:
        self._engines = engines
        self._default_speed = config.recompute_tokens_per_second
        self._max_rows = max_rows
        self._rows: dict[tuple[str, str, Tier], _Row] = {}
        self._of: dict[Namespace, _Namespace] = {}   # namespace -> its rows (a cache)
        self._speed: dict[Namespace, float] = {}     # namespace -> reported tokens per second
        tiers.served = self.served
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
            self._of[namespace].speed = tokens_per_second

    def speed(self, namespace: Namespace) -> float:
        """The prefill speed seconds saved are counted at: reported, else the default."""
        return self._speed.get(namespace, self._default_speed)

    def served(self, namespace: Namespace, dram_blocks: int, ssd_blocks: int) -> None:
        """An acquire of ``namespace``'s engine handed out blocks already in DRAM and blocks
        read from SSD for it."""
        entry = self._of.get(namespace) or self._learn(namespace)
        if entry is None:
            return
        tokens = dram_blocks * entry.block_size
        entry.dram.tokens += tokens
        entry.dram.seconds += tokens / entry.speed
        if ssd_blocks:
            tokens = ssd_blocks * entry.block_size
            entry.ssd.tokens += tokens
            entry.ssd.seconds += tokens / entry.speed

    def rows(self, tenant: str | None = None) -> list[Saved]:
        """Every row (of ``tenant`` only, if given), by tenant, model, tier."""
        return [Saved(t, m, tier, r.tokens, r.seconds)
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
            info.layout.block_size, self.speed(namespace))
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
