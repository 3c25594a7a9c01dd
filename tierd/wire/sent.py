"""``Sent``: a call sent without waiting, its answer read later by whichever thread wants it
(``TierdClient``'s ``*_sent`` calls), over the lane (``LaneSent``) or on one of the client's
call threads where the lane does not take it (``FutureSent``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, Generic, Protocol, TypeVar

from tierd.wire.lane_client import LaneCall

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Sent(Protocol[T_co]):
    """A call sent without waiting: ``result()`` is its answer, or raises its
    ``grpc.RpcError``; ``done(timeout)`` whether ``result()`` would return at once (its reply
    is in), waiting at most ``timeout`` seconds for it; ``abandon()`` gives up on an answer
    nobody will read (a lane connection waiting for it is closed)."""

    def result(self) -> T_co: ...

    def done(self, timeout: float = 0.0) -> bool: ...

    def abandon(self) -> None: ...


class LaneSent(Generic[T]):
    """A call sent on the lane (``LaneCall``), its reply turned into ``T`` once read."""

    def __init__(self, call: LaneCall, convert: Callable[[Any], T]) -> None:
        self._call, self._convert = call, convert

    def result(self) -> T:
        return self._convert(self._call.result())

    def done(self, timeout: float = 0.0) -> bool:
        return self._call.done(timeout)

    def abandon(self) -> None:
        self._call.abandon()


class FutureSent(Generic[T]):
    """A call made on one of a client's call threads (a ``Future`` of its answer), as a
    ``Sent``."""

    def __init__(self, future: Future[T]) -> None:
        self._future = future

    def result(self) -> T:
        return self._future.result()

    def done(self, timeout: float = 0.0) -> bool:
        return bool(wait([self._future], timeout).done)

    def abandon(self) -> None:
        pass  # its call thread reads the answer
