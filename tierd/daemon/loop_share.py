"""Each tenant's share of the daemon's event loop: a tenant busy past its share waits briefly,
so a tenant within its share is served first.

Every call runs on one event loop, so a call of one tenant waits while the loop runs another's.
The gRPC edge tells a ``LoopShare`` how long each call of a tenant held the loop (``timed``
measures the steps of the call's coroutine, not the time it spent awaiting SSD reads or hashing
threads); the share keeps, per tenant, those seconds decayed over ``WINDOW_SECONDS``. A tenant
is **over its share** when two or more tenants were active in that window (they held the loop
at least ``ACTIVE_SECONDS``, decayed, or have a call in flight) and its seconds pass an equal
split of all of theirs. A call of a tenant over its share first yields the loop ``YIELDS``
times (calls already queued, of any tenant, go first), then waits, up to ``max_wait`` seconds,
while a call of a tenant within its share is in flight. A lone tenant is never over its share,
and nobody waits with ``max_wait`` 0. Metrics (by tenant name): the loop seconds each tenant
used and the seconds its calls waited.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily

T = TypeVar("T")

WINDOW_SECONDS = 1.0
"""Time constant of the decay of each tenant's loop seconds: what "recently busy" means."""
ACTIVE_SECONDS = 1e-5
"""Decayed loop seconds from which a tenant counts as active (one call of ~0.1 ms stays active
for a few windows)."""
YIELDS = 3
"""Times a call over its share yields the loop before it runs (the gRPC machinery of a call
that arrived meanwhile needs a few loop turns to reach its handler)."""
POLL_SECONDS = 0.0005
"""How often a call over its share looks again whether the calls within their share are done."""


class LoopShare:
    """Loop seconds per tenant and the wait of calls over their share. Not thread-safe: one event
    loop (the metrics collector only reads the totals)."""

    def __init__(self, max_wait: float, clock: Callable[[], float] = time.perf_counter) -> None:
        if max_wait < 0:
            raise ValueError(f"loop_share_wait_seconds must be >= 0, got {max_wait}")
        self.max_wait, self._clock = max_wait, clock
        self._recent: dict[str, float] = {}  # tenant -> loop seconds, decayed to _stamp
        self._stamp = clock()
        self._inflight: Counter[str] = Counter()  # tenant -> calls admitted, not yet finished
        self.loop_seconds: defaultdict[str, float] = defaultdict(float)  # totals, for metrics
        self.throttled_seconds: defaultdict[str, float] = defaultdict(float)

    def over_share(self, tenant: str) -> bool:
        """Whether ``tenant`` used more than an equal split of the loop seconds of the tenants
        active in the window (never while it is the only one active)."""
        recent = self._decayed()
        active = {t for t, s in recent.items() if s >= ACTIVE_SECONDS} | {
            t for t, n in self._inflight.items() if n}
        if tenant not in active or len(active) < 2:
            return False
        return recent.get(tenant, 0.0) > sum(recent.get(t, 0.0) for t in active) / len(active)

    async def admit(self, tenant: str) -> None:
        """Start a call of ``tenant`` (pair with ``finished``): over its share, yield the loop
        and wait (at most ``max_wait``) while a call within its share is in flight. The wait is
        counted in ``throttled_seconds``."""
        if self.max_wait > 0 and self.over_share(tenant):
            start = self._clock()
            for _ in range(YIELDS):
                await asyncio.sleep(0)
            while self._clock() - start < self.max_wait and any(
                    n and t != tenant and not self.over_share(t)
                    for t, n in self._inflight.items()):
                await asyncio.sleep(POLL_SECONDS)
            self.throttled_seconds[tenant] += self._clock() - start
        self._inflight[tenant] += 1

    def finished(self, tenant: str) -> None:
        """A call ``admit`` started has ended (answered or failed)."""
        self._inflight[tenant] -= 1
        if not self._inflight[tenant]:
            del self._inflight[tenant]

    def spent(self, tenant: str, seconds: float) -> None:
        """``tenant``'s call held the loop for ``seconds`` (one step of it)."""
        recent = self._decayed()
        recent[tenant] = recent.get(tenant, 0.0) + seconds
        self.loop_seconds[tenant] += seconds

    def timed(self, tenant: str, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """``coro`` as an awaitable that adds the time each of its steps holds the loop to
        ``tenant``'s seconds (its awaits on other work are not counted)."""
        return _Timed(coro, lambda seconds: self.spent(tenant, seconds), self._clock)

    def check_integrity(self) -> None:
        """Assert the bookkeeping is sound: no negative seconds, no finished call in flight."""
        assert all(n > 0 for n in self._inflight.values()), "a call finished twice"
        assert all(s >= 0 for s in self._recent.values()), "negative loop seconds"
        assert set(self.throttled_seconds) <= set(self.loop_seconds) | set(self._inflight), (
            "a tenant waited that never ran")

    def _decayed(self) -> dict[str, float]:
        """The recent seconds, decayed to now; tenants that faded out are forgotten."""
        now = self._clock()
        if now > self._stamp:
            keep = math.exp(-(now - self._stamp) / WINDOW_SECONDS)
            self._recent = {t: s * keep for t, s in self._recent.items()
                            if s * keep >= ACTIVE_SECONDS / 100 or self._inflight.get(t)}
            self._stamp = now
        return self._recent


class _Timed:
    """Drives a coroutine as its awaiter would, timing each step it runs on the loop."""

    __slots__ = ("_clock", "_coro", "_spent")

    def __init__(self, coro: Coroutine[Any, Any, Any], spent: Callable[[float], None],
                 clock: Callable[[], float]) -> None:
        self._coro, self._spent, self._clock = coro, spent, clock

    def __await__(self) -> Generator[Any, Any, Any]:
        send: Any = None
        error: BaseException | None = None
        while True:
            start = self._clock()
            try:
                step = self._coro.throw(error) if error is not None else self._coro.send(send)
            except StopIteration as done:
                self._spent(self._clock() - start)
                return done.value
            except BaseException:
                self._spent(self._clock() - start)
                raise
            self._spent(self._clock() - start)
            try:
                send, error = (yield step), None
            except BaseException as exc:  # cancellation included: passed into the coroutine
                send, error = None, exc


class LoopShareCollector:
    """The loop seconds and waits of each tenant as Prometheus counters, labelled by tenant
    name only (never a token, never an engine id); read on the metrics server's thread."""

    def __init__(self, share: LoopShare) -> None:
        self._share = share

    def describe(self) -> list[Any]:
        return list(self.collect())

    def collect(self) -> Iterator[CounterMetricFamily]:
        used = CounterMetricFamily("tierd_tenant_loop_seconds", "Seconds a tenant's calls held "
                                   "the daemon's event loop", labels=["tenant"])
        waited = CounterMetricFamily("tierd_tenant_throttled_seconds", "Seconds a tenant's calls "
                                     "waited because it was over its share of the event loop",
                                     labels=["tenant"])
        for tenant, seconds in list(self._share.loop_seconds.items()):
            used.add_metric([tenant], seconds)
        for tenant, seconds in list(self._share.throttled_seconds.items()):
            waited.add_metric([tenant], seconds)
        yield from (used, waited)
