"""``CallError``: a failed daemon call that tierd's own code reports rather than gRPC's.

A refused Commit inside a ``CommitMany`` and any failed call over the lane
(``tierd.wire.lane``) raise a ``CallError``: a ``grpc.RpcError`` with the ``code()`` and
``details()`` the same call over gRPC would have failed with, so every caller handles one kind
of error whatever carried the call. ``code_of`` reads a status code from its number, as a
``CommitMany`` outcome and a lane reply carry it.
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
