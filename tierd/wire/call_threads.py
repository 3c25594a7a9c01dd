"""``CallThreads``: the threads that run a ``TierdClient``'s calls sent without waiting.

gRPC's own futures on a blocking channel (``stub.Method.future``) poll the channel on a thread
that lives only while one of its calls is in flight: the call that finds none starts a new
thread, and waits for it to start. A caller that takes each answer before it sends the next
call (a vLLM worker's Reserve, once per step) so starts a thread per call, and on a core its
engine keeps busy, waiting for that thread is a context switch inside the step.

``CallThreads`` runs each call as a blocking call on a thread it keeps for the next one: a
thread is started only when every started one is busy, up to ``limit``; beyond that calls
queue until one is free. Daemon threads, so a call still waiting for its deadline never holds
up the process's exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[[], Any]]


class CallThreads:
    """Up to ``limit`` daemon threads named ``name``-N running submitted calls, first in first
    out. Thread-safe."""

    def __init__(self, limit: int, name: str) -> None:
        assert limit > 0, "a call needs a thread"
        self._limit, self._name = limit, name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one per thread waiting for a job
        self._lock = threading.Lock()
        self._started = 0
        self._stopped = False

    @property
    def started(self) -> int:
        """Threads started so far (each lives until ``stop``)."""
        return self._started

    def submit(self, call: Callable[[], T]) -> Future[T]:
        """Queue ``call``; its future holds what it returns or raises (done-callbacks run on
        the thread that ran it). Never blocks but to start a thread. ``RuntimeError`` after
        ``stop``."""
        future: Future[T] = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("submit after stop")
            self._jobs.put((future, call))
            if not self._idle.acquire(blocking=False) and self._started < self._limit:
                self._started += 1
                threading.Thread(target=self._loop, name=f"{self._name}-{self._started}",
                                 daemon=True).start()
        return future

    def stop(self) -> None:
        """Let every thread end once the calls queued before this have run (not waited
        for)."""
        with self._lock:
            self._stopped = True
            for _ in range(self._started):
                self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, call = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except Exception as exc:  # the caller takes it from the future
                    future.set_exception(exc)
            self._idle.release()
