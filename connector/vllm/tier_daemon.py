"""Every daemon call a ``TierdTier`` makes, in one place, safe to make from several threads.

``DaemonLink`` (registration, arena, retry, error classification) is made for one thread; the
tier's worker threads share one through ``TierDaemon``: ``session()`` connects (at most once per
``retry_seconds`` while the daemon is away) under a lock and hands back a ``Session``, a frozen
snapshot of the registration a job uses from start to end. A session keeps its arena mapping
alive (``ArenaSlots`` holds the tensor that owns the mapping), so a job that outlives its
registration (the daemon restarted or died) still reads and writes mapped memory, never freed
memory; its next call fails and is accounted with ``failed``.

Every method blocks for at most one round trip (``timeout_seconds``) except ``acquire_async``,
which returns a future at once. Errors are ``grpc.RpcError`` for the caller to hand to ``failed``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc

from tierd.connector.transfer import ArenaSlots
from tierd.daemon.client import AcquiredBlocks, ReservedSlots, TierdClient, target_for
from tierd.daemon.layout import Layout
from tierd.types import BlockHash

from .config import TierdVllmConfig
from .link import DaemonLink


@dataclass(frozen=True, slots=True)
class Session:
    """One registration of the tier, as a job saw it when it started."""

    client: TierdClient
    engine_id: str
    slots: ArenaSlots
    """The registration's slots in its arena (keeps the mapping alive)."""
    arena: Any
    """The whole arena as a uint8 torch tensor (the same mapping)."""
    max_blocks: int
    """Most hashes one Acquire or Reserve may carry."""


class TierDaemon:
    """The tier's registration on the daemon, shared by its threads."""

    def __init__(self, config: TierdVllmConfig, layout: Layout, engine_name: str) -> None:
        self._link = DaemonLink(config, layout, engine_name, attach=True)
        self._lock = threading.Lock()
        self._session: Session | None = None
        self.target = target_for(config.socket_path, config.address)

    def session(self) -> Session | None:
        """The current registration, registering first if needed (one round trip, at most once
        per ``retry_seconds`` while the daemon is away); None while it cannot be reached."""
        with self._lock:
            link = self._link
            if not link.connect():
                self._session = None
                return None
            if self._session is None or self._session.engine_id != link.engine.engine_id:
                self._session = Session(link.client, link.engine.engine_id, link.slots,
                                        link.arena_tensor, link.engine.max_blocks_per_request)
            return self._session

    def failed(self, session: Session, exc: grpc.RpcError) -> None:
        """Account for a call of ``session`` that failed: ``DaemonLink.failed`` if the session is
        still the current one (a later registration is not dropped for an old error)."""
        with self._lock:
            if self._session is not None and self._session.engine_id == session.engine_id:
                self._link.failed(exc)
                if not self._link.up:
                    self._session = None

    def acquire_async(self, session: Session, hashes: Sequence[BlockHash]
                      ) -> Future[AcquiredBlocks]:
        """Pin the longest held prefix of ``hashes`` in DRAM (the daemon reads SSD hits in
        meanwhile) and count it as a lookup; a future of the lease. Does not block."""
        return session.client.acquire_async(session.engine_id, hashes, count_lookup=True)

    @staticmethod
    def release(session: Session, lease_id: str, corrupt_from: int | None) -> None:
        """Unpin a lease; ``corrupt_from``: the first of its blocks that failed its check (the
        daemon re-checks it and drops it)."""
        session.client.release(session.engine_id, lease_id, corrupt_from=corrupt_from)

    @staticmethod
    def reserve(session: Session, hashes: Sequence[BlockHash]) -> ReservedSlots:
        """A slot for each block the daemon does not hold yet (None: held already, or no room)."""
        return session.client.reserve(session.engine_id, hashes)

    @staticmethod
    def commit(session: Session, lease_id: str, written: Sequence[bool]) -> int:
        """Publish the written slots of a reservation (the daemon checksums them); how many
        blocks are now stored."""
        return session.client.commit(session.engine_id, lease_id, written)

    def close(self) -> None:
        """Unregister (best effort, one round trip at most) and drop the link."""
        with self._lock:
            self._link.close()
            self._session = None
