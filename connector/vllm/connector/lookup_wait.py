"""``LookupWait``: how long vLLM's scheduler thread may wait for a new request's lookup.

A lookup not answered at the first ask starts its request one engine step later (vLLM's
asynchronous lookup answers None, and vLLM asks again at its next step). Waiting for it instead
holds the scheduler thread, and no step runs meanwhile: every request vLLM runs waits as long,
and so does the new one. So the scheduler waits (up to ``lookup_wait_seconds`` per lookup,
``STEP_WAIT_ASKS`` times that per step in all) only while the expected wait, the lookups' recent
latency, times the requests running plus the new one stays under the steps' recent period,
which is what not waiting costs the new request. It waits while either is not measured yet,
and whenever no other request runs. With a round trip of a fraction of a millisecond and steps
of tens (a GPU host) it waits; where the engine core shares a busy core and a round trip takes
milliseconds, a request starts a step later instead of holding the others.
"""

from __future__ import annotations

STEP_WAIT_ASKS = 4
"""A scheduler step waits for new lookups at most this many times ``lookup_wait_seconds`` in
all (the budget resets at each step)."""

SMOOTHING = 0.2
"""Weight of the newest measurement in the running averages of the lookups' latency and of the
steps' period."""

IDLE_SECONDS = 1.0
"""A gap between two steps longer than this is an idle engine, not a step's period."""


class LookupWait:
    """The scheduler side's waits for new lookups (module doc). Scheduler thread only; times
    are those of the scheduler side's clock."""

    def __init__(self, seconds: float) -> None:
        """``seconds``: ``lookup_wait_seconds``, the longest wait for one lookup (0: never)."""
        self._seconds = seconds
        self._left = seconds * STEP_WAIT_ASKS   # of this step's budget
        self._lookup_s: float | None = None     # lookups' latency, queued to answered
        self._step_s: float | None = None       # steps' period
        self._stepped_at: float | None = None   # time of the last step

    def step(self, now: float) -> None:
        """A step is being planned at ``now``: the budget is whole again, the period measured."""
        self._left = self._seconds * STEP_WAIT_ASKS
        if self._stepped_at is not None and now - self._stepped_at < IDLE_SECONDS:
            self._step_s = _average(self._step_s, now - self._stepped_at)
        self._stepped_at = now

    def answered(self, seconds: float) -> None:
        """A lookup took ``seconds`` from being queued to being answered."""
        self._lookup_s = _average(self._lookup_s, seconds)

    def timeout(self, running: int) -> float:
        """How long to wait for a new lookup now, with ``running`` other requests in vLLM (0:
        answer "not yet" at once)."""
        if self._left <= 0 or not self._worth_it(running):
            return 0.0
        return min(self._seconds, self._left)

    def waited(self, seconds: float) -> None:
        """The scheduler thread waited ``seconds`` for a lookup (taken from the step's budget)."""
        self._left -= seconds

    def _worth_it(self, running: int) -> bool:
        if self._lookup_s is None or self._step_s is None or running == 0:
            return True
        return self._lookup_s * (running + 1) < self._step_s


def _average(average: float | None, value: float) -> float:
    """The running average ``average`` (None: none yet) with ``value`` added (``SMOOTHING``)."""
    return value if average is None else average + SMOOTHING * (value - average)
