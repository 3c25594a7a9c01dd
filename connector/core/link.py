"""``DaemonLink``: one engine registration on the daemon, for every front end.

A link owns at most one ``Session`` at a time: a channel (``TierdClient``), the engine's
registration for one ``Layout`` and, with ``attach``, the mapped DRAM arena (and, with
``presence``, the daemon's presence filter). A daemon that is down is an expected state, never an
exception to the engine: the link reports itself down (``session`` is None), the front end
answers "no match" and skips saves, and ``connect`` tries again once the back-off has passed
(``ClientSettings.retry_seconds`` doubling up to ``retry_max_seconds``; a fresh channel each
time, so gRPC's own reconnect back-off never hides a daemon that came back).

A ``Session`` is immutable: work started under one (a queued Release, a streamed load, a
pending Commit) keeps using its channel and mapping, and ``failed`` drops a session only while
it is still the current one, so a late failure of an old session never drops the next.

Failed calls go through ``failed``, which applies the one classification of ``core.errors``.

Thread-safety: ``connect``, ``failed`` and ``close`` may be called from several threads (a
lock orders them); the session-valued properties are single reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tierd.connector.core.arena_slots import ArenaSlots
from tierd.connector.core.errors import DROPS, Failure, classify, describe
from tierd.connector.core.settings import ClientSettings
from tierd.paths import default_socket_path
from tierd.wire.access import denied
from tierd.wire.arena import ShmArena
from tierd.wire.client import ChannelClosed, EngineHandle, TierdClient
from tierd.wire.layout import Layout
from tierd.wire.presence import PresenceView

_log = logging.getLogger(__name__)

WARN_EVERY_SECONDS = 60.0
"""While the daemon stays out of reach, at most one WARNING per this many seconds."""


@dataclass(frozen=True, slots=True)
class Session:
    """One registration: valid until the link drops it (then its calls fail, and work queued
    for it is dropped by its owner, never applied to a newer session)."""

    client: TierdClient
    engine: EngineHandle
    mapping: ShmArena | None        # the arena file, mapped (``attach``)
    arena: Any                      # the whole arena as a uint8 torch tensor (zero copy), or None
    slots: ArenaSlots | None        # batched access to this layout's slots in ``arena``
    presence: PresenceView | None   # the daemon's presence filter (``presence``), if published

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id


SessionListener = Callable[[Session | None], None]
"""Told of each new session and of each drop (None); runs on the thread that caused it."""


class DaemonLink:
    """One engine registration on the daemon; see the module doc.

    ``client``/``engine`` (and ``arena``/``arena_tensor``/``slots`` with ``attach``) are the
    current session's, valid only while ``up``."""

    def __init__(self, settings: ClientSettings, layout: Layout, engine_name: str | None = None,
                 *, attach: bool, presence: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 on_session: SessionListener | None = None) -> None:
        """Remember what to register (``engine_name``: default ``settings.engine_name``);
        nothing is sent until ``connect``. ``ValueError`` for an invalid layout."""
        layout.validate()
        self.layout, self.settings = layout, settings
        self._name = settings.engine_name if engine_name is None else engine_name
        self._attach, self._presence, self._clock = attach, presence, clock
        self._on_session = on_session
        self._session: Session | None = None
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._wait = settings.retry_seconds
        self._warned_at: float | None = None  # when the last WARNING of this outage was

    # -- the current session -------------------------------------------------------------------

    @property
    def session(self) -> Session | None:
        """The current session, or None while the daemon is out of reach."""
        return self._session

    @property
    def up(self) -> bool:
        return self._session is not None

    @property
    def timeout_seconds(self) -> float:
        """Deadline of each daemon call (``ClientSettings.timeout_seconds``)."""
        return self.settings.timeout_seconds

    @property
    def retry_at(self) -> float:
        """When ``connect`` tries again (on the link's clock) while down."""
        return self._next_try

    @property
    def client(self) -> TierdClient:
        return self._current().client

    @property
    def engine(self) -> EngineHandle:
        return self._current().engine

    @property
    def arena(self) -> ShmArena:
        mapping = self._current().mapping
        assert mapping is not None, "the link was made without attach"
        return mapping

    @property
    def arena_tensor(self) -> Any:
        """The whole arena as a uint8 torch tensor (zero copy)."""
        arena = self._current().arena
        assert arena is not None, "the link was made without attach"
        return arena

    @property
    def slots(self) -> ArenaSlots:
        """Batched access to this layout's slots in the arena (checksums where the slots lie,
        no copy)."""
        slots = self._current().slots
        assert slots is not None, "the link was made without attach"
        return slots

    def may_connect(self) -> bool:
        """Up, or down with the back-off passed (``connect`` would try now). Never blocks."""
        return self._session is not None or self._clock() >= self._next_try

    def _current(self) -> Session:
        session = self._session
        assert session is not None, "use the link only while it is up"
        return session

    # -- connecting and failing ----------------------------------------------------------------

    def connect(self) -> bool:
        """True if up; otherwise try to register (and attach) now, unless the back-off has not
        passed. Blocks for at most one round trip. Never raises for a daemon that is absent or
        refuses: logs it (a WARNING the first time and at most once a minute after, naming the
        socket dialed and the daemon's default) and stays down."""
        if self._session is not None:
            return True
        now = self._clock()
        if now < self._next_try:
            return False
        with self._lock:
            if self._session is not None:
                return True
            session = self._register()
            if session is None:
                self._next_try = self._clock() + self._wait
                self._wait = min(max(self._wait * 2, 1e-3), self.settings.longest_retry)
                return False
            self._session, self._wait = session, self.settings.retry_seconds
            self._warned_at = None
        _log.info("tierd: engine %s registered at %s", session.engine_id, session.client.target)
        if self._on_session is not None:
            self._on_session(session)
        return True

    def failed(self, exc: grpc.RpcError, session: Session | None = None, *,
               names_lease: bool = False) -> Failure:
        """Account for a failed call of ``session`` (default: the current one) and return its
        classification (``core.errors``). "forgotten" and "down" drop the session if it is still
        the current one: "forgotten" re-registers at the next ``connect``, "down" after the
        back-off. "lease" and "request" keep it, and so does a call made on a channel the link
        already closed (``ChannelClosed``: an older session's late failure, whichever session
        the caller names)."""
        failure = classify(exc, names_lease=names_lease)
        if isinstance(exc, ChannelClosed):  # the session it was made on is already dropped
            _log.debug("tierd call on a dropped session: %s", describe(exc))
            return failure
        if failure not in DROPS:
            _log.debug("tierd call failed: %s", describe(exc))
            return failure
        with self._lock:
            current = self._session
            if current is None or (session is not None and session is not current):
                return failure  # dropped already, or a late failure of an older session
            self._session = None
            wait = 0.0 if failure == "forgotten" else self._wait
            self._next_try = self._clock() + wait
        _log.warning("tierd call failed (%s); reconnecting in %.1f s", describe(exc), wait)
        self._end(current)
        if self._on_session is not None:
            self._on_session(None)
        return failure

    def new_client(self) -> TierdClient:
        """A channel of its own (a committer or streaming thread): the same daemon, settings
        and tenant as the link's."""
        return self.settings.new_client()

    def close(self) -> None:
        """Unregister (best effort) and drop the channel and the arena mapping."""
        with self._lock:
            session, self._session = self._session, None
        if session is None:
            return
        try:
            session.client.unregister_engine(session.engine_id)
        except grpc.RpcError as exc:
            _log.debug("tierd unregister failed: %s", describe(exc))
        self._end(session)

    def _register(self) -> Session | None:
        client = self.settings.new_client()
        mapping: ShmArena | None = None
        try:
            engine = client.register_engine(self.layout, self._name)
            if engine.geometry.slot_bytes != self.layout.block_bytes:
                raise ValueError(f"daemon slots are {engine.geometry.slot_bytes} bytes, this "
                                 f"layout's blocks {self.layout.block_bytes}: upgrade tierd")
            if self._attach:
                mapping = ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
        except (grpc.RpcError, OSError, ValueError) as exc:
            client.close()
            self._unreachable(client.target, exc)
            return None
        arena = mapping.as_tensor() if mapping is not None else None  # pre-faulted
        slots = ArenaSlots(arena, engine.geometry) if arena is not None else None
        presence = None
        if self._presence and engine.presence_name:
            try:
                presence = PresenceView(engine.presence_name, engine.arena_directory)
            except (OSError, ValueError) as exc:  # then every lookup asks: slower, still right
                _log.warning("tierd presence filter not mapped (%s): asking on every lookup",
                             exc)
        return Session(client, engine, mapping, arena, slots, presence)

    def _unreachable(self, target: str, exc: BaseException) -> None:
        """Log a failed connect: a WARNING naming the target (and, for a socket, the daemon's
        default one) at the first failure and at most every ``WARN_EVERY_SECONDS`` after,
        DEBUG otherwise, so an engine never runs without tierd silently nor floods its log."""
        now = self._clock()
        loud = self._warned_at is None or now - self._warned_at >= WARN_EVERY_SECONDS
        if loud:
            self._warned_at = now
        reason, hint = describe(exc), ""
        if target.startswith("unix:"):
            path, default = target.removeprefix("unix:"), default_socket_path()
            reason = denied(path, "socket") or reason  # a socket this user may not open
            hint = (f"; {path} is tierd's default socket: start `tierd serve`"
                    if os.path.abspath(path) == os.path.abspath(default) else
                    f"; `tierd serve` listens on {default} by default: point the engine's "
                    "socket_path (TIERD_SOCKET_PATH) at the --socket-path the daemon runs with")
        (_log.warning if loud else _log.debug)(
            "tierd daemon at %s unavailable (%s); running without it, next try in %.1f s%s",
            target, reason, self._wait, hint)

    @staticmethod
    def _end(session: Session) -> None:
        """Close the session's channel and its ``ShmArena``. The arena tensor (and the slots
        over it) hold a mapping of their own (``ShmArena.as_tensor``), so a copy another thread
        still makes through them stays valid until it lets go of them."""
        session.client.close()
        if session.mapping is not None:
            session.mapping.close()
