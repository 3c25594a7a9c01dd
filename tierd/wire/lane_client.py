"""``LaneClient``: a blocking client's calls over the daemon's lane (``tierd.wire.lane``).

Each call takes an idle connection (or opens one), sends the call, reads its reply and puts the
connection back: one connection per call in flight, at most ``KEEP_IDLE`` kept idle. An idle
connection the daemon closed meanwhile (it restarted) refuses the call's first bytes: the call
is then sent once on a new connection, as gRPC's channel reconnects. A process forked from one
that used the client opens connections of its own: two processes never read one connection's
replies. ``send`` splits a call in two: sent now, its reply read later by whichever thread
wants it (``LaneCall.result``), the connection the call's until then; a caller with other work
meanwhile needs no second thread to wait for the answer.

A call that needs a new connection and cannot have one is not sent: ``LaneRefused`` (the daemon
has its most lane connections open) or ``LaneGone`` (nothing listens at the lane's path), and
``TierdClient`` makes it over gRPC. A call that fails in transport once sent (the daemon gone, a
deadline passed) closes its connection and raises a ``CallError`` with the code gRPC would have
given (UNAVAILABLE, DEADLINE_EXCEEDED); an error the daemon answered carries the daemon's own
code and details. Thread-safe.
"""

from __future__ import annotations

import math
import os
import select
import socket
import threading
from typing import Any

import grpc

from .call_error import CallError, code_of
from .lane import HELLO, LENGTH, reply_type

KEEP_IDLE = 8
"""Idle connections kept for the next calls; more are closed when their call ends."""


class LaneRefused(Exception):
    """The daemon refused a new lane connection (it has its most open): make the call over
    gRPC."""


class LaneGone(CallError):
    """No new lane connection could be made (UNAVAILABLE): nothing listens at the lane's path
    now (the daemon is gone, or came back without a lane). The call was not sent."""


class LaneClient:
    """Calls over the lane at ``path`` with ``token`` (module doc)."""

    def __init__(self, path: str, token: str | None, timeout: float) -> None:
        self.path, self._timeout = path, timeout
        self._hello = _frame(HELLO + (token or "").encode())
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._pid = os.getpid()  # the process whose connections ``_idle`` holds
        self._closed = False

    @classmethod
    def open(cls, path: str, token: str | None, timeout: float) -> LaneClient | None:
        """A client whose first connection is open, or None where nothing listens at ``path``
        (no lane: a daemon without one, or none at all)."""
        lane = cls(path, token, timeout)
        try:
            lane._idle.append(lane._connect())
        except (OSError, LaneRefused):
            return None
        return lane

    def call(self, method: str, request: Any) -> Any:
        """The reply of the service's ``method`` to ``request`` (a ``CallError`` if it
        failed; ``LaneRefused`` or ``LaneGone``, the call not sent, if it needed a new
        connection and the daemon refused one or none could be made)."""
        return self.send(method, request).result()

    def send(self, method: str, request: Any) -> LaneCall:
        """Send the call now, from this thread, and return at once: its reply is read by
        ``LaneCall.result`` on whichever thread wants it (no other thread takes part; the
        connection stays with the call until then). Errors as ``call``'s: ``LaneRefused`` or
        ``LaneGone`` here (not sent), a ``CallError`` here or from ``result``."""
        name = method.encode()
        frame = _frame(bytes((len(name),)) + name + request.SerializeToString())
        conn, reused = self._take()
        try:
            try:
                conn.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                if not reused:
                    raise
                conn.close()  # an idle connection the daemon closed (it restarted): nothing
                conn = self._new()  # was sent, so send it once more on a new one
                conn.sendall(frame)
        except OSError as exc:
            raise self._failed(conn, method, exc) from None
        return LaneCall(self, conn, method)

    def _failed(self, conn: socket.socket, method: str, exc: OSError) -> CallError:
        """The ``CallError`` of a call that failed in transport (its connection closed)."""
        conn.close()
        if isinstance(exc, TimeoutError):
            return CallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no answer to {method} from {self.path} within "
                             f"{self._timeout:g} s")
        return CallError(grpc.StatusCode.UNAVAILABLE,
                         f"the lane {self.path} failed during {method}: {exc}")

    def close(self) -> None:
        """Close every idle connection; calls in flight close theirs when they end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection for a call, and whether it was an idle one (kept from an earlier call)."""
        with self._lock:
            if self._closed:
                raise CallError(grpc.StatusCode.UNAVAILABLE, f"the lane {self.path} was closed")
            if self._pid != os.getpid():  # a forked child: its parent's connections stay theirs
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop(), True
        return self._new(), False

    def _new(self) -> socket.socket:
        """``_connect``, its failure a ``LaneGone``."""
        try:
            return self._connect()
        except OSError as exc:
            raise LaneGone(grpc.StatusCode.UNAVAILABLE,
                           f"cannot reach the lane {self.path}: {exc}") from None

    def _give_back(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < KEEP_IDLE and self._pid == os.getpid():
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> socket.socket:
        """A new connection, its hello answered; ``LaneRefused`` where the daemon has its most
        lane connections open."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(self._timeout)
            conn.connect(self.path)
            conn.sendall(self._hello)
            answer = _read_frame(conn)
        except OSError:
            conn.close()
            raise
        if answer != b"\0":
            conn.close()
            raise LaneRefused(answer[1:].decode(errors="replace"))
        return conn


class LaneCall:
    """A call sent on one of ``lane``'s connections, its reply not read yet (``send``)."""

    def __init__(self, lane: LaneClient, conn: socket.socket, method: str) -> None:
        self._lane, self._conn, self._method = lane, conn, method

    def done(self, timeout: float = 0.0) -> bool:
        """Whether the reply has begun to arrive (``result`` would not wait for the daemon),
        waiting at most ``timeout`` seconds for it."""
        poller = select.poll()  # not select.select: an engine may hold fds past FD_SETSIZE
        poller.register(self._conn, select.POLLIN)
        return bool(poller.poll(math.ceil(max(0.0, timeout) * 1e3)))

    def abandon(self) -> None:
        """Give up on the reply: the connection is closed (the daemon's answer goes nowhere)."""
        self._conn.close()

    def result(self) -> Any:
        """The reply, read now (waiting for it up to the client's timeout), or its
        ``CallError``; the connection goes back to the client. Once only."""
        method = self._method
        try:
            reply = _read_frame(self._conn)
        except OSError as exc:
            raise self._lane._failed(self._conn, method, exc) from None
        self._lane._give_back(self._conn)
        if not reply:
            raise CallError(grpc.StatusCode.INTERNAL, f"an empty reply to {method}")
        if reply[0] != 0:
            raise CallError(code_of(reply[0]), reply[1:].decode(errors="replace"))
        return reply_type(method).FromString(reply[1:])


def _frame(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


def _read_frame(conn: socket.socket) -> bytes:
    """One frame's body; ``ConnectionError`` where the daemon closed the connection first."""
    head = _read_exactly(conn, LENGTH.size)
    return _read_exactly(conn, LENGTH.unpack(head)[0])


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
