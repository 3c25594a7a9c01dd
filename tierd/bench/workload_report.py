"""The figures of `tierd bench workload`, apart from the servers that produce them: one run's
numbers read from `vllm bench serve`'s result JSON or the chat client's latencies, vLLM's and
tierd's hit rates from counter deltas, vLLM's per-request phases from its histograms' deltas, the
cores vLLM's log says it bound, and the summary: medians over the repeats of every (case, arm),
the ratios the targets name with their verdicts, the tierd arms against both vLLM alone with the
cache that fits, and where the compared arms' requests differ. Pure functions of their inputs (no
vLLM, no servers): ``make test`` checks them.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, TypeVar

from tierd.bench.serve_stack import counter, histogram

if TYPE_CHECKING:
    from tierd.bench.workload_hooks import HookTimes
    from tierd.bench.workload_profile import CpuSplit
    from tierd.bench.workload_steps import Steps

T = TypeVar("T")

ARMS = ("vllm-small", "tierd-small", "vllm-big", "tierd-big")
"""vLLM alone and vLLM + tierd, each with a KV cache well below the working set ("small",
the pressure scenario) and with one that holds it all ("big", the fits scenario)."""

CONTROL = "vllm-control"
"""With ``--control``: a second vLLM alone, configured as ``vllm-big`` is, held to the fits
limits against it. Two servers that differ in nothing show what the host's noise alone makes
of a ratio: where the control misses a fits limit too, tierd's miss of it says little about
tierd."""

ARM_TITLES = {"vllm-small": "vLLM alone, small KV", "tierd-small": "vLLM+tierd, small KV",
              "vllm-big": "vLLM alone, KV fits", "tierd-big": "vLLM+tierd, KV fits",
              CONTROL: "vLLM alone, fits (2nd)"}


@dataclass(frozen=True)
class Timing:
    """What the client saw in one run."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    """Completed requests per second."""
    output_throughput: float
    """Generated tokens per second."""
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    cpu_seconds: float = 0.0
    """CPU time the arm's processes used over the run (vLLM's and its daemon's): other load on
    the host moves it less than the wall-clock figures, though still (vLLM's OpenMP threads
    spin at their barriers while a descheduled peer catches up)."""

    queue_ms: float = math.nan
    """vLLM's own mean per request (``vllm_phases``, as the three below): waiting to be
    scheduled (a lookup answered "not yet" keeps a request here a step longer)."""
    prefill_ms: float = math.nan
    """From scheduled to the first token (a load runs in that step)."""
    decode_ms: float = math.nan
    """From the first token to the last (a cost every step pays lands here)."""
    steps_per_request: float = math.nan
    """Engine steps per finished request."""
    computed_tokens: float = math.nan
    """Prompt tokens vLLM computed per finished request: neither its own prefix-cache hits
    nor the connector's (the prefill work a lost hit adds lands here)."""

    @property
    def cpu_ms_per_request(self) -> float:
        return self.cpu_seconds * 1e3 / self.completed if self.completed else float("nan")


@dataclass(frozen=True)
class HitRates:
    """Hit rates over one run, from counter deltas; None where nothing was asked."""

    local: float | None
    """vLLM's own prefix cache: hit tokens / queried tokens."""
    external: float | None
    """vLLM's KV connector: external hit tokens / tokens it asked the connector for."""
    tierd: float | None
    """tierd's own count: hit tokens / queried tokens over the run (daemon stats)."""


@dataclass(frozen=True)
class Sample:
    """One run of one arm in one case and repeat."""

    case: str
    arm: str
    repeat: int
    timing: Timing
    hits: HitRates
    steps: Steps | None = None
    """The engine's steps over the run (``--steps``; else None)."""
    cpu: CpuSplit | None = None
    """The run's CPU time by process (``timing.cpu_seconds`` is its total); None if unread."""
    hooks: HookTimes | None = None
    """The connector hooks' time over the run (``--hook-times``, tierd arms; else None)."""


@dataclass(frozen=True)
class Target:
    """A ratio (``numerator`` arm / ``denominator`` arm of one figure) and its limit."""

    what: str
    numerator: str
    denominator: str
    figure: str
    """A ``Timing`` field."""
    limit: float | None
    """None: shown, not judged."""
    at_least: bool
    """True: the ratio must be >= limit; False: <= limit."""


TARGETS = (
    Target("pressure: tierd small KV / vLLM KV fits, throughput", "tierd-small", "vllm-big",
           "request_throughput", 0.95, True),
    Target("pressure: tierd small KV / vLLM KV fits, TTFT p50", "tierd-small", "vllm-big",
           "ttft_p50_ms", 1.15, False),
    Target("fits: tierd / vLLM alone, throughput", "tierd-big", "vllm-big",
           "request_throughput", 0.97, True),
    Target("fits: tierd / vLLM alone, TTFT p50", "tierd-big", "vllm-big", "ttft_p50_ms",
           1.05, False),
    Target("control: 2nd vLLM alone / vLLM alone, KV fits, throughput", CONTROL, "vllm-big",
           "request_throughput", 0.97, True),
    Target("control: 2nd vLLM alone / vLLM alone, KV fits, TTFT p50", CONTROL, "vllm-big",
           "ttft_p50_ms", 1.05, False),
    Target("pressure: tierd small KV / vLLM KV fits, CPU per request", "tierd-small",
           "vllm-big", "cpu_ms_per_request", None, False),
    Target("fits: tierd / vLLM alone, CPU per request", "tierd-big", "vllm-big",
           "cpu_ms_per_request", None, False),
    Target("gain: tierd / vLLM alone, small KV, CPU per request", "tierd-small", "vllm-small",
           "cpu_ms_per_request", None, False),
    Target("gain: tierd / vLLM alone, small KV, throughput", "tierd-small", "vllm-small",
           "request_throughput", None, True),
    Target("gain: tierd / vLLM alone, small KV, TTFT p50", "tierd-small", "vllm-small",
           "ttft_p50_ms", None, False),
)


def from_bench_serve(result: dict[str, object]) -> Timing:
    """A ``Timing`` from `vllm bench serve --save-result`'s JSON (run with
    ``--metric-percentiles 50,90,99``; ValueError naming the flag when a percentile is missing)."""
    for key in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"):
        if key not in result:
            raise ValueError(f"vllm bench serve's result has no {key}: run it with "
                             "--percentile-metrics ttft --metric-percentiles 50,90,99")

    def num(key: str) -> float:
        value = result.get(key)
        assert isinstance(value, int | float), f"{key} is {value!r} in the result"
        return float(value)

    completed = int(num("completed"))
    failed = int(num("failed")) if "failed" in result else int(num("num_prompts")) - completed
    return Timing(completed, failed, num("duration"), num("request_throughput"),
                  num("output_throughput"), num("p50_ttft_ms"), num("p90_ttft_ms"),
                  num("p99_ttft_ms"))


def from_latencies(ttfts_s: Sequence[float], output_tokens: int, failed: int,
                   duration_s: float) -> Timing:
    """A ``Timing`` from the chat client: the TTFT of every completed request (seconds), the
    tokens they generated, the requests that failed and the run's wall time."""
    assert duration_s > 0, "a run takes time"
    ms = [t * 1e3 for t in ttfts_s]
    return Timing(len(ms), failed, duration_s, len(ms) / duration_s, output_tokens / duration_s,
                  percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile, linear between the closest ranks (numpy's default); NaN for
    no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _rate(hits: float, queries: float) -> float | None:
    return hits / queries if queries > 0 else None


def vllm_hit_rates(before: str, after: str) -> tuple[float | None, float | None]:
    """(local, external) hit rates between two of vLLM's ``/metrics`` expositions."""
    def delta(name: str) -> float:
        return counter(after, name) - counter(before, name)
    return (_rate(delta("vllm:prefix_cache_hits"), delta("vllm:prefix_cache_queries")),
            _rate(delta("vllm:external_prefix_cache_hits"),
                  delta("vllm:external_prefix_cache_queries")))


PHASES = {"queue_ms": "vllm:request_queue_time_seconds",
          "prefill_ms": "vllm:request_prefill_time_seconds",
          "decode_ms": "vllm:request_decode_time_seconds"}
"""``Phases`` and ``Timing`` field -> the vLLM histogram (seconds per request) it is the mean
of."""


@dataclass(frozen=True)
class Phases:
    """vLLM's own per-request means over a run (``Timing``'s fields of the same names)."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    steps_per_request: float
    computed_tokens: float


def vllm_phases(before: str, after: str) -> Phases:
    """vLLM's own per-request means between two of its ``/metrics`` expositions, in ms, its
    engine steps and the prompt tokens it computed per finished request (NaN where no request
    finished)."""
    def delta(name: str) -> tuple[float, float]:
        (sum_after, count_after), (sum_before, count_before) = (histogram(after, name),
                                                                histogram(before, name))
        return sum_after - sum_before, count_after - count_before
    def ms(name: str) -> float:
        seconds, count = delta(name)
        return seconds * 1e3 / count if count > 0 else math.nan
    finished = delta("vllm:e2e_request_latency_seconds")[1]
    steps = delta("vllm:iteration_tokens_total")[1]
    computed, counted = delta("vllm:request_prefill_kv_computed_tokens")
    return Phases(ms(PHASES["queue_ms"]), ms(PHASES["prefill_ms"]), ms(PHASES["decode_ms"]),
                  steps / finished if finished > 0 else math.nan,
                  computed / counted if counted > 0 else math.nan)


def tierd_hit_rate(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """tierd's hit ratio between two (query tokens, hit tokens) readings of its stats."""
    return _rate(after[1] - before[1], after[0] - before[0])


_RESERVE = re.compile(r"reserve_cpu_num=(\d+)")
_CORES = re.compile(r"local_rank=0, core ids=\[([\d, ]*)\]")


def bound_cores(log: str) -> tuple[int, list[int]] | None:
    """(reserve_cpu_num, core ids of rank 0) from the last OpenMP binding report in a
    `vllm serve` log (vLLM's CPU build); None if the log has none."""
    reserve, cores = _RESERVE.findall(log), _CORES.findall(log)
    if not reserve or not cores:
        return None
    return int(reserve[-1]), [int(c) for c in cores[-1].split(",") if c.strip()]


def medians(samples: Iterable[Sample]) -> dict[tuple[str, str], Timing]:
    """The median of every ``Timing`` field over the repeats of each (case, arm)."""
    groups: dict[tuple[str, str], list[Timing]] = {}
    for s in samples:
        groups.setdefault((s.case, s.arm), []).append(s.timing)
    out = {}
    for key, timings in groups.items():
        fields = {name: statistics.median(getattr(t, name) for t in timings)
                  for name in Timing.__dataclass_fields__}
        fields["completed"] = int(fields["completed"])
        fields["failed"] = int(fields["failed"])
        out[key] = Timing(**fields)
    return out


@dataclass(frozen=True)
class Verdict:
    target: Target
    case: str
    ratios: list[float]
    """One ratio per repeat (the two arms' runs of that repeat)."""

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def met(self) -> bool | None:
        """None when the target has no limit."""
        if self.target.limit is None:
            return None
        return self._meets(self.median)

    @property
    def straddled(self) -> bool:
        """Some repeat's ratio meets the limit and another's misses it: the host's noise
        between repeats is larger than the margin, so this run cannot settle the verdict
        (more repeats, or a quieter host, can)."""
        if self.target.limit is None:
            return False
        return len({self._meets(r) for r in self.ratios}) == 2

    def _meets(self, ratio: float) -> bool:
        limit = self.target.limit
        assert limit is not None, "a shown ratio has no limit"
        return ratio >= limit if self.target.at_least else ratio <= limit


def group(target: Target) -> str:
    """The scenario a target belongs to: "pressure", "fits", "gain" or "control" (judged
    where "fits" is)."""
    return target.what.partition(":")[0]


def verdicts(samples: Sequence[Sample], judged: Mapping[str, Collection[str]]
             ) -> list[Verdict]:
    """Every target on every case that ran both its arms: the ratio of the two arms' figures
    in each repeat, judged on their median. A target keeps its limit only where ``judged``
    names its ``group`` for that case; elsewhere its ratios are shown (a case that exists to
    show how the gain varies, or one whose small cache cannot hold the running batch)."""
    runs = {(s.case, s.arm, s.repeat): s.timing for s in samples}
    cases = list(dict.fromkeys(s.case for s in samples))
    repeats = sorted({s.repeat for s in samples})
    out = []
    for case in cases:
        for target in TARGETS:
            ratios = []
            for r in repeats:
                top = runs.get((case, target.numerator, r))
                bottom = runs.get((case, target.denominator, r))
                if top is None or bottom is None:
                    continue
                below = getattr(bottom, target.figure)
                if below > 0:  # not NaN nor 0: no request completed, or no CPU time read
                    ratios.append(getattr(top, target.figure) / below)
            if ratios:
                scenario = "fits" if group(target) == "control" else group(target)
                if scenario not in judged.get(case, ()) and target.limit is not None:
                    target = Target(target.what, target.numerator, target.denominator,
                                    target.figure, None, target.at_least)
                out.append(Verdict(target, case, ratios))
    return out


def compared_runs(samples: Sequence[Sample], of: Callable[[Sample], T | None]
                  ) -> Iterator[tuple[str, str, str, list[tuple[T, T]]]]:
    """Per case and pair of arms a target compares (each pair once), in the samples' order:
    ``(case, first arm, second arm, [(of(first's run), of(second's run)) per repeat])`` over
    the repeats where both arms ran and ``of`` gave both a value (None: the run has none);
    pairs with no such repeat are left out."""
    runs = {(s.case, s.arm, s.repeat): value for s in samples if (value := of(s)) is not None}
    repeats = sorted({s.repeat for s in samples})
    pairs = list(dict.fromkeys((t.numerator, t.denominator) for t in TARGETS))
    for case in dict.fromkeys(s.case for s in samples):
        for top_arm, bottom_arm in pairs:
            both = [(runs[case, top_arm, r], runs[case, bottom_arm, r]) for r in repeats
                    if (case, top_arm, r) in runs and (case, bottom_arm, r) in runs]
            if both:
                yield case, top_arm, bottom_arm, both


def phase_lines(samples: Sequence[Sample]) -> list[str]:
    """Per case and pair of arms a target compares: how much longer (or shorter) a request of
    the first arm spent in each of vLLM's phases than one of the second, and both arms' steps
    and prompt tokens computed per request (medians over the repeats of each repeat's
    difference; of each arm's figure for the last two)."""
    lines = []
    for case, top_arm, bottom_arm, both in compared_runs(samples, lambda s: s.timing):
        parts = [f"{field.removesuffix('_ms')} " + format(statistics.median(
            getattr(a, field) - getattr(b, field) for a, b in both), "+.1f")
            for field in PHASES if not math.isnan(getattr(both[0][0], field))]
        steps, computed = ([statistics.median(getattr(t, field) for t in side)
                            for side in zip(*both)]
                           for field in ("steps_per_request", "computed_tokens"))
        lines.append(f"  {case:<24} {ARM_TITLES[top_arm]} - {ARM_TITLES[bottom_arm]}: "
                     f"{', '.join(parts)} ms per request; steps per request "
                     f"{steps[0]:.1f} vs {steps[1]:.1f}; prompt tokens computed per request "
                     f"{computed[0]:.0f} vs {computed[1]:.0f}")
    return lines


def as_json(sample: Sample) -> dict[str, object]:
    """``sample`` as JSON values (``--json``): a figure that is NaN (no request finished) as
    null, which strict JSON readers take."""
    run = asdict(sample)
    for part in ("timing", "steps", "cpu"):
        if run[part] is not None:
            run[part] = {name: None if isinstance(value, float) and math.isnan(value) else value
                         for name, value in run[part].items()}
    return run


def _pct(value: float | None) -> str:
    return "   -" if value is None else f"{value * 100:3.0f}%"


def table(samples: Sequence[Sample]) -> list[str]:
    """One line per (case, arm): medians over the repeats (vLLM's per-request phases in ms),
    hit rates of each repeat."""
    lines = [f"{'case':<24} {'arm':<22} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} "
             f"{'p90':>8} {'p99':>8} {'CPU/req':>8} {'queue/prefill/decode':>20} {'fail':>4}  "
             "hit rates per repeat: "
             "vLLM local / vLLM external / tierd"]
    med = medians(samples)
    for (case, arm), t in med.items():
        hits = "  ".join(f"{_pct(s.hits.local)}/{_pct(s.hits.external)}/{_pct(s.hits.tierd)}"
                         for s in samples if (s.case, s.arm) == (case, arm))
        failed = sum(s.timing.failed for s in samples if (s.case, s.arm) == (case, arm))
        lines.append(f"{case:<24} {ARM_TITLES.get(arm, arm):<22} {t.request_throughput:6.2f} "
                     f"{t.output_throughput:7.1f} {t.ttft_p50_ms:7.0f}ms {t.ttft_p90_ms:6.0f}ms "
                     f"{t.ttft_p99_ms:6.0f}ms {t.cpu_ms_per_request:6.0f}ms "
                     f"{t.queue_ms:5.1f}/{t.prefill_ms:5.1f}/{t.decode_ms:5.1f}ms "
                     f"{failed:4d}  {hits}")
    return lines


def summary(found: Sequence[Verdict], failures: int) -> tuple[bool, str]:
    """(every judged target met and no request failed, the closing line). The control's
    verdicts are counted apart: they judge the host, not tierd."""
    judged = [v for v in found if v.met is not None and group(v.target) != "control"]
    ok = failures == 0 and all(v.met for v in judged)
    line = (f"failed requests: {failures}; targets judged: {len(judged)}, missed: "
            f"{sum(not v.met for v in judged)}; straddled by their repeats (unsettled by this "
            f"run): {sum(v.straddled for v in judged)}")
    controls = [v for v in found if v.met is not None and group(v.target) == "control"]
    if controls:
        by_figure: dict[str, list[float]] = {}
        for v in controls:
            by_figure.setdefault(v.target.what.rpartition(", ")[2], []).extend(v.ratios)
        spreads = ", ".join(f"{figure} {min(r):.2f}-{max(r):.2f}"
                            for figure, r in by_figure.items())
        line += (f"; the control (two identical vLLM alone, held to the fits limits) missed "
                 f"{sum(not v.met for v in controls)} of {len(controls)} (its repeats: "
                 f"{spreads})")
    return ok, line + f" -> {'met' if ok else 'NOT met'}"


AGAINST_BOTH = (("pressure", "tierd-small", "tierd small KV"), ("fits", "tierd-big", "tierd"))
"""The targets ``against_both`` estimates: (group, arm, its title). Both compare a tierd arm
with vLLM alone with the cache that fits, which ``--control`` runs twice."""

BOTH_FIGURES = {"request_throughput": "throughput", "ttft_p50_ms": "TTFT p50"}
"""The figures ``against_both`` estimates (a ``Timing`` field: its title)."""

INTERVAL_REPEATS = 5
"""Repeats below which ``against_both`` prints their range, not an interval (a bootstrap over a
handful of values is narrower than what it estimates)."""


def against_both(samples: Sequence[Sample], judged: Mapping[str, Collection[str]],
                 resamples: int = 4000) -> list[str]:
    """With the control: each tierd arm of ``AGAINST_BOTH`` against both vLLM alone with the
    cache that fits at once, over the cases where ``judged`` (case -> groups) judges its group;
    a line per figure of ``BOTH_FIGURES``, none without the control. In every repeat and case,
    the arm's figure over the geometric mean of the two vLLM alone's (each server's speed is a
    draw of its own, so two baselines halve that part of the noise); per repeat the geometric
    mean over its cases (they share the repeat's servers), then over the repeats, with the 95%
    bootstrap interval over the repeats (a fixed seed: the same runs give the same line; their
    range below ``INTERVAL_REPEATS``). Not a verdict: where the target's ratio lies, and how
    narrowly this run places it."""
    runs = {(s.case, s.repeat, s.arm): s.timing for s in samples}
    lines = []
    for group, arm, title in AGAINST_BOTH:
        for figure, figure_title in BOTH_FIGURES.items():
            per_repeat: dict[int, list[float]] = {}
            for (case, repeat, which), timing in runs.items():
                first = runs.get((case, repeat, "vllm-big"))
                second = runs.get((case, repeat, CONTROL))
                if (which != arm or group not in judged.get(case, ()) or first is None
                        or second is None):
                    continue
                values = [getattr(t, figure) for t in (timing, first, second)]
                if all(v > 0 for v in values):  # NaN (no request finished) is not
                    logs = [math.log(v) for v in values]
                    per_repeat.setdefault(repeat, []).append(logs[0] - (logs[1] + logs[2]) / 2)
            if per_repeat:
                lines.append(f"  {group}: {title} / both, {figure_title}: "
                             + _estimate(per_repeat, resamples))
    return lines


def _estimate(per_repeat: Mapping[int, list[float]], resamples: int) -> str:
    """``against_both``'s estimate from each repeat's log ratios, with its interval."""
    means = [statistics.fmean(v) for _, v in sorted(per_repeat.items())]
    if len(means) >= INTERVAL_REPEATS:
        rng = random.Random(0)
        drawn = sorted(statistics.fmean(rng.choices(means, k=len(means)))
                       for _ in range(resamples))
        low, high = drawn[int(0.025 * resamples)], drawn[int(0.975 * resamples) - 1]
        spread = f"95% interval {math.exp(low):.3f}-{math.exp(high):.3f}"
    else:
        spread = (f"the repeats {math.exp(min(means)):.3f}-{math.exp(max(means)):.3f} (an "
                  f"interval needs {INTERVAL_REPEATS} repeats)")
    return (f"{math.exp(statistics.fmean(means)):.3f}x, {spread} over {len(means)} repeats "
            f"({sum(map(len, per_repeat.values()))} runs)")


def verdict_lines(found: Sequence[Verdict]) -> list[str]:
    lines = []
    for v in found:
        t = v.target
        spread = ", ".join(f"{r:.2f}" for r in v.ratios)
        if v.met is None:
            mark = ""
        else:
            sign = ">=" if t.at_least else "<="
            mark = (f" (limit {sign} {t.limit}) -> {'met' if v.met else 'MISSED'}"
                    + (", the repeats straddle the limit" if v.straddled else ""))
        lines.append(f"  {v.case:<24} {t.what}: {v.median:.2f} [{spread}]{mark}")
    return lines
