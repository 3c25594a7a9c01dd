"""An engine's measured prefill speed, for the daemon's savings (``ReportHotBlocks``'s
``prefill_tokens_per_second``): the tokens its forward steps prefilled over the seconds those
steps took.

The connector brackets each forward step: ``begin(tokens)`` just before it (``tokens``: the
prompt tokens the step computes), ``end()`` just after. Steps of fewer than ``min_tokens``
tokens are not timed: they are bound by decoding, not prefill. ``take()`` returns the speed
over the steps timed since its last answer: the first as soon as one step was timed, then at
most once every ``every_seconds`` (None meanwhile, or with nothing timed); the connector sends
it to the daemon.

On a GPU the host returns before the kernels finish: pass ``events`` (e.g.
``lambda: torch.cuda.Event(enable_timing=True)``) and the step is timed by device events
recorded at ``begin`` and ``end``, read once the end event has completed (at a later ``end``
or ``take``; never waiting). An engine that times its steps itself hands them to ``observe``.
Not thread-safe: one engine thread calls it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol


class DeviceEvent(Protocol):
    """What ``torch.cuda.Event(enable_timing=True)`` offers."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # ms until ``end_event``


class PrefillSpeed:
    """See the module doc."""

    def __init__(self, clock: Callable[[], float], *, min_tokens: int = 256,
                 every_seconds: float = 10.0,
                 events: Callable[[], DeviceEvent] | None = None) -> None:
        if min_tokens < 1 or not every_seconds > 0:
            raise ValueError("PrefillSpeed needs min_tokens >= 1 and every_seconds > 0")
        self._clock, self._min_tokens, self._every = clock, min_tokens, every_seconds
        self._events = events
        self._open: tuple[int, float, DeviceEvent | None] | None = None  # begun, not ended
        self._pending: list[tuple[int, DeviceEvent, DeviceEvent]] = []  # ended, not read
        self._tokens = 0                 # timed since the last answer
        self._seconds = 0.0
        self._last = -math.inf           # when take() last answered

    def begin(self, tokens: int) -> None:
        """A forward step computing ``tokens`` prompt tokens starts now."""
        self._open = None
        if tokens >= self._min_tokens:
            event = self._events() if self._events is not None else None
            if event is not None:
                event.record()
            self._open = (tokens, self._clock(), event)

    def end(self) -> None:
        """The step ``begin`` opened has ended (nothing if none was opened)."""
        if self._open is None:
            return
        tokens, start, event = self._open
        self._open = None
        if event is None:
            self.observe(tokens, self._clock() - start)
            return
        assert self._events is not None
        end = self._events()
        end.record()
        self._pending.append((tokens, event, end))
        self._read_events()

    def take(self) -> float | None:
        """Tokens per second over the steps timed since the last answer, if any were and
        ``every_seconds`` have passed since that answer; else None."""
        self._read_events()
        now = self._clock()
        if now - self._last < self._every or not self._seconds > 0:
            return None
        speed = self._tokens / self._seconds
        self._tokens, self._seconds, self._last = 0, 0.0, now
        return speed

    def observe(self, tokens: int, seconds: float) -> None:
        """A step already timed elsewhere computed ``tokens`` prompt tokens in ``seconds``
        (counted if at least ``min_tokens``)."""
        if tokens >= self._min_tokens and seconds > 0:
            self._tokens += tokens
            self._seconds += seconds

    def _read_events(self) -> None:
        """Count the device-timed steps whose end event has completed, oldest first."""
        while self._pending and self._pending[0][2].query():
            tokens, start, end = self._pending.pop(0)
            self.observe(tokens, start.elapsed_time(end) / 1000)
