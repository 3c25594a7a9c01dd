"""``Committer``: a worker's Commits, in order, off the engine thread.

``finish_save`` (vLLM's ``wait_for_save``) hands the step's Commit over and returns: vLLM may
reuse its blocks at once (the bytes are already in the arena, or, on CUDA, on their way: the
committer thread waits for the save's ``SaveTicket`` before it commits). The Commit names the
written slots and the daemon checksums them itself (``core.save.commit``).

Commits are sent together: the first one handed over starts a window of ``WINDOW_SECONDS``, and
every Commit handed over until it closes goes in the same round trip (``CommitMany``, each
Commit landing or failing on its own; one per engine where the daemon restarted within the
window). The daemon then wakes once per window rather than once
per step, which on a host whose cores the engine's threads fill is time taken from the
forward pass. A block is visible to lookups at most a window later; ``harvest(wait=True)``
(and ``close``) closes the window at once.

With TP > 1, a step's Commit is *held* until the scheduler's verdict on that step
(``TierdConnectorMetadata.verdict``): the blocks of requests some rank failed to load under are
then committed as not written, so no rank stores what another rank computed on a failed load.

The committer thread only returns outcomes; ``harvest`` applies them (counters, a failed call
through ``DaemonLink.failed``) on the engine thread. A failed Commit loses its blocks: never
silently. They count as ``dropped_blocks`` (and ``lapsed_blocks`` where the write lease had
ended, a step slower than the lease), with a WARNING (at most one a minute, with the count
since the last).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from tierd.connector.core.errors import classify, describe
from tierd.connector.core.link import WARN_EVERY_SECONDS, DaemonLink, Session
from tierd.connector.core.runner import Runner
from tierd.connector.core.save import Reservation, commit_many
from tierd.wire.client import TierdClient

from .cuda_copy import SaveTicket
from .stats import Counters

_log = logging.getLogger(__name__)

_Outcome = tuple[int, int, grpc.RpcError | None]  # blocks stored, blocks lost, the error

WINDOW_SECONDS = 0.02
"""How long the first Commit handed over waits for others to go with it (module doc); well
inside any write lease, so a Commit never lapses for waiting."""

BATCH = 64
"""Commits per round trip at most (the daemon's ``CommitMany`` limit)."""


@dataclass(slots=True)
class _Queued:
    """A Commit handed over, waiting for its window to close."""

    reservation: Reservation
    written: list[bool]
    ticket: SaveTicket | None
    outcome: Future[_Outcome]


@dataclass(slots=True)
class HeldCommit:
    """TP > 1: a step's Commit waiting for the scheduler's verdict on ``step``."""

    step: int
    reservation: Reservation
    written: list[bool]     # per reserved block: its slot was written (every layer)
    owners: list[str]       # per reserved block: the request it belongs to ("" if none)
    ticket: SaveTicket | None


class Committer:
    """One worker's Commits (see the module doc). Engine thread only, but ``submit``ted
    Commits run on a thread of their own over a channel of their own."""

    def __init__(self, link: DaemonLink, counters: Counters, slot_bytes: int,
                 tp_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._link, self._counters, self._slot_bytes = link, counters, slot_bytes
        self._tp_size, self._clock = tp_size, clock
        self._lost = 0                  # blocks lost since the last WARNING
        self._warned = -WARN_EVERY_SECONDS
        self._runner = Runner(1, "tierd-commit", ("commit",))  # one thread: Commits in order
        self._futures: list[tuple[Session | None, Future[_Outcome]]] = []
        self._client: TierdClient | None = None
        self._held: list[HeldCommit] = []
        self._lock = threading.Lock()  # the queue is shared with the committer thread
        self._queue: list[_Queued] = []
        self._close_window = threading.Event()

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

    def harvest(self, wait: bool = False) -> None:
        """Count the outcomes of landed Commits (of all of them, with ``wait``: the open window
        is closed first)."""
        if wait:
            self._close_window.set()
        keep: list[tuple[Session | None, Future[_Outcome]]] = []
        for session, future in self._futures:
            if not wait and not future.done():
                keep.append((session, future))
                continue
            stored, lost, exc = future.result()
            if exc is not None:
                if self._client is not None:  # a fresh channel next time
                    self._client.close()
                    self._client = None
                if session is not None:  # a failure of an older session drops nothing
                    self._link.failed(exc, session, names_lease=True)
                self._warn_lost(lost, exc)
            self._counters.count("dropped_blocks", lost)
            self._counters.count("saved_blocks", stored)
            self._counters.count("saved_bytes", stored * self._slot_bytes)
        self._futures = keep
        if wait:  # every window has been sent: the next one waits its full time
            self._close_window.clear()

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
        self.harvest(wait=True)
        self._runner.stop(self._link.timeout_seconds + 1.0)
        if self._client is not None:
            self._client.close()

    def _submit(self, reservation: Reservation, written: list[bool],
                ticket: SaveTicket | None) -> None:
        """Queue a Commit; the first of a window also queues the job that sends the window."""
        if self._client is None:
            self._client = self._link.new_client()
        outcome: Future[_Outcome] = Future()
        with self._lock:
            opens = not self._queue
            self._queue.append(_Queued(reservation, written, ticket, outcome))
        if opens:
            job = self._runner.submit("commit", functools.partial(self._send_window,
                                                                  self._client))
            assert job is not None, "the commit kind has no limit"
        self._futures.append((self._link.session, outcome))

    def _send_window(self, client: TierdClient) -> None:
        """Committer thread: wait for the window to close, then send its Commits."""
        self._close_window.wait(WINDOW_SECONDS)
        with self._lock:
            queued, self._queue = self._queue, []
            self._close_window.clear()
        for start in range(0, len(queued), BATCH):
            part = queued[start:start + BATCH]
            try:
                outcomes = _commit_batch(client, part)
            except BaseException as exc:  # a bug: its Commits' waiters raise it, not hang
                for item in queued[start:]:
                    item.outcome.set_exception(exc)
                raise
            for item, outcome in zip(part, outcomes):
                item.outcome.set_result(outcome)


def _commit_batch(client: TierdClient, batch: list[_Queued]) -> list[_Outcome]:
    """Committer thread: once each save's device copies are in the arena (its ticket, CUDA),
    publish the reservations, the daemon checksumming the written slots: one round trip per
    engine they name (two where the daemon restarted within the window: the old session's and
    the new one's)."""
    for item in batch:
        if item.ticket is not None:
            item.ticket.landed.synchronize()
    by_engine: dict[str, list[int]] = {}
    for i, item in enumerate(batch):
        by_engine.setdefault(item.reservation.engine_id, []).append(i)
    outcomes: list[_Outcome] = [(0, 0, None)] * len(batch)
    for indices in by_engine.values():
        part = [batch[i] for i in indices]
        try:
            results: list[int | grpc.RpcError] = list(commit_many(
                client, [(item.reservation, item.written) for item in part]))
        except grpc.RpcError as exc:
            results = [exc] * len(part)
        for i, item, result in zip(indices, part, results):
            outcomes[i] = ((result, 0, None) if isinstance(result, int) else
                           (0, sum(item.written), result))
    return outcomes
