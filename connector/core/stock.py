"""Blank slots reserved ahead of a front end's next store, so that its copy starts at once.

A store names its blocks in a Reserve round trip before it can copy (``core.save``). A
``SlotStock`` keeps one reservation of *blank* slots (``Reserve`` with ``blank_slots``), asked
for right after each store, so the next store takes it, copies into its first slots at once and
names them at its Commit
(``CommitRequest.block_hashes``; a block the node holds already is stored once, its slot freed,
and slots past the store's blocks are freed too).

Its size is the largest of the last ``_HISTORY`` stores; no stock is kept while that is over a
quarter of this layout's slots in the arena or over the daemon's ``max_blocks_per_request``
(such stores Reserve as before: a stock never takes much of the node's DRAM). A stock is used
only while more than half of its lease is left, so a copy never runs near its deadline; an older
one, or one too small for the store at hand (or short of room: the daemon keeps every engine's
blank slots within a quarter of its arena, ``blank_fraction``), is aborted. An engine's first
store, and a store that finds the stock taken by another store, Reserve as before.
Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc

from tierd.wire.replies import ReservedSlots

from .link import Session
from .save import Reservation

_HISTORY = 8
"""Stores whose sizes decide the stock's (the largest of them)."""


@dataclass(frozen=True, slots=True)
class _Held:
    session: Session
    reply: Future[ReservedSlots]
    sent: float  # clock() when asked: the lease ends no sooner than sent + seconds_left


class SlotStock:
    """At most one reservation of blank slots for the next store (module doc)."""

    def __init__(self, timeout_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout, self._clock = timeout_seconds, clock
        self._lock = threading.Lock()
        self._held: _Held | None = None
        self._sizes: deque[int] = deque(maxlen=_HISTORY)

    def take(self, session: Session, count: int) -> Reservation | None:
        """The stock, for a store of ``count`` blocks on ``session``: its ``slot_ids[:count]``
        (each with room) are the store's slots, to be named at the Commit; None where there is
        no fitting, fresh stock (the store Reserves itself). May wait for a stock still being
        reserved (at most ``timeout_seconds``)."""
        with self._lock:
            held, self._held = self._held, None
        if held is None or held.session is not session:  # none, or a daemon since forgotten
            return None
        try:
            got = held.reply.result(timeout=self._timeout)
        except FutureTimeout:
            held.reply.add_done_callback(lambda _: self._abort(held))
            return None
        except Exception:  # noqa: BLE001  # an RpcError: the store Reserves itself
            return None
        reservation = Reservation(session.engine_id, got.lease_id, got.slot_ids,
                                  got.already_stored)
        if (len(got.slot_ids) < count or None in got.slot_ids[:count]
                or self._clock() > held.sent + got.seconds_left / 2):
            self._abort(held)
            return None
        return reservation

    def refill(self, session: Session, count: int) -> None:
        """A store of ``count`` blocks was made: ask for the next stock (without waiting)
        unless one is held or no stock is kept for stores this large (module doc)."""
        assert session.slots is not None, "a stock needs the mapped arena"
        with self._lock:
            self._sizes.append(count)
            want = max(self._sizes)
            cap = min(session.engine.max_blocks_per_request, session.slots.num_slots // 4)
            if self._held is not None or not 0 < want <= cap:
                return
            try:
                reply = session.client.reserve_blank_async(session.engine_id, want)
            except grpc.RpcError:  # the channel closed: the next store Reserves itself
                return
            self._held = _Held(session, reply, self._clock())

    def _abort(self, held: _Held) -> None:
        """Free a stock's slots without waiting (best effort: else they lapse)."""
        try:
            got = held.reply.result(timeout=0)
            held.session.client.abort_async(held.session.engine_id, got.lease_id)
        except Exception:  # noqa: BLE001  # no reservation, or no daemon: nothing to free
            pass
