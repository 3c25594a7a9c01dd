"""``Runner``: the one executor of the engine side's daemon work, off the engine's own threads.

A few daemon threads take jobs by kind, in the priority order the runner was made with (the
vLLM connector: lookups before releases; ``TierdTier``: probes, then loads, then stores), each
kind first in first out. ``submit`` never blocks and returns the job's ``Future``: its
completion event, resolved on the runner thread that ran it (a caller polls ``done()`` on its
own thread, or adds a done-callback). Bounded: a kind named in ``limits``
holds at most that many queued jobs and ``submit`` answers None when it is full (an expected
outcome: the caller answers "no match" or skips the save).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

_log = logging.getLogger(__name__)

T = TypeVar("T")


class Runner:
    """``threads`` daemon threads running jobs by kind (``kinds``: highest priority first).
    Thread-safe."""

    def __init__(self, threads: int, name: str, kinds: Sequence[str], *,
                 limits: Mapping[str, int] | None = None) -> None:
        assert threads > 0 and kinds, "a runner needs a thread and a kind"
        self._order = tuple(kinds)
        self._queues: dict[str, deque[tuple[Future[Any], Callable[[], Any]]]] = {
            k: deque() for k in self._order}
        self._running: dict[str, int] = {k: 0 for k in self._order}
        self._limits = dict(limits or {})
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, kind: str, job: Callable[[], T]) -> Future[T] | None:
        """Queue ``job``; its future holds what it returns (or what it raised: a job should
        return its expected outcomes, so a raise is logged as a bug). Never blocks. None if
        ``kind`` already holds its limit of queued jobs."""
        future: Future[T] = Future()
        with self._cond:
            assert not self._stopping, "submit after stop"
            queue = self._queues[kind]
            if len(queue) >= self._limits.get(kind, len(queue) + 1):
                return None
            queue.append((future, job))
            self._cond.notify()
        return future

    @property
    def native_ids(self) -> list[int | None]:
        """The kernel's id of each runner thread (to set its priority, say)."""
        return [thread.native_id for thread in self._threads]

    def queued(self, kind: str) -> int:
        """Jobs of ``kind`` waiting for a thread."""
        with self._cond:
            return len(self._queues[kind])

    def busy(self, kinds: Sequence[str] | None = None) -> bool:
        """Whether any job of ``kinds`` (default: every kind) is queued or running."""
        with self._cond:
            return self._busy(kinds or self._order)

    def drain(self, timeout: float, kinds: Sequence[str] | None = None, keep: int = 0) -> bool:
        """Wait until at most ``keep`` jobs of ``kinds`` (default: every kind) are queued or
        running; False if ``timeout`` s passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._count(kinds or self._order) > keep:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def stop(self, timeout: float | None) -> bool:
        """Run the queued jobs, then end the threads; False if one still runs after
        ``timeout`` s (None: wait as long as they run). ``submit`` after this is a bug."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _busy(self, kinds: Sequence[str]) -> bool:
        return self._count(kinds) > 0

    def _count(self, kinds: Sequence[str]) -> int:
        return sum(len(self._queues[k]) + self._running[k] for k in kinds)

    def _loop(self) -> None:
        while True:
            with self._cond:
                kind = next((k for k in self._order if self._queues[k]), None)
                while kind is None:
                    if self._stopping:
                        return
                    self._cond.wait()
                    kind = next((k for k in self._order if self._queues[k]), None)
                future, job = self._queues[kind].popleft()
                self._running[kind] += 1
            try:
                if future.set_running_or_notify_cancel():
                    future.set_result(job())
            except Exception as exc:  # a bug in a job must not end the thread that runs the next
                _log.exception("tierd: a %s job failed", kind)
                future.set_exception(exc)
            finally:
                with self._cond:
                    self._running[kind] -= 1
                    self._cond.notify_all()
