"""``Committer``: a worker's Commits, sent at its next step (or by a thread of its own).

``finish_save`` (vLLM's ``wait_for_save``) hands the step's Commit over and returns: vLLM may
reuse its blocks at once (the bytes are already in the arena, or, on CUDA, on their way: a Commit
goes out only once its save's ``SaveTicket`` has landed). The Commit names the written slots and
the daemon checksums them itself (``core.save.commit``).

Commits are sent at the start of a later step of the worker (``send``, from ``begin``): vLLM's
scheduler has just handed that step to the workers and waits for it, so the daemon's work on the
Commits (and on the step's Reserve, if it saves, sent right after) falls where the host's other core
has the least to do, rather than at a moment its scheduler or API server is busy; the engine thread
sends them without waiting and reads their outcomes at a later hook once they are in, so no other
thread wakes for them. A step sends once ``SEND_AT`` Commits are queued, or the oldest has waited
``HOLD_SECONDS``: a round trip's cost is mostly its own, not its blocks', so the Commits of a few
saving steps share one (``CommitMany``, each Commit landing or failing on its own; one per engine
where the daemon restarted in between); a Commit whose device copies are still in flight (CUDA)
waits for a later step. Where no step sends a Commit within ``HOLD_SECONDS`` and ``WINDOW_SECONDS``
of its handover, the committer thread lands it; where no step has begun for ``IDLE_SECONDS`` (the
engine went idle), at once, the stock's too: a block is visible to lookups at most about
``IDLE_SECONDS`` after its step once the engine idles, and ``HOLD_SECONDS`` while it runs. The
Commit of the worker's stock of blank slots (``step_stock``) is queued when the stock is due
(``send`` and the committer thread look), first, as one that has waited its hold. The same thread
closes a step's save (host KV) right after the step (``soon``): it reads the Reserve's answer,
copies the blocks and hands the Commit over while the engine thread samples and waits for the
next step, at a lower priority than the engine thread. The committer thread sleeps until what it
holds can be due (``IDLE_SECONDS`` after the last step began, a queued Commit's hold and window;
while the engine steps, each step's ``send`` lands what is due), looks every window only while
the engine idles with something held, and parks while it holds nothing (a handed-over save or
Commit wakes it): each wake of a thread costs CPU on the core it shares with the forward pass.
``harvest(wait=True)`` (and ``close``) lands every Commit at once.

With TP > 1, a step's Commit is *held* until the scheduler's verdict on that step
(``TierdConnectorMetadata.verdict``): the blocks of requests some rank failed to load under are
then committed as not written, so no rank stores what another rank computed on a failed load.

Outcomes, read by either thread, are applied by ``harvest`` (counters, a failed call
through ``DaemonLink.failed``) on the engine thread. A failed Commit loses its blocks: never
silently. They count as ``dropped_blocks`` (and ``lapsed_blocks`` where the write lease had
ended, a step slower than the lease), with a WARNING (at most one a minute, with the count
since the last).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import grpc

from tierd.connector.core.errors import classify, describe
from tierd.connector.core.link import WARN_EVERY_SECONDS, DaemonLink, Session
from tierd.connector.core.save import Reservation, commit_many
from tierd.types import BlockHash
from tierd.wire.call_error import CallError
from tierd.wire.client import CommitRefused, TierdClient
from tierd.wire.sent import Sent

from .cuda_copy import SaveTicket
from .stats import Counters
from .step_stock import StepStock

_log = logging.getLogger(__name__)

_Outcome = tuple[int, int, int, grpc.RpcError | None]  # stored, held already, lost, the error

WINDOW_SECONDS = 0.02
"""How long past ``HOLD_SECONDS`` a Commit no step has sent waits before the committer thread
lands it (module doc); both well inside any write lease, so a Commit never lapses for waiting."""

HELPER_NICE = 10
"""How much nicer than the engine thread the committer thread runs (``_lower_priority``)."""

SEND_AT = 4
"""Commits queued before a step's ``send`` sends them (fewer wait, up to ``HOLD_SECONDS``): each
round trip costs the daemon and the worker about as much as the blocks it carries."""

HOLD_SECONDS = 0.1
"""How long a Commit waits for others before a step sends it anyway (module doc)."""

IDLE_SECONDS = 0.04
"""No step has begun for this long: the engine idles (or its steps are long beside a round
trip), so the committer thread sends what is held at once, the stock's Commit too."""

BATCH = 64
"""Commits per round trip at most (the daemon's ``CommitMany`` limit)."""


@dataclass(slots=True)
class _Queued:
    """A Commit handed over, waiting to be sent."""

    reservation: Reservation
    written: list[bool]
    ticket: SaveTicket | None
    outcome: Future[_Outcome]
    at: float                           # when it was handed over
    names: list[BlockHash] = field(default_factory=list)  # a stock's: each slot's hash


@dataclass(slots=True)
class HeldCommit:
    """TP > 1: a step's Commit waiting for the scheduler's verdict on ``step``."""

    step: int
    reservation: Reservation
    written: list[bool]     # per reserved block: its slot was written (every layer)
    owners: list[str]       # per reserved block: the request it belongs to ("" if none)
    ticket: SaveTicket | None


class Committer:
    """One worker's Commits (see the module doc). Engine thread only, but the Commits it does
    not send itself go out on a thread of their own over a channel of their own."""

    def __init__(self, link: DaemonLink, counters: Counters, slot_bytes: int,
                 tp_size: int, clock: Callable[[], float] = time.monotonic,
                 stock: StepStock | None = None) -> None:
        """``stock``: the worker's stock of blank slots, whose Commits this sends when due."""
        self._link, self._counters, self._slot_bytes = link, counters, slot_bytes
        self._tp_size, self._clock, self._stock = tp_size, clock, stock
        self._lost = 0                  # blocks lost since the last WARNING
        self._warned = -WARN_EVERY_SECONDS
        self._futures: list[tuple[Session | None, Future[_Outcome]]] = []
        self._landed: deque[None] = deque()  # one entry per outcome set since the last look
        self._client: TierdClient | None = None  # the committer thread's
        self._held: list[HeldCommit] = []
        self._sent: list[tuple[Sent[list[int | CommitRefused]], list[_Queued], float]] = []
        self._cond = threading.Condition()  # the queue is shared with the committer thread
        self._queue: list[_Queued] = []
        self._soon: Callable[[], None] | None = None  # ``soon``'s
        self._parked = False            # the thread waits for a Commit (it holds nothing)
        self._looked = 0.0              # when the committer thread last looked
        self._stopping = False
        self._began = time.monotonic()  # when the last step's ``send`` ran
        self._thread = threading.Thread(target=self._loop, name="tierd-commit", daemon=True)
        self._thread.start()

    def soon(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the committer thread at once (unless another call replaces it
        first), at that thread's lower priority (``HELPER_NICE``): the engine thread goes on
        with the step meanwhile. The Commits ``task`` hands over wait for the next step's
        ``send`` (or a window). ``task`` must be safe to run there and a no-op where the
        engine thread did its work in the meantime."""
        with self._cond:
            self._soon = task
            self._cond.notify()

    def commit(self, step: int, reservation: Reservation, written: list[bool],
               owners: list[str], ticket: SaveTicket | None) -> None:
        """Commit ``reservation`` now (TP 1) or once the verdict on ``step`` came (TP > 1)."""
        if self._tp_size > 1:
            self._held.append(HeldCommit(step, reservation, written, owners, ticket))
        else:
            self._submit(reservation, written, ticket)

    def verdict(self, step: int, bad: dict[str, int]) -> bool:
        """Commit the held saves of steps up to ``step``, leaving out (as not written) the
        blocks of requests ``bad`` names for that step. True if it left a block out: until
        that Commit lands, the daemon counts the block as being written, and a Reserve of it
        would be told to skip it (``harvest(wait=True)`` first)."""
        keep: list[HeldCommit] = []
        left_out = False
        for held in self._held:
            if held.step > step:
                keep.append(held)
                continue
            for i, req_id in enumerate(held.owners):
                if held.written[i] and req_id in bad and held.step <= bad[req_id]:
                    held.written[i] = False
                    left_out = True
                    self._counters.count("dropped_blocks", 1)
            self._submit(held.reservation, held.written, held.ticket)
        self._held = keep
        return left_out

    def send(self, now: bool = False) -> None:
        """At the start of a step (vLLM has just handed it to the workers, so its scheduler
        waits): once ``SEND_AT`` are queued or the oldest has waited ``HOLD_SECONDS`` (with
        ``now``, at once, the stock's too: write-back saves of blocks vLLM has just given to
        other tokens, which are nowhere else until they land), send the Commits handed over so
        far, from this thread without waiting (``TierdClient.commit_many_sent``); ``harvest``
        reads their outcomes once they are in. A Commit whose device copies are still in flight
        (CUDA), and every one after it, waits for the next step (or the committer thread)."""
        self._began = time.monotonic()
        self._take_stock(idle=now)
        queue = self._queue
        if not queue or (not now and len(queue) < SEND_AT
                         and time.monotonic() - queue[0].at < HOLD_SECONDS):
            return  # wait for more (read without the lock: a stale look only sends later)
        with self._cond:
            ready = next((i for i, item in enumerate(self._queue)
                          if item.ticket is not None and not item.ticket.landed.query()),
                         len(self._queue))
            queued, self._queue = self._queue[:ready], self._queue[ready:]
        if queued:
            self._send_now(queued)

    def harvest(self, wait: bool = False, stock: bool = False) -> None:
        """Count the outcomes of landed Commits (of all of them, with ``wait``: those not sent
        yet are sent first, from this thread; with ``stock`` too the stock's, due or not)."""
        if stock:
            self._take_stock(force=True)
        if wait:
            with self._cond:
                queued, self._queue = self._queue, []
            for item in queued:
                if item.ticket is not None:
                    item.ticket.landed.synchronize()
            self._send_now(queued)
        if self._sent:
            self._read_sent(wait)
        if not wait and not self._landed:
            return  # no outcome came since the last look (the usual step)
        for _ in range(len(self._landed)):  # those that come during the look: the next one's
            self._landed.popleft()
        keep: list[tuple[Session | None, Future[_Outcome]]] = []
        with self._cond:  # the committer thread may submit one meanwhile (``soon``)
            futures, self._futures = self._futures, []
        for session, future in futures:
            if not wait and not future.done():
                keep.append((session, future))
                continue
            stored, held, lost, exc = future.result()
            if exc is not None:
                if self._client is not None:  # a fresh channel next time
                    self._client.close()
                    self._client = None
                if session is not None:  # a failure of an older session drops nothing
                    self._link.failed(exc, session, names_lease=True)
                self._warn_lost(lost, exc)
            self._counters.count("dropped_blocks", lost)
            self._counters.count("skipped_blocks", held)
            self._counters.count("saved_blocks", stored)
            self._counters.count("saved_bytes", stored * self._slot_bytes)
        with self._cond:
            self._futures[:0] = keep

    def _send_now(self, queued: list[_Queued]) -> None:
        """Send ``queued`` (device copies landed) from this thread without waiting: one
        CommitMany per engine and ``BATCH``; without a session they go back to the committer
        thread, whose call fails them as any call to a daemon that is down."""
        session = self._link.session
        if session is None:  # the committer thread's call fails them, off this thread
            with self._cond:
                self._queue[:0] = [replace(item, at=-WINDOW_SECONDS) for item in queued]
                self._cond.notify()
            return
        for batch in _batches(queued):
            try:
                sent = session.client.commit_many_sent(batch[0].reservation.engine_id, [
                    (item.reservation.lease_id, item.written, item.names) for item in batch])
            except grpc.RpcError as exc:
                _settle(batch, exc)
                continue
            self._sent.append((sent, batch, time.monotonic()))

    def _read_sent(self, wait: bool) -> None:
        """Read the outcomes of the Commits this thread sent whose answers are in (all, with
        ``wait``), into their futures. One unanswered for the link's ``timeout_seconds`` fails
        (DEADLINE_EXCEEDED) without being waited for: a daemon that hangs holds no more than
        that many seconds of them."""
        keep = []
        timeout = self._link.timeout_seconds
        for sent, batch, at in self._sent:
            results: list[int | CommitRefused] | grpc.RpcError
            if not wait and not sent.done():
                if time.monotonic() - at < timeout:
                    keep.append((sent, batch, at))
                    continue
                results = CallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no answer to CommitMany within {timeout:g} s")
            else:
                try:
                    results = sent.result()
                except grpc.RpcError as exc:
                    results = exc
            _settle(batch, results)
        self._sent = keep

    def _warn_lost(self, lost: int, exc: grpc.RpcError) -> None:
        """Count a failed Commit's ``lost`` blocks as lapsed where its lease had ended, and say
        so in a WARNING (at most one per ``WARN_EVERY_SECONDS``, naming the blocks lost since)."""
        lapsed = classify(exc, names_lease=True) == "lease"
        if lapsed:
            self._counters.count("lapsed_blocks", lost)
        self._lost += lost
        now = self._clock()
        if not self._lost or now - self._warned < WARN_EVERY_SECONDS:
            return
        _log.warning("tierd: %d saved blocks were not stored (%s)%s; counted in dropped_blocks",
                     self._lost, describe(exc),
                     ": the write lease ended before the Commit (a step slower than the "
                     "daemon's lease_seconds); raise lease_seconds" if lapsed else "")
        self._lost, self._warned = 0, now

    def close(self) -> None:
        """Land every submitted Commit and count it; Commits still waiting for a verdict are
        dropped (their reservations lapse on the daemon). Stops the thread."""
        self._counters.count("dropped_blocks", sum(sum(h.written) for h in self._held))
        self._held = []
        self.harvest(wait=True, stock=True)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(self._link.timeout_seconds + 1.0)
        if self._client is not None:
            self._client.close()

    def _submit(self, reservation: Reservation, written: list[bool],
                ticket: SaveTicket | None, names: list[BlockHash] | None = None,
                session: Session | None = None) -> None:
        """Queue a Commit for a later step's ``send`` (or the committer thread's window); a
        stock's (``names``, made on ``session``: its failure drops no later session) first,
        as one that has waited its hold."""
        outcome: Future[_Outcome] = Future()
        with self._cond:
            if names is None:
                self._queue.append(_Queued(reservation, written, ticket, outcome,
                                           time.monotonic()))
            else:
                self._queue.insert(0, _Queued(reservation, written, ticket, outcome,
                                              time.monotonic() - HOLD_SECONDS, names))
            self._futures.append((session or self._link.session, outcome))
            outcome.add_done_callback(lambda _: self._landed.append(None))
            if self._parked:
                self._cond.notify()

    def _take_stock(self, force: bool = False, idle: bool = False) -> None:
        """Queue the Commits of the stocks that are due (``StepStock.due``; ``idle``: their
        hold counts as passed)."""
        if self._stock is not None:
            for session, reservation, written, names in self._stock.due(force, idle):
                self._submit(reservation, written, None, names, session)

    def _committer_client(self) -> TierdClient:
        if self._client is None:
            self._client = self._link.new_client()
        return self._client

    def _loop(self) -> None:
        """Committer thread: run a ``soon`` task at once; when something held can be due
        (``_until_due``), land the Commits the engine thread has not sent within
        ``HOLD_SECONDS`` and a window of their handover (their device copies were in flight),
        or every one (the stock's too) once no step has begun for ``IDLE_SECONDS``; parked
        while nothing is held."""
        _lower_priority()
        while True:
            with self._cond:
                if self._stopping:
                    return
                if self._soon is None:
                    wait = self._until_due(time.monotonic())
                    if wait is None:
                        self._parked = True
                        self._cond.wait()
                        self._parked = False
                        continue
                    if wait > 0:
                        self._cond.wait(wait)
                        continue  # a task, a stop, or a step begun meanwhile: look again
                soon, self._soon = self._soon, None
            if soon is not None:
                _run(soon)
                continue
            now = self._looked = time.monotonic()
            engine_idle = now - self._began >= IDLE_SECONDS
            self._take_stock(idle=engine_idle)
            with self._cond:
                if not self._queue or (not engine_idle and
                                       now - self._queue[0].at < HOLD_SECONDS + WINDOW_SECONDS):
                    continue
                queued, self._queue = self._queue, []
            try:
                _landed(self._committer_client(), queued)
            except BaseException as exc:  # a bug: its Commits' waiters raise it, not hang
                for item in queued:
                    if not item.outcome.done():
                        item.outcome.set_exception(exc)
                raise

    def _until_due(self, now: float) -> float | None:
        """Seconds until the committer thread's next look (lock held; <= 0: now), None while
        it holds nothing (no Commit queued, no slot of a stock taken): ``IDLE_SECONDS`` after
        the last step began (no look is needed while steps begin: each one's ``send`` lands
        what is due), or a window after the last look once the engine idles; a queued
        Commit's hold and window at the latest."""
        if not self._queue and (self._stock is None or not self._stock.holding):
            return None
        idle_at = self._began + IDLE_SECONDS
        at = idle_at if idle_at > self._looked else self._looked + WINDOW_SECONDS
        if self._queue:
            at = min(at, self._queue[0].at + HOLD_SECONDS + WINDOW_SECONDS)
        return at - now


def _run(task: Callable[[], None]) -> None:
    """Run a task on the committer thread; one that raises is a bug: said, and the thread
    goes on."""
    try:
        task()
    except Exception:  # noqa: BLE001
        _log.exception("tierd: closing a save on the committer thread failed")


def _lower_priority() -> None:
    """Committer thread: run ``HELPER_NICE`` steps nicer than the thread that started it, so
    the engine thread on the same core keeps the core while it has work (best effort: a host
    that refuses leaves it as it is)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                  + HELPER_NICE))
    except (AttributeError, OSError):
        pass


def _batches(queued: list[_Queued]) -> list[list[_Queued]]:
    """``queued`` by engine (two where the daemon restarted in between), at most ``BATCH``
    Commits each, in order within each engine."""
    by_engine: dict[str, list[_Queued]] = {}
    for item in queued:
        by_engine.setdefault(item.reservation.engine_id, []).append(item)
    return [part[i:i + BATCH] for part in by_engine.values() for i in range(0, len(part), BATCH)]


def _settle(batch: list[_Queued], results: list[int | CommitRefused] | grpc.RpcError) -> None:
    """Resolve each Commit of ``batch`` with its outcome (``results``: per Commit, or the
    failure of the whole call)."""
    for i, item in enumerate(batch):
        result = results if isinstance(results, grpc.RpcError) else results[i]
        item.outcome.set_result((result, sum(item.written) - result, 0, None)
                                if isinstance(result, int) else
                                (0, 0, sum(item.written), result))


def _landed(client: TierdClient, queued: list[_Queued]) -> list[_Outcome]:
    """Committer thread: once each save's device copies are in the arena (its ticket, CUDA),
    publish the reservations, the daemon checksumming the written slots: one round trip per
    engine and ``BATCH``. Returns each Commit's outcome, in order."""
    for item in queued:
        if item.ticket is not None:
            item.ticket.landed.synchronize()
    for batch in _batches(queued):
        try:
            results: list[int | CommitRefused] | grpc.RpcError = list(commit_many(
                client, [(item.reservation, item.written, item.names) for item in batch]))
        except grpc.RpcError as exc:
            results = exc
        _settle(batch, results)
    return [item.outcome.result() for item in queued]
