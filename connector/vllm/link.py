"""The vLLM adapter's link to the tierd daemon.

Both sides of the adapter (scheduler process, each worker process) own one ``DaemonLink``: a
``TierdClient`` plus the engine registration for one ``Layout``, and for workers the attached
DRAM arena. A daemon that is down is an expected state, never an exception to vLLM: the link
reports itself down, the adapter answers "no match" and skips saves, and ``connect`` retries at
most once per ``retry_seconds`` (a fresh channel each time, so gRPC's reconnect back-off never
hides a daemon that came back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from tierd.connector.transfer import ArenaSlots
from tierd.daemon.arena import ShmArena
from tierd.daemon.client import EngineHandle, TierdClient
from tierd.daemon.layout import Layout

from .config import TierdVllmConfig

_log = logging.getLogger(__name__)

_KEEP_LINK = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.INVALID_ARGUMENT)
"""Errors about one request (an expired lease, too many blocks): the daemon itself is fine."""


class DaemonLink:
    """One engine registration on the daemon (and, with ``attach``, its mapped arena).

    ``client``/``engine`` (and ``arena``/``arena_tensor`` with ``attach``) are valid only while
    ``up``. Not thread-safe: each vLLM connector calls it from one thread.
    """

    def __init__(self, config: TierdVllmConfig, layout: Layout, engine_name: str, *,
                 attach: bool, clock: Callable[[], float] = time.monotonic) -> None:
        """Remember what to register; nothing is sent until ``connect``."""
        layout.validate()
        self.layout = layout
        self._config, self._name, self._attach, self._clock = config, engine_name, attach, clock
        self._client: TierdClient | None = None
        self._engine: EngineHandle | None = None
        self._arena: ShmArena | None = None
        self._arena_tensor: Any = None
        self._slots: ArenaSlots | None = None
        self._next_try = 0.0
        self._warned = False

    @property
    def timeout_seconds(self) -> float:
        """Deadline of each daemon call (``TierdVllmConfig.timeout_seconds``)."""
        return self._config.timeout_seconds

    @property
    def up(self) -> bool:
        return self._engine is not None

    @property
    def client(self) -> TierdClient:
        assert self._client is not None and self.up, "use the link only while it is up"
        return self._client

    @property
    def engine(self) -> EngineHandle:
        assert self._engine is not None, "use the link only while it is up"
        return self._engine

    @property
    def arena(self) -> ShmArena:
        assert self._arena is not None, "the link was made without attach, or is down"
        return self._arena

    @property
    def slots(self) -> ArenaSlots:
        """Batched access to this layout's slots in the arena (``ArenaSlots``: checksums where
        the slots lie, no copy)."""
        assert self._slots is not None, "the link was made without attach, or is down"
        return self._slots

    @property
    def arena_tensor(self) -> Any:
        """The whole arena as a uint8 torch tensor (zero copy)."""
        assert self._arena_tensor is not None, "the link was made without attach, or is down"
        return self._arena_tensor

    def connect(self) -> bool:
        """True if up; otherwise try to register (and attach) now, unless the last attempt was
        less than ``retry_seconds`` ago. Blocks for at most one round trip. Never raises for a
        daemon that is absent or refuses: logs it (a warning the first time) and stays down."""
        if self.up:
            return True
        now = self._clock()
        if now < self._next_try:
            return False
        self._next_try = now + self._config.retry_seconds
        client = TierdClient(socket_path=self._config.socket_path, address=self._config.address,
                             token=self._config.token, timeout=self._config.timeout_seconds)
        try:
            engine = client.register_engine(self.layout, self._name)
            if engine.geometry.slot_bytes != self.layout.block_bytes:
                raise ValueError(f"daemon slots are {engine.geometry.slot_bytes} bytes, this "
                                 f"layout's blocks {self.layout.block_bytes}: upgrade tierd")
            arena = (ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
                     if self._attach else None)
        except (grpc.RpcError, OSError, ValueError) as exc:
            client.close()
            log = _log.debug if self._warned else _log.warning
            self._warned = True
            log("tierd daemon at %s unavailable (%s); running without it, next try in %.0f s",
                client.target, _describe(exc), self._config.retry_seconds)
            return False
        self._client, self._engine, self._arena = client, engine, arena
        self._arena_tensor = arena.as_tensor() if arena is not None else None
        self._slots = (ArenaSlots(self._arena_tensor, engine.geometry)
                       if self._arena_tensor is not None else None)
        self._warned = False
        _log.info("tierd: engine %s registered at %s", engine.engine_id, client.target)
        return True

    def failed(self, exc: grpc.RpcError) -> None:
        """Account for a failed call: an error about the request keeps the link; NOT_FOUND (a
        daemon that restarted no longer knows this engine, or a lease that lapsed) drops it and
        re-registers at the next use; any other (daemon gone, deadline) drops it for
        ``retry_seconds``."""
        code = exc.code() if isinstance(exc, grpc.Call) else None
        if code in _KEEP_LINK:
            _log.debug("tierd call failed: %s", _describe(exc))
            return
        wait = 0.0 if code == grpc.StatusCode.NOT_FOUND else self._config.retry_seconds
        _log.warning("tierd call failed (%s); reconnecting in %.0f s", _describe(exc), wait)
        self._drop()
        self._next_try = self._clock() + wait

    def close(self) -> None:
        """Unregister (best effort) and drop the channel and the arena mapping."""
        if self._client is not None and self._engine is not None:
            try:
                self._client.unregister_engine(self._engine.engine_id)
            except grpc.RpcError as exc:
                _log.debug("tierd unregister failed: %s", _describe(exc))
        self._drop()

    def _drop(self) -> None:
        self._arena_tensor = self._slots = None
        if self._arena is not None:
            self._arena.close()
        if self._client is not None:
            self._client.close()
        self._client = self._engine = self._arena = None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
