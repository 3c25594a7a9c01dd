"""The node's insight into its own cache, bundled so the node store holds it in one field:
``why`` answers ``tierd why`` (``tierd.daemon.why``), ``savings`` counts what the cache saved
the engines (``tierd.daemon.savings``), ``shards`` samples lookups for the what-if curves
(``tierd.daemon.shards``). None of them changes the node's tables.

**Off the request path.** The store's hooks only queue: a lookup appends its namespace, keys
and counts (``looked_up``), an acquire the blocks it served (``served``), each an O(1) append.
``tally`` folds the queues into the per-model lookup counters, the savings rows and the
sampler's queue; it runs in each maintenance pass, at each ``Stats`` call (on the event loop,
before the reply is read) and, so memory stays bounded, inline once ``TALLY_BLOCKS`` looked-up
blocks or ``TALLY_EVERY`` acquires are queued. A scrape reads the counters as of the last
tally (at most one maintenance pass old). With ``insight_hooks`` off (``tierd serve
--no-insight-hooks``) the store calls no hook at all: no what-if curves, savings or per-model
hit ratios are kept (``tierd why`` still answers).

The curves are exported as gauges, refreshed by each maintenance pass (``refresh``, on the event
loop: a scrape never reads the sampler while it changes):
``tierd_whatif_hit_ratio{tier,tenant,model,scale}`` (tenant "" and model "*": every lookup),
``tierd_whatif_flattens_at_scale{tier,tenant,model}`` (+Inf while the curve still climbs at
8x), ``tierd_whatif_sample_rate`` and ``tierd_whatif_sampled_blocks``. Per model lookups:
``tierd_model_query_tokens_total`` and ``tierd_model_hit_tokens_total{tenant,model}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily

from tierd.daemon.engines import EngineTable
from tierd.daemon.hbm import HbmIndex
from tierd.daemon.metrics import NodeStats
from tierd.daemon.models import ModelTable
from tierd.daemon.node_types import NodeConfig
from tierd.daemon.savings import Savings
from tierd.daemon.shards import Label, Shards
from tierd.daemon.tier_index import TierIndex
from tierd.daemon.why import Explainer
from tierd.types import Namespace, NamespacedKey, Tier
from tierd.wire.replies import SCALES, Curve

WHAT_IF_TIERS: tuple[Tier, ...] = ("dram", "ssd")
"""Tiers with a what-if curve (HBM is the engines' own)."""
DRAIN_ON_READ = 4096
"""Most queued blocks a read of the curves (a Stats call) replays on the event loop."""
TALLY_BLOCKS = 4096
"""Blocks of queued lookups before ``looked_up`` tallies them itself (the bound on that queue:
the keys it holds)."""
TALLY_EVERY = 1024
"""Queued acquires before ``served`` tallies them itself (the bound on that queue)."""


class _ModelLookups:
    """``tierd_model_query_tokens_total`` and ``tierd_model_hit_tokens_total`` by tenant and
    model (the model table's counters, read at each scrape), for hit ratios per model."""

    def __init__(self, models: ModelTable) -> None:
        self._models = models

    def describe(self) -> list[CounterMetricFamily]:
        return list(self.collect())

    def collect(self) -> Iterator[CounterMetricFamily]:
        queried = CounterMetricFamily("tierd_model_query_tokens", "Tokens a model's engines "
                                      "looked up", labels=["tenant", "model"])
        hit = CounterMetricFamily("tierd_model_hit_tokens", "Tokens of those found, all tiers",
                                  labels=["tenant", "model"])
        for (tenant, model), (q, h) in sorted(self._models.lookups().items()):
            queried.add_metric([tenant, model], q)
            hit.add_metric([tenant, model], h)
        yield queried
        yield hit


class _Gauges:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.hit_ratio = Gauge("tierd_whatif_hit_ratio", "Estimated hit ratio were the tier "
                               "scale times its size", ["tier", "tenant", "model", "scale"],
                               registry=registry)
        self.flattens = Gauge("tierd_whatif_flattens_at_scale", "Smallest scale past which "
                              "the what-if curve gains under one point up to 8x",
                              ["tier", "tenant", "model"], registry=registry)
        self.rate = Gauge("tierd_whatif_sample_rate", "Share of blocks the what-if sampler follows",
                          registry=registry)
        self.sampled = Gauge("tierd_whatif_sampled_blocks", "Blocks the sampler tracks",
                             registry=registry)


Looked = tuple[Namespace, Sequence[NamespacedKey], int, int]
"""A queued lookup: namespace, keys (chain order), tokens per block, blocks hit."""
Served = tuple[Namespace, int, int]
"""A queued acquire: namespace, blocks served from DRAM, blocks read from SSD for it."""


@dataclass(slots=True)
class Insight:
    why: Explainer
    savings: Savings
    shards: Shards
    models: ModelTable
    _gauges: _Gauges
    _looked: list[Looked] = field(default_factory=list)    # since the last tally
    _served: list[Served] = field(default_factory=list)    # since the last tally
    _looked_blocks: int = 0                                # keys held by _looked

    @classmethod
    def over(cls, tiers: TierIndex, hbm: HbmIndex, engines: EngineTable, models: ModelTable,
             clock: Callable[[], float], config: NodeConfig) -> Insight:
        """Build all three over the node's tables (the store calls the hooks: ``looked_up``,
        ``served``); the counters and gauges join the node's registry."""
        def label_of(namespace: Namespace) -> Label | None:
            model = models.model_of(namespace)
            return (model.tenant, model.model_id) if model is not None else None

        registry = tiers.metrics.registry
        registry.register(_ModelLookups(models))
        return cls(Explainer(tiers, hbm, engines, models, clock, config),
                   Savings(engines, registry, config), Shards(label_of), models,
                   _Gauges(registry))

    def looked_up(self, namespace: Namespace, keys: Sequence[NamespacedKey], block_size: int,
                  hit_blocks: int) -> None:
        """A lookup of ``keys`` (one chain) found its first ``hit_blocks`` held: queued for
        ``tally`` (an append; past ``TALLY_BLOCKS`` queued blocks, the tally itself). ``keys``
        is kept as is: the caller must not change it afterwards."""
        self._looked.append((namespace, keys, block_size, hit_blocks))
        self._looked_blocks += len(keys)
        if self._looked_blocks >= TALLY_BLOCKS:
            self.tally()

    def served(self, namespace: Namespace, dram_blocks: int, ssd_blocks: int) -> None:
        """An acquire of ``namespace``'s engine handed out blocks already in DRAM and blocks
        read from SSD for it: queued for ``tally`` as ``looked_up``."""
        queued = self._served
        queued.append((namespace, dram_blocks, ssd_blocks))
        if len(queued) >= TALLY_EVERY:
            self.tally()

    def tally(self) -> None:
        """Fold the queued hook entries into the per-model lookup counters, the savings rows
        and the sampler's queue (a few dict updates each, no replay: ``Shards.drain`` does
        that). Runs on the event loop."""
        looked, self._looked, self._looked_blocks = self._looked, [], 0
        for namespace, keys, block_size, hit in looked:
            self.models.queried(namespace, len(keys) * block_size, hit * block_size)
            self.shards.accessed(namespace, keys)
        served, self._served = self._served, []
        for namespace, dram, ssd in served:
            self.savings.served(namespace, dram, ssd)

    def what_if(self, stats: NodeStats, tenant: str | None = None) -> list[Curve]:
        """Each tier's curve for every lookup and per model (of ``tenant`` only, if given), at
        the tier's capacity in ``stats``; drains up to ``DRAIN_ON_READ`` queued blocks first
        (the maintenance pass drains the rest: the curves are at most one pass old)."""
        self.tally()
        self.shards.drain(DRAIN_ON_READ)
        labels = [x for x in self.shards.labels() if tenant is None or x[0] == tenant]
        return [curve for tier in WHAT_IF_TIERS if stats.tiers[tier].capacity_blocks
                for curve in self.shards.curves(tier, stats.tiers[tier].capacity_blocks, labels)]

    async def refresh(self, stats: NodeStats) -> None:
        """Drain the sampler (yielding to requests as it goes) and set the what-if gauges (a
        maintenance pass calls it)."""
        self.tally()
        await self.shards.drain_async()
        g = self._gauges
        g.hit_ratio.clear()
        g.flattens.clear()
        for c in self.what_if(stats):
            for scale, ratio in zip(SCALES, c.hit_ratios):
                g.hit_ratio.labels(c.tier, c.tenant, c.model_id, f"{scale:g}").set(ratio)
            g.flattens.labels(c.tier, c.tenant, c.model_id).set(
                math.inf if c.flattens_at is None else c.flattens_at)
        g.rate.set(self.shards.rate)
        g.sampled.set(self.shards.sampled_blocks)

    def check_integrity(self) -> None:
        assert self._looked_blocks < TALLY_BLOCKS and len(self._served) < TALLY_EVERY, \
            "insight hook queues over their bound"
        assert self._looked_blocks == sum(len(k) for _, k, _, _ in self._looked), \
            "queued lookups miscounted"
        self.savings.check_integrity()
        self.shards.check_integrity()
