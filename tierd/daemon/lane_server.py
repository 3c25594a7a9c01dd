"""``LaneServer``: the daemon's end of the lane (``tierd.wire.lane``).

Each call runs exactly as over gRPC: the same servicer method, wrapped by the same guard
(``ErrorInterceptor``: request parsing, the tenant's share of the loop, domain errors mapped to
status codes, bugs to INTERNAL, the call's latency in ``tierd_rpc_latency_seconds``). The
caller's tenant comes from its hello's token, as from gRPC's metadata on the Unix socket.

Every connection's hello is answered: OK, or RESOURCE_EXHAUSTED past ``max_connections``
connections at once (the client then makes that call over gRPC). A malformed hello (or one over
``max_message_bytes``) closes its connection (logged), and so does a call naming no method of
the service, after its INVALID_ARGUMENT reply. A call over ``max_message_bytes`` is read and
dropped piece by piece and answered RESOURCE_EXHAUSTED, as gRPC answers it. The daemon keeps
serving every other connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tierd.wire.lane import HELLO, LENGTH, SERVICE

_log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
"""Lane connections at once, all engines together (a client opens one per call in flight)."""

WARN_EVERY_SECONDS = 60.0
"""At most one warning this often about refused connections (with the count since the last)."""

Guarded = Callable[[bytes, Any], Awaitable[Any]]
"""A servicer method under the guard: (serialized request, context) -> reply message."""


class LaneAbort(grpc.aio.AbortError):  # type: ignore[misc]  # grpc has no type stubs
    """How the guard's ``context.abort`` ends a lane call: its status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What the guard and the servicer ask of a call's context, for a lane call."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def peer(self) -> str:
        return "unix:lane"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise LaneAbort(code, details)


class _BadFrame(Exception):
    """A frame that ends its connection."""


class LaneServer:
    """Serves the lane at ``path`` with ``guard(method name) -> Guarded`` (module doc)."""

    def __init__(self, guard: Callable[[str], Guarded], max_message_bytes: int,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self._methods = {name.encode(): guard(name) for name in SERVICE.methods_by_name}
        self._max_bytes, self._max_connections = max_message_bytes, max_connections
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None
        self._refused, self._warned_at = 0, -WARN_EVERY_SECONDS

    async def start(self, path: str) -> None:
        """Listen at ``path`` (the caller removed any stale file there)."""
        self._server = await asyncio.start_unix_server(self._serve, path,
                                                       limit=self._max_bytes + LENGTH.size)

    async def stop(self, grace: float = 2.0) -> None:
        """Stop listening and close every connection; calls in flight get ``grace`` seconds to
        end (their replies are not sent), then are cancelled."""
        if self._server is not None:
            self._server.close()
        for writer in self._connections.values():
            writer.close()
        if self._connections:
            _, late = await asyncio.wait(list(self._connections), timeout=grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            hello = await self._read(reader)
            if hello is None or not hello.startswith(HELLO):
                raise _BadFrame("the first frame is not a lane hello (tierd-lane/1)")
            if len(self._connections) > self._max_connections:
                self._refused += 1
                if time.monotonic() >= self._warned_at + WARN_EVERY_SECONDS:
                    self._warned_at = time.monotonic()
                    _log.warning("lane: %d connections refused since the last warning, %d open "
                                 "(the most); their calls go over gRPC", self._refused,
                                 self._max_connections)
                    self._refused = 0
                await self._send(writer, _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                "the lane has its most connections open"))
                return
            context = _Context(hello[len(HELLO):].decode())
            await self._send(writer, b"\0")
            while True:
                body = await self._read(reader, skip_oversized=True)
                if body is None:
                    await self._send(writer, _error(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "a request over the daemon's "
                        f"max_message_bytes ({self._max_bytes}): send fewer blocks per call"))
                    continue
                reply, known = await self._answer(body, context)
                await self._send(writer, reply)
                if not known:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except (_BadFrame, UnicodeDecodeError) as exc:
            _log.warning("lane: closed a connection: %s", exc)
        finally:
            self._connections.pop(task, None)
            writer.close()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(LENGTH.pack(len(body)) + body)
        await writer.drain()

    async def _read(self, reader: asyncio.StreamReader, skip_oversized: bool = False
                    ) -> bytes | None:
        """The next frame's body. One over ``max_message_bytes`` is read and dropped piece by
        piece (None) with ``skip_oversized``, else it ends the connection."""
        (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if n <= self._max_bytes:
            return await reader.readexactly(n)
        if not skip_oversized:
            raise _BadFrame(f"a frame of {n} bytes, over max_message_bytes ({self._max_bytes})")
        while n:
            n -= len(await reader.readexactly(min(n, 1 << 16)))
        return None

    async def _answer(self, body: bytes, context: _Context) -> tuple[bytes, bool]:
        """The reply frame's body, and whether the call named a method of the service."""
        size = body[0] if body else 0
        method = self._methods.get(body[1:1 + size])
        if method is None:
            name = body[1:1 + size].decode(errors="replace")
            return _error(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the lane has no method {name!r}: call one of tierd.v1.Tierd's"), False
        try:
            reply = await method(body[1 + size:], context)
        except LaneAbort as abort:
            return _error(abort.code, abort.details), True
        return b"\0" + reply.SerializeToString(), True


def _error(code: grpc.StatusCode, details: str) -> bytes:
    return bytes((code.value[0],)) + details.encode()
