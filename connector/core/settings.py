"""``ClientSettings``: where the daemon is and how an engine talks to it, for every front end.

The vLLM connector (``TierdVllmConfig``, keys of ``kv_connector_extra_config``) and the
reference engine's hooks (``TierdHooksConfig``) extend this class, so the same knob has the
same name everywhere. Frozen; ``validate_client`` raises ``ValueError`` naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierd.wire.client import TierdClient


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """How to reach the daemon, and how long to wait for it."""

    socket_path: str | None = None
    """Daemon Unix socket; default ``TIERD_SOCKET_PATH`` or tierd's default socket."""
    address: str | None = None
    """``host:port`` of a daemon's TCP listener instead of the socket (needs ``token``)."""
    token: str | None = None
    """Bearer token: selects the tenant whose blocks this engine shares (none: the daemon's
    default tenant over the Unix socket)."""
    engine_name: str = "engine"
    """Shown by ``tierd stats`` (front ends add a suffix per role or rank)."""
    timeout_seconds: float = 5.0
    """Deadline of each daemon call. A call that misses it counts as the daemon being down
    (``core.errors``): the link backs off instead of stalling the engine on every call."""
    retry_seconds: float = 10.0
    """Wait after a failed connect (or a lost daemon) before the next attempt."""
    retry_max_seconds: float | None = None
    """Each further failed attempt doubles the wait up to this (None: ``retry_seconds``, a
    fixed wait)."""

    def validate_client(self) -> None:
        """``ValueError`` naming the fix for a value out of range."""
        if not self.timeout_seconds > 0 or self.retry_seconds < 0:
            raise ValueError("need timeout_seconds > 0 and retry_seconds >= 0, got "
                             f"{self.timeout_seconds} and {self.retry_seconds}")
        if self.retry_max_seconds is not None and self.retry_max_seconds < self.retry_seconds:
            raise ValueError(f"retry_max_seconds={self.retry_max_seconds} must be >= "
                             f"retry_seconds={self.retry_seconds} (or unset: a fixed wait)")
        if self.address and not self.token:
            raise ValueError("a TCP address needs a bearer token: set 'token' too")

    @property
    def longest_retry(self) -> float:
        """The cap of the back-off (``retry_max_seconds``, or ``retry_seconds``)."""
        return self.retry_seconds if self.retry_max_seconds is None else self.retry_max_seconds

    def new_client(self) -> TierdClient:
        """A fresh channel to the daemon (connects lazily; never raises for a missing one)."""
        return TierdClient(socket_path=self.socket_path, address=self.address, token=self.token,
                           timeout=self.timeout_seconds)
