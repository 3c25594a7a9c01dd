"""``CallError``: a failed daemon call that tierd's own code reports rather than gRPC's.

A refused Commit inside a ``CommitMany`` and any failed call over the lane
(``tierd.wire.lane``) raise a ``CallError``: a ``grpc.RpcError`` with the ``code()`` and
``details()`` the same call over gRPC would have failed with, so every caller handles one kind
of error whatever carried the call. ``code_of`` reads a status code from its number, as a
``CommitMany`` outcome and a lane reply carry it.

A NOT_FOUND whose details begin with ``UNKNOWN_ENGINE`` names the calling engine (the daemon
does not know it: it restarted, or forgot an idle engine); on a call that names a lease, any
other NOT_FOUND is about that lease. ``unknown_engine`` tells the two apart.
"""

from __future__ import annotations

import grpc


def code_of(number: int) -> grpc.StatusCode:
    """The status code of its number (``grpc.StatusCode``'s; UNKNOWN for a number it has not)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallError(grpc.RpcError):  # type: ignore[misc]  # grpc has no type stubs
    """A failed call's status code and details (module doc)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


UNKNOWN_ENGINE = "unknown engine"
"""How the details of a NOT_FOUND for an engine the daemon does not know begin."""


def unknown_engine(exc: grpc.RpcError) -> bool:
    """``exc`` is a NOT_FOUND for the calling engine, not for a lease the call named."""
    if not isinstance(exc, (grpc.Call, CallError)) or exc.code() != grpc.StatusCode.NOT_FOUND:
        return False
    details = exc.details()
    return isinstance(details, str) and details.startswith(UNKNOWN_ENGINE)
