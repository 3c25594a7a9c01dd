"""The node's insight into its own cache, bundled so the node store holds it in one field:
``why`` answers ``tierd why`` (``tierd.daemon.why``), ``savings`` counts what the cache saved
the engines (``tierd.daemon.savings``). Both read the node's tables and change none of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierd.daemon.engines import EngineTable
from tierd.daemon.hbm import HbmIndex
from tierd.daemon.lru import TierIndex
from tierd.daemon.models import ModelTable
from tierd.daemon.node_types import NodeConfig
from tierd.daemon.savings import Savings
from tierd.daemon.why import Explainer


@dataclass(frozen=True, slots=True)
class Insight:
    why: Explainer
    savings: Savings

    @classmethod
    def over(cls, tiers: TierIndex, hbm: HbmIndex, engines: EngineTable, models: ModelTable,
             clock: Callable[[], float], config: NodeConfig) -> Insight:
        """Build both over the node's tables; the savings hook into ``tiers`` and export their
        counters to the node's registry."""
        return cls(Explainer(tiers, hbm, engines, models, clock, config),
                   Savings(tiers, engines, tiers.metrics.registry, config))

    def check_integrity(self) -> None:
        self.savings.check_integrity()
