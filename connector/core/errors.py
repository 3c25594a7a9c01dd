"""The one classification of a failed daemon call, shared by every front end.

``classify`` maps a ``grpc.RpcError`` to what the caller must do about it:

``"lease"``      the lease or reservation the call named has ended (FAILED_PRECONDITION: a
                 Commit or Release after expiry; NOT_FOUND on a call that names a lease, unless
                 it names the engine). The blocks it pinned are not trusted; the daemon and the
                 registration are fine.
``"request"``    the daemon refused this request (INVALID_ARGUMENT, RESOURCE_EXHAUSTED): fine
                 otherwise. Logged, nothing dropped.
``"forgotten"``  NOT_FOUND on an engine call (Acquire, Reserve, a report), or one whose details
                 name the engine on any call (``tierd.wire.call_error.unknown_engine``): a
                 daemon that restarted, or forgot an idle engine, no longer knows this engine.
                 Drop the session, re-register at once.
``"down"``       anything else: UNAVAILABLE, CANCELLED, UNAUTHENTICATED, INTERNAL, and
                 DEADLINE_EXCEEDED. Drop the session and back off (``ClientSettings``).

Why a missed deadline drops the session (the reference hooks used to keep it): a daemon that
does not answer in ``timeout_seconds`` would otherwise cost the engine that long on every
call, step after step; backing off costs one deadline per retry period, and a daemon that was
only slow is back at the next attempt (a fresh channel, a fresh registration: nothing it held
for the old session is used again, its leases lapse on their own).
"""

from __future__ import annotations

from typing import Literal

import grpc

from tierd.wire.call_error import CallError, unknown_engine

Failure = Literal["lease", "request", "forgotten", "down"]
"""What a failed call means for the session (see the module doc)."""

DROPS: frozenset[Failure] = frozenset({"forgotten", "down"})
"""Failures after which the session is dropped."""

_REQUEST = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def classify(exc: grpc.RpcError, *, names_lease: bool = False) -> Failure:
    """What ``exc`` means; ``names_lease``: the call named a lease or reservation (Release,
    Commit, Abort), so a NOT_FOUND that does not name the engine means that lease ended."""
    code = exc.code() if isinstance(exc, (grpc.Call, CallError)) else None
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return "lease"
    if code == grpc.StatusCode.NOT_FOUND:
        return "lease" if names_lease and not unknown_engine(exc) else "forgotten"
    if code in _REQUEST:
        return "request"
    return "down"


def describe(exc: BaseException) -> str:
    """``CODE: details`` of a gRPC error, ``Type: message`` of anything else (for logs)."""
    if isinstance(exc, (grpc.Call, CallError)):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
