"""``CallError``: a failed daemon call that tierd's own code reports rather than gRPC's.

A refused Commit inside a ``CommitMany`` and any failed call over the lane
(``tierd.wire.lane``) raise a ``CallError``: a ``grpc.RpcError`` with the ``code()`` and
``details()`` the same call over gRPC would have failed with, so every caller handles one kind
of error whatever carried the call.
"""

from __future__ import annotations

import grpc


class CallError(grpc.RpcError):  # type: ignore[misc]  # grpc has no type stubs
    """A failed call's status code and details (module doc)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
