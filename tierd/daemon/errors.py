"""Domain errors of the node store; the gRPC edge maps each to one status code.

Bad input is ``ValueError`` (-> INVALID_ARGUMENT: a hash of the wrong length, a slot out of
range, a bad layout). Everything else a caller can cause is one of the classes below. Expected
outcomes (a miss, no room for a block) are return values, never exceptions.
"""

from __future__ import annotations

from tierd.wire.call_error import UNKNOWN_ENGINE
from tierd.wire.clip import clip


class TierdError(Exception):
    """Base of every domain error; its message is sent to the client as the status details."""


class NotFound(TierdError):
    """-> NOT_FOUND: an unknown engine id, or an unknown, released or expired lease."""


class UnknownEngine(NotFound):
    """-> NOT_FOUND: an engine id the daemon does not know (or not the caller tenant's: the same
    answer), told apart from a lease's by its details (``tierd.wire.call_error``)."""

    def __init__(self, engine_id: str) -> None:
        super().__init__(f"{UNKNOWN_ENGINE} {clip(engine_id)}: register it first")


class FailedPrecondition(TierdError):
    """-> FAILED_PRECONDITION: the request is well formed but the state forbids it (a double
    commit, a commit or release of a reservation after its lease expired)."""


class ResourceExhausted(TierdError):
    """-> RESOURCE_EXHAUSTED: too many blocks in one request, or no room at all for a layout."""


class Unauthenticated(TierdError):
    """-> UNAUTHENTICATED: a missing or unknown bearer token where one is required."""
