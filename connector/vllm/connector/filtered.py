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
import time

from tierd.connector.core.link import DaemonLink
from tierd.connector.core.runner import Runner

from .lookup_jobs import report_filtered

REPORT_SECONDS = 0.5
"""Most time a filtered lookup waits to be counted on the daemon (and least time between two
reports)."""


class FilteredLookups:
    """Tokens of filtered lookups not yet reported; each report is a ``release`` job on the
    scheduler side's runner, queued by a reporter thread of its own, started once at the first
    count (one thread per report would make vLLM's scheduler thread wait for each to start).
    Thread-safe."""

    def __init__(self, link: DaemonLink, runner: Runner, seconds: float = REPORT_SECONDS) -> None:
        self._link, self._runner, self.seconds = link, runner, seconds
        self._cond = threading.Condition()
        self._tokens = 0
        self._due: float | None = None  # when the tokens counted so far are to be reported
        self._reporter: threading.Thread | None = None
        self._closed = False

    def add(self, tokens: int) -> None:
        """Count ``tokens`` more; they are reported within ``seconds``."""
        with self._cond:
            self._tokens += tokens
            if self._due is not None or self._closed:
                return
            self._due = time.monotonic() + self.seconds
            if self._reporter is None:
                self._reporter = threading.Thread(target=self._report, daemon=True,
                                                  name="tierd-filtered")
                self._reporter.start()
            else:
                self._cond.notify()

    def send(self) -> None:
        """Queue the report of every token counted so far (none: nothing is sent)."""
        with self._cond:
            self._send()

    def close(self) -> None:
        """Queue the last report; nothing is sent after (call before stopping the runner). The
        reporter thread ends."""
        with self._cond:
            self._send()
            self._closed = True
            self._cond.notify()

    def _report(self) -> None:
        """Reporter thread: send each batch when it is due, until closed."""
        with self._cond:
            while not self._closed:
                left = None if self._due is None else self._due - time.monotonic()
                if left is not None and left <= 0:
                    self._send()
                else:
                    self._cond.wait(left)

    def _send(self) -> None:
        self._due = None
        tokens, self._tokens = self._tokens, 0
        if tokens and not self._closed:  # queued under the lock: never after ``close``
            self._runner.submit("release", functools.partial(report_filtered, self._link,
                                                             tokens))
