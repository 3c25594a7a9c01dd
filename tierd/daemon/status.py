"""The daemon's whole error policy at its gRPC edge: which domain error (``tierd.daemon.errors``,
and ``ValueError`` for bad input) becomes which status code. Anything else is a bug: INTERNAL."""

from __future__ import annotations

import grpc

from tierd.daemon.errors import FailedPrecondition, NotFound, ResourceExhausted, Unauthenticated

_STATUS: list[tuple[type[Exception], grpc.StatusCode]] = [
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]
"""Domain error -> status code, most specific first (the edge's whole error policy)."""

DOMAIN_ERRORS = tuple(kind for kind, _ in _STATUS)
"""The errors that are a status code, not a bug (``CommitMany`` fails one Commit on them)."""

MAX_DETAILS_CHARS = 1024
"""Longest status message sent: details travel in a trailer, which gRPC caps at 8 KiB."""


def status_for(exc: Exception) -> grpc.StatusCode | None:
    """The status code of a domain error, or None for anything else (a bug: INTERNAL)."""
    return next((code for kind, code in _STATUS if isinstance(exc, kind)), None)
