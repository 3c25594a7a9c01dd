"""The node's metrics (one Prometheus registry per NodeStore) and the ``stats`` snapshot.

Metric names (all in ``NodeMetrics.registry``, never the global registry):

- ``tierd_prefix_cache_queries_total`` tokens asked about by ``lookup``;
  ``tierd_prefix_cache_hits_total{tier}`` tokens of the hit prefix, by the tier reported.
- ``tierd_tier_used_blocks{tier}``, ``tierd_tier_capacity_blocks{tier}``,
  ``tierd_tier_used_bytes{tier}``, ``tierd_tier_capacity_bytes{tier}``,
  ``tierd_tier_pinned_blocks{tier}``, ``tierd_tier_occupancy_ratio{tier}`` (gauges, refreshed by
  every ``stats()`` and ``maintain()``); ``tierd_hbm_blocks{engine}``; ``tierd_ssd_healthy``.
- Read from the SSD store at each scrape (``watch_ssd``): ``tierd_ssd_write_errors_total{error}``
  (``no_space``: ENOSPC or EDQUOT, which lower the bound; ``other``: which make the tier
  unhealthy), ``tierd_ssd_bound_bytes`` (the effective bound of live records: lower than
  ``tierd_ssd_full_bound_bytes`` while a full disk holds it down), ``tierd_ssd_file_bytes``
  (the segment files: live records and garbage).
- ``tierd_evictions_total{tier}`` (a block's copy in that tier dropped with no copy below),
  ``tierd_demotions_total`` (DRAM copy dropped, SSD copy kept), ``tierd_promotions_total``
  (SSD read into DRAM), ``tierd_checksum_failures_total{tier}``,
  ``tierd_lease_expiries_total{kind}`` (read | write).
- ``tierd_persisted_blocks_total{how}`` DRAM blocks given an SSD copy by the write-behind
  (``write_behind``) or at a graceful stop (``stop``); ``tierd_write_behind_lag_seconds`` how
  long the oldest block waiting for the write-behind has waited (above ``write_behind_seconds``:
  the disk does not keep up with the commits).
- Histograms (seconds): ``tierd_block_lifetime_seconds`` (first commit to leaving the node),
  ``tierd_block_idle_before_evict_seconds`` (last access to leaving the node),
  ``tierd_block_reuse_gap_seconds`` (last access to the next acquire hit, or to the re-store of a
  recently evicted block), ``tierd_rpc_latency_seconds{method}`` (observed by the gRPC edge).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

AGE_BUCKETS: tuple[float, ...] = (
    0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400,
    math.inf)
RPC_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, math.inf)


class NodeMetrics:
    """Every metric of one node, registered in its own ``registry`` (serve it with
    ``prometheus_client.start_http_server(port, registry=metrics.registry)``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.counts = NodeCounts()
        r.register(_CountsCollector(self.counts))
        self.used_blocks = Gauge("tierd_tier_used_blocks", "Blocks held", ["tier"], registry=r)
        self.capacity_blocks = Gauge("tierd_tier_capacity_blocks", "Blocks the tier can hold",
                                     ["tier"], registry=r)
        self.used_bytes = Gauge("tierd_tier_used_bytes", "Bytes held", ["tier"], registry=r)
        self.capacity_bytes = Gauge("tierd_tier_capacity_bytes", "Byte bound", ["tier"],
                                    registry=r)
        self.pinned_blocks = Gauge("tierd_tier_pinned_blocks", "Blocks under a lease", ["tier"],
                                   registry=r)
        self.occupancy = Gauge("tierd_tier_occupancy_ratio", "used_bytes / capacity_bytes",
                               ["tier"], registry=r)
        self.hbm_blocks = Gauge("tierd_hbm_blocks", "Blocks an engine reports in its GPU pool",
                                ["engine"], registry=r)
        self.ssd_healthy = Gauge("tierd_ssd_healthy", "1 if the SSD tier is in use", registry=r)
        self.persisted = Counter("tierd_persisted_blocks", "DRAM blocks written to SSD by the "
                                 "write-behind or at a graceful stop", ["how"], registry=r)
        self.write_behind_lag = Gauge("tierd_write_behind_lag_seconds", "Wait of the oldest "
                                      "block not yet written behind", registry=r)
        self.block_lifetime = AgeHistogram("tierd_block_lifetime_seconds",
                                           "First commit to leaving the node", r)
        self.idle_before_evict = AgeHistogram("tierd_block_idle_before_evict_seconds",
                                              "Last access to leaving the node", r)
        self.reuse_gap = AgeHistogram("tierd_block_reuse_gap_seconds",
                                      "Last access to the next use", r)
        self.rpc_latency = Histogram("tierd_rpc_latency_seconds", "Server-side RPC latency",
                                     ["method"], buckets=RPC_BUCKETS, registry=r)


    def watch_ssd(self, store: SsdReadings) -> None:
        """Export the SSD store's write errors and bounds, read at each scrape."""
        self.registry.register(_SsdCollector(store))

    def set_gauges(self, tiers: dict[str, TierStats], hbm: dict[str, int],
                   ssd_healthy: bool) -> None:
        """Set every occupancy gauge from a stats snapshot (engines gone drop their series)."""
        for tier, t in tiers.items():
            self.used_blocks.labels(tier).set(t.used_blocks)
            self.capacity_blocks.labels(tier).set(t.capacity_blocks)
            self.used_bytes.labels(tier).set(t.used_bytes)
            self.capacity_bytes.labels(tier).set(t.capacity_bytes)
            self.pinned_blocks.labels(tier).set(t.pinned_blocks)
            self.occupancy.labels(tier).set(t.used_bytes / t.capacity_bytes
                                            if t.capacity_bytes else 0.0)
        self.hbm_blocks.clear()
        for engine, count in hbm.items():
            self.hbm_blocks.labels(engine).set(count)
        self.ssd_healthy.set(1.0 if ssd_healthy else 0.0)

class SsdReadings(Protocol):
    """What ``watch_ssd`` reads from the SSD store (``tierd.daemon.ssd.SsdStore``)."""

    write_errors: int
    no_space_errors: int

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def full_bytes(self) -> int: ...

    @property
    def physical_bytes(self) -> int: ...


class _SsdCollector:
    """The SSD store's counters as Prometheus families, read when scraped, on the metrics
    server's thread (the event loop is the store's only writer; a scrape reads a few ints and
    sums a copy of the segment sizes)."""

    def __init__(self, store: SsdReadings) -> None:
        self._store = store

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        return list(self.collect())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._store
        errors = CounterMetricFamily("tierd_ssd_write_errors", "SSD record writes that failed",
                                     labels=["error"])
        errors.add_metric(["no_space"], s.no_space_errors)
        errors.add_metric(["other"], s.write_errors - s.no_space_errors)
        yield errors
        yield GaugeMetricFamily("tierd_ssd_bound_bytes", "Effective bound of live SSD records",
                                value=s.capacity_bytes)
        yield GaugeMetricFamily("tierd_ssd_full_bound_bytes", "Bound of live SSD records when "
                                "the disk has room", value=s.full_bytes)
        yield GaugeMetricFamily("tierd_ssd_file_bytes", "Bytes of the SSD segment files",
                                value=s.physical_bytes)


@dataclass(slots=True)
class NodeCounts:
    """The node's running totals: the one copy behind both ``NodeStats`` and the Prometheus
    counters (``_CountsCollector`` reads them at each scrape). Written on the event loop only."""

    queries: int = 0                                                  # tokens looked up
    hits: collections.Counter[str] = field(default_factory=collections.Counter)  # tier -> tokens
    evictions: collections.Counter[str] = field(default_factory=collections.Counter)  # by tier
    demotions: int = 0
    promotions: int = 0
    checksum_failures: collections.Counter[str] = field(
        default_factory=collections.Counter)                          # tier -> payloads
    lease_expiries: collections.Counter[str] = field(
        default_factory=collections.Counter)                          # "read" | "write" -> leases


class _CountsCollector:
    """``NodeCounts`` as Prometheus counters, read when scraped on the metrics server's thread
    (a few ints and dict copies; the event loop is the only writer)."""

    def __init__(self, counts: NodeCounts) -> None:
        self._counts = counts

    def describe(self) -> list[CounterMetricFamily]:
        return list(self.collect())

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = self._counts
        yield CounterMetricFamily("tierd_prefix_cache_queries", "Tokens looked up",
                                  value=c.queries)
        for name, doc, label, values, known in (
                ("tierd_prefix_cache_hits", "Tokens of the hit prefix, by tier", "tier", c.hits,
                 ("hbm", "dram", "ssd")),
                ("tierd_evictions", "Blocks dropped from a tier with no copy below it", "tier",
                 c.evictions, ("dram", "ssd")),
                ("tierd_checksum_failures", "Payloads that failed their checksum (served as "
                 "misses)", "tier", c.checksum_failures, ("dram", "ssd")),
                ("tierd_lease_expiries", "Leases that passed their deadline", "kind",
                 c.lease_expiries, ("read", "write"))):
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, n in sorted({**dict.fromkeys(known, 0), **dict(values)}.items()):
                family.add_metric([value], n)
            yield family
        yield CounterMetricFamily("tierd_demotions", "DRAM copies dropped with an SSD copy kept",
                                  value=c.demotions)
        yield CounterMetricFamily("tierd_promotions", "SSD blocks read into DRAM",
                                  value=c.promotions)


class AgeHistogram:
    """A seconds histogram cheap enough to observe once per block on the hot path (a bisect, no
    lock; the event loop is its only writer), exported as a Prometheus histogram."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [b for b in AGE_BUCKETS if not math.isinf(b)]
        self.counts = [0] * (len(self.bounds) + 1)   # last: above every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def observe_many(self, seconds: Iterable[float]) -> None:
        """Observe each value, a negative one as 0. A run of equal values (the blocks of one
        chain, committed or last acquired together) costs one bisect."""
        for value, run in itertools.groupby(seconds):
            n, value = len(list(run)), max(0.0, value)
            self.counts[bisect.bisect_left(self.bounds, value)] += n
            self.sum += value * n

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[HistogramMetricFamily]:
        cumulative = list(itertools.accumulate(self.counts))
        buckets = [(str(float(b)), float(c)) for b, c in zip(self.bounds, cumulative)]
        buckets.append(("+Inf", float(cumulative[-1])))
        family = HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                       sum_value=self.sum)
        return [family]

    def quantile(self, q: float) -> float | None:
        """Prometheus-style ``histogram_quantile``: linear within the bucket holding rank
        ``q * count``; past the last finite bound, that bound. None when nothing was observed."""
        assert 0.0 < q < 1.0, f"quantile must be in (0, 1), got {q}"
        total = sum(self.counts)
        if total == 0:
            return None
        rank = q * total
        lower, below = 0.0, 0
        for bound, count in zip(self.bounds, self.counts):
            if count and below + count >= rank:
                return lower + (bound - lower) * (rank - below) / count
            lower, below = bound, below + count
        return lower


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's occupancy and traffic. DRAM ``used_*`` and ``pinned_blocks`` count reserved
    (not yet committed) slots too: they take arena memory and are held by a lease. ``hits`` and
    ``queries`` are tokens (``queries`` is the node-wide total on every tier)."""

    used_blocks: int
    capacity_blocks: int
    used_bytes: int
    capacity_bytes: int
    pinned_blocks: int
    hits: int
    queries: int
    evictions: int
    demotions: int
    promotions: int


@dataclass(frozen=True, slots=True)
class NodeStats:
    """A snapshot for ``tierd stats``. ``tiers`` has "hbm" (sum over engines; capacity unknown:
    0), "dram" and "ssd". Quantiles are None until something was observed."""

    tiers: dict[str, TierStats]
    hbm_blocks: dict[str, int]           # engine id -> blocks it reports in its GPU pool
    checksum_failures: int
    lease_expiries: int
    ssd_healthy: bool
    hit_ratio: float                     # hit tokens / queried tokens over the node's life
    reuse_gap_p90: float | None
    idle_before_evict_p50: float | None

    @property
    def pool_too_small(self) -> bool:
        """True when blocks are typically reused later than evicted blocks sat idle: reuse-gap
        P90 > idle-before-evict P50 (a bigger pool would have turned those reuses into hits)."""
        return (self.reuse_gap_p90 is not None and self.idle_before_evict_p50 is not None
                and self.reuse_gap_p90 > self.idle_before_evict_p50)

    def reading(self) -> str:
        """What the hit ratio means for the operator, in one line."""
        queries = max((t.queries for t in self.tiers.values()), default=0)
        r = self.hit_ratio
        if queries == 0:
            return "no lookups yet"
        if r > 0.7:
            line = f"hit ratio {r:.2f}: healthy (multi-turn chat / fixed system prompt)"
        elif r >= 0.3:
            line = (f"hit ratio {r:.2f}: ordinary; varying content may sit in front of shared "
                    "text: check prompt template order")
        elif r >= 0.1:
            line = (f"hit ratio {r:.2f}: low; check prompt template order and that shared text "
                    "comes first")
        else:
            line = (f"hit ratio {r:.2f}: if the workload shares prefixes, check routing across "
                    "replicas, pool size (blocks evicted too soon) and timestamps/uuids early "
                    "in prompts; if it does not, prefix caching cannot help")
        if self.pool_too_small:
            line += "; pool too small (reuse gap P90 > idle-before-evict P50)"
        return line
