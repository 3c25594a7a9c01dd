"""``InFlight``: daemon calls a front end sent without waiting, settled later on its own threads.

A front end whose caller may go on before the daemon answers (SGLang's backup once its pages
are copied; a load's Release once the copy is done and the lease's deadline not passed) sends
the call (``TierdClient.*_async``) and adds its future here. ``settle(keep)`` waits, oldest
first, until at most ``keep`` are in flight, and hands each failure to ``on_error`` once, on
the settling thread (never on gRPC's callback thread, which must not block or close its own
channel). Bounded: a front end settles down to its limit after each ``add``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from tierd.connector.core.link import Session

OnError = Callable[[Session, grpc.RpcError], object]


class InFlight:
    """Futures of calls made on a ``Session``, oldest first. Thread-safe."""

    def __init__(self, on_error: OnError) -> None:
        self._calls: deque[tuple[Session, Future[Any]]] = deque()
        self._lock = threading.Lock()
        self._on_error = on_error

    def add(self, session: Session, reply: Future[Any]) -> None:
        with self._lock:
            self._calls.append((session, reply))

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

    def settle(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` calls are in flight (each ends within the daemon call
        deadline); a failed one goes to ``on_error``, once, whichever thread settles it."""
        with self._lock:
            waiting = list(self._calls)[:max(0, len(self._calls) - keep)]
        for entry in waiting:
            session, reply = entry
            error = reply.exception()
            with self._lock:  # another thread may have settled it meanwhile
                if entry not in self._calls:
                    continue
                self._calls.remove(entry)
            if isinstance(error, grpc.RpcError):
                self._on_error(session, error)
