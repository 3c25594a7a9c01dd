"""``StepStock``: blank slots reserved ahead and shared by the saves of several steps.

A save by hash costs a Reserve round trip before its copy and a Commit after it, and the
daemon's and the worker's cost of a round trip is mostly its own, not its blocks'. A worker
(host KV, one TP rank) instead keeps one reservation of *blank* slots (``Reserve`` with
``blank_slots``): each saving step takes the next slots of it (``take``, no round trip), copies
its blocks there after the step, and records their hashes (``done``). The stock is committed
once, naming every written slot (``CommitRequest.block_hashes``; a block the node holds already
is stored once, its slot freed, as are the slots no step wrote), when no step holds slots of it
and it is full, the oldest write has waited ``commits.HOLD_SECONDS``, the engine idles, or half
of its lease is gone (``due``, from the committer's ``send`` or its thread), and the next stock
is asked for then (answered by the next save). A step whose blocks do not fit in what is left
gives the stock up (committed at the next ``due``) and saves by hash, as does one that finds the
next stock's answer not in yet; after a stock came back with no slot, none is asked for
``NO_ROOM_SECONDS``.

Its size is twice the slots the last stock handed out before it was given up (what the steps
of one hold wrote, with room to grow; the first stock: four times the largest save), at least
the largest of the last ``HISTORY`` saves and ``MIN_SLOTS``, at most the daemon's
``max_blocks_per_request`` and a quarter of this layout's slots in the arena
(the daemon also keeps every engine's blank slots within ``blank_fraction`` of it: slots it could
not grant end the stock's usable part). Thread-safe: ``take`` on the engine thread, ``done`` on
whichever thread closes the step's save.

A stock is never committed while a step holds slots of it (the Commit ends the lease and frees
the unwritten slots), so a step that outlasts what is left of the stock's lease (at least half
of it) holds back the saves of the steps that wrote into the stock just before it (within the
hold): the slow step re-offers its own saves (``worker``), and those lapse with the stock's
lease (a WARNING and ``lapsed_blocks``, as any Commit that comes too late).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from tierd.connector.core.link import Session
from tierd.connector.core.save import Reservation, reservation_of
from tierd.types import BlockHash
from tierd.wire.replies import ReservedSlots
from tierd.wire.sent import Sent

HISTORY = 8
"""Saves whose sizes decide the next stock's (the largest of them, four times)."""

MIN_SLOTS = 32
"""Blank slots a stock asks for at least."""

NO_ROOM_SECONDS = 1.0
"""How long no stock is asked for after one came back without a slot (the node's DRAM, or its
share for blank slots, is taken): saves Reserve by hash meanwhile."""

BLANK = BlockHash(bytes(32))
"""The name of a slot no step wrote (the Commit frees it: its flag is False)."""


@dataclass(slots=True)
class Stock:
    """One blank reservation: asked (``reply``) until ``reservation`` is read; ``used`` slots
    handed out so far, ``open_steps`` of those steps not yet ``done``."""

    session: Session
    sent: float                         # clock() when asked: its lease runs from here
    reply: Sent[ReservedSlots]
    reservation: Reservation | None = None
    names: list[BlockHash] = field(default_factory=list)
    written: list[bool] = field(default_factory=list)
    used: int = 0
    open_steps: int = 0
    first_at: float = 0.0               # clock() when its first slots were handed out

    @property
    def renew_at(self) -> float:
        """When half of its lease is gone (no slot of it is handed out after)."""
        assert self.reservation is not None
        return self.sent + self.reservation.seconds_left / 2


@dataclass(frozen=True, slots=True)
class Taken:
    """``count`` slots from index ``first`` of ``stock``'s reservation."""

    stock: Stock
    first: int
    count: int


class StepStock:
    """The stock of one worker; see the module doc."""

    def __init__(self, hold_seconds: Callable[[], float], clock: Callable[[], float]) -> None:
        self._hold, self._clock = hold_seconds, clock
        self._lock = threading.Lock()
        self._stock: Stock | None = None
        self._ended: list[Stock] = []  # given up, to be committed (or aborted) by ``due``
        self._sizes: deque[int] = deque(maxlen=HISTORY)
        self._last_used: int | None = None  # slots the last stock given up handed out
        self._no_room_until = 0.0

    def take(self, session: Session, count: int) -> Taken | None:
        """``count`` slots of the stock for one step's save, or None: the save Reserves by
        hash (no answered stock with room, or none kept for saves this large); a stock that
        is stale or has no room left is given up and the next one asked for."""
        now = self._clock()
        with self._lock:
            self._sizes.append(count)
            stock = self._stock
            if stock is not None and stock.session is not session:  # a daemon since forgotten:
                if stock.reservation is not None:  # its Commit fails, its blocks counted lost
                    self._ended.append(stock)
                stock = self._stock = None
            if stock is None:
                self._ask(session, now)
                return None
            if stock.reservation is None:
                if not stock.reply.done():
                    return None
                if not self._answered(stock, wait=False):
                    self._stock = None
                    return None
            assert stock.reservation is not None
            slots = stock.reservation.slot_ids[stock.used:stock.used + count]
            if len(slots) < count or None in slots or now >= stock.renew_at:
                if not stock.reservation.slot_ids or stock.reservation.slot_ids[0] is None:
                    self._no_room_until = now + NO_ROOM_SECONDS
                if not stock.open_steps:
                    self._ended.append(stock)
                    self._last_used = stock.used
                    self._ask(session, now)
                return None
            taken = Taken(stock, stock.used, count)
            stock.used += count
            stock.open_steps += 1
            stock.first_at = stock.first_at or now
            return taken

    def done(self, taken: Taken, names: list[BlockHash], written: bool) -> None:
        """The step's save of ``taken`` is over: its slots hold ``names`` (``written``) or
        nothing (freed at the stock's Commit)."""
        with self._lock:
            stock = taken.stock
            if written:
                stock.names[taken.first:taken.first + taken.count] = names
                stock.written[taken.first:taken.first + taken.count] = [True] * taken.count
            stock.open_steps -= 1

    def due(self, force: bool = False, idle: bool = False
            ) -> list[tuple[Session, Reservation, list[bool], list[BlockHash]]]:
        """The Commits (session, reservation, written flags, names) of the stocks that are due
        (module doc; with ``force``, every answered one no step is in, and no next one is asked
        for; with ``idle``, one written into is due whatever its hold), those stocks given up; a
        due stock nothing was written into is aborted instead."""
        now = self._clock()
        if not force and not self._ended and not self._due(self._stock, now, idle):
            return []  # the usual look (read without the lock: a stale one leaves it to the next)
        with self._lock:
            ended, self._ended = self._ended, []
            stock = self._stock
            if force and stock is not None and not self._answered(stock, wait=True):
                stock = self._stock = None  # its Reserve failed: nothing was reserved
            if stock is not None and ((force and stock.reservation is not None
                                       and not stock.open_steps) or self._due(stock, now, idle)):
                ended.append(stock)
                self._stock = None
                if not force:
                    self._last_used = stock.used
                    self._ask(stock.session, now)  # answered by the next save
        out = []
        for stock in ended:
            assert stock.reservation is not None
            if not any(stock.written):
                _abort(stock, wait=force)
                continue
            last = max(i for i, w in enumerate(stock.written) if w) + 1
            out.append((stock.session, stock.reservation, stock.written, stock.names[:last]))
        return out

    def _due(self, stock: Stock | None, now: float, idle: bool) -> bool:
        """``stock`` is answered, no step is in it, and it is full, half of its lease is gone,
        or its oldest write waited its hold (or the engine idles)."""
        return (stock is not None and stock.reservation is not None and not stock.open_steps
                and (now >= stock.renew_at or (bool(stock.used) and (
                    stock.used >= len(stock.reservation.slot_ids)
                    or idle or now - stock.first_at >= self._hold()))))

    @staticmethod
    def _answered(stock: Stock, wait: bool) -> bool:
        """Read the stock's answer if it is in (waiting for it with ``wait``); False where its
        Reserve failed."""
        if stock.reservation is None and (wait or stock.reply.done()):
            try:
                stock.reservation = reservation_of(stock.session.engine_id, stock.reply.result())
            except grpc.RpcError:
                return False
            stock.names = [BLANK] * len(stock.reservation.slot_ids)
            stock.written = [False] * len(stock.reservation.slot_ids)
        return True

    @property
    def holding(self) -> bool:
        """Some step took slots of a stock not yet committed (``due`` will close it)."""
        stock = self._stock
        return bool(self._ended) or (stock is not None and stock.used > 0)

    def _ask(self, session: Session, now: float) -> None:
        """Send the blank Reserve of the next stock (lock held), unless none is kept for
        saves this large."""
        self._stock = None
        if now < self._no_room_until:
            return
        assert session.slots is not None, "a stock needs the mapped arena"
        largest = max(self._sizes)
        grown = 4 * largest if self._last_used is None else 2 * self._last_used
        want = min(session.engine.max_blocks_per_request, session.slots.num_slots // 4,
                   max(MIN_SLOTS, largest, grown))
        if largest > want:
            return
        try:
            reply = session.client.reserve_blank_sent(session.engine_id, want)
        except grpc.RpcError:  # the channel closed: saves Reserve by hash meanwhile
            return
        self._stock = Stock(session, now, reply)


def _abort(stock: Stock, wait: bool) -> None:
    """Free a stock nothing was written into, waiting for it with ``wait`` (else it lapses
    where the Abort fails)."""
    assert stock.reservation is not None
    client, engine_id, lease_id = (stock.session.client, stock.session.engine_id,
                                   stock.reservation.lease_id)
    try:
        if wait:
            client.abort(engine_id, lease_id)
        else:
            client.abort_async(engine_id, lease_id)
    except Exception:  # noqa: BLE001  # no daemon: its slots lapse with the session
        pass
