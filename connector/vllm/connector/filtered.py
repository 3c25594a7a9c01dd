"""The lookups the scheduler side answered from the daemon's presence filter (certain misses,
no round trip), counted to the daemon in batches.

The daemon counts such a lookup's tokens as queried only when told (``lookup_jobs
.report_filtered``: an empty Reserve carrying them), so that its hit ratio covers every lookup.
Sent at every scheduler step that filtered a lookup, that empty Reserve would be one more daemon
call per step beside a save's Reserve and Commit; ``FilteredLookups`` sends one per
``REPORT_SECONDS`` at most, each counted token at most that long after it was counted, whether or
not vLLM steps again.
"""

from __future__ import annotations

import functools
import threading

from tierd.connector.core.link import DaemonLink
from tierd.connector.core.runner import Runner

from .lookup_jobs import report_filtered

REPORT_SECONDS = 0.5
"""Most time a filtered lookup waits to be counted on the daemon (and least time between two
reports)."""


class FilteredLookups:
    """Tokens of filtered lookups not yet reported; each report is a ``release`` job on the
    scheduler side's runner. Thread-safe: a timer thread sends."""

    def __init__(self, link: DaemonLink, runner: Runner, seconds: float = REPORT_SECONDS) -> None:
        self._link, self._runner, self.seconds = link, runner, seconds
        self._lock = threading.Lock()
        self._tokens = 0
        self._timer: threading.Timer | None = None
        self._closed = False

    def add(self, tokens: int) -> None:
        """Count ``tokens`` more; they are reported within ``seconds``."""
        with self._lock:
            self._tokens += tokens
            if self._timer is None and not self._closed:
                self._timer = threading.Timer(self.seconds, self.send)
                self._timer.daemon = True
                self._timer.start()

    def send(self) -> None:
        """Queue the report of every token counted so far (none: nothing is sent)."""
        with self._lock:
            self._send()

    def close(self) -> None:
        """Queue the last report; nothing is sent after (call before stopping the runner)."""
        with self._lock:
            self._send()
            self._closed = True

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()  # a no-op from the timer's own thread, which is ending
            self._timer = None
        tokens, self._tokens = self._tokens, 0
        if tokens and not self._closed:  # queued under the lock: never after ``close``
            self._runner.submit("release", functools.partial(report_filtered, self._link,
                                                             tokens))
