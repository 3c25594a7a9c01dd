"""A worker's load of a hit the scheduler answered from the presence filter (``LoadSpec.probe``):
no pin came with it, so the worker pins the blocks itself by one Probe just before its copy
(``probe_run``) and releases them without waiting (``release_later``). Both calls are sent from
the worker's own thread (``TierdClient.probe_sent``, ``release_sent``): the Probe's answer is
read by the thread that waits for it, and the Release's at the worker's next step (``Unread``),
so no call thread wakes on the forward pass's core for them."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from tierd.connector.core.lease import Lease, Release
from tierd.connector.core.link import DaemonLink, Session
from tierd.types import BlockHash
from tierd.wire.client import Sent
from tierd.wire.replies import AcquiredBlocks

_log = logging.getLogger(__name__)

PROBE_WAIT_SECONDS = 0.05
"""How long a load waits for the Probe of a hit the scheduler answered from the presence filter
(one round trip, usually a millisecond or two) before it gives up and vLLM recomputes."""


def probe_run(link: DaemonLink, session: Session, hashes: list[BlockHash],
              clock: Callable[[], float]) -> Lease | None:
    """Pin the leading DRAM run of ``hashes`` (a Probe: the daemon counts the request's
    lookup; nothing is read from disk); None if the daemon failed or did not answer within
    ``PROBE_WAIT_SECONDS`` (the forward pass waits no longer: vLLM recomputes the blocks; a
    late answer's lease is released when it comes, on one of the client's call threads)."""
    asked = clock()
    try:
        pending = session.client.probe_sent(session.engine_id, hashes)
        if not pending.done(PROBE_WAIT_SECONDS):
            _log.warning("tierd: the daemon did not answer a load's Probe within %.0f ms; vLLM "
                         "recomputes its %d blocks", PROBE_WAIT_SECONDS * 1e3, len(hashes))
            session.client.when_answered(pending, _release_late(session))
            return None
        return Lease.of(session.engine_id, pending.result(), asked)
    except grpc.RpcError as exc:
        link.failed(exc, session)
    return None


class Unread:
    """Calls sent without waiting whose answers nobody needs (a probed load's Release): read at
    the worker's next step once in (``reap``), so their lane connections go back to the
    client; one not answered within ``timeout`` seconds is abandoned. Engine thread only."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout, self._clock = timeout, clock
        self._calls: list[tuple[Sent[bool], float]] = []

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, sent: Sent[bool]) -> None:
        self._calls.append((sent, self._clock()))

    def reap(self) -> None:
        """Read the answers that are in; abandon those older than the timeout."""
        keep = []
        for sent, at in self._calls:
            if sent.done():
                with contextlib.suppress(grpc.RpcError):  # a lease that ended: nothing to do
                    sent.result()
            elif self._clock() - at >= self._timeout:
                sent.abandon()
            else:
                keep.append((sent, at))
        self._calls = keep

    def close(self) -> None:
        """Abandon every call whose answer was not read."""
        for sent, _ in self._calls:
            sent.abandon()
        self._calls = []


def release_later(session: Session, now: Release, unread: Unread) -> Release:
    """A ``Release`` of ``session``'s leases that does not wait (the copy's validity rests on
    the lease's deadline): sent from this thread, its answer left to ``unread``; one naming a
    corrupt block goes through ``now`` at once, so the daemon drops that copy before this
    engine's next Reserve could skip it as held."""

    def later(lease: Lease, corrupt_from: int | None) -> bool | None:
        if corrupt_from is not None:
            return now(lease, corrupt_from)
        if lease.num_blocks:
            with contextlib.suppress(grpc.RpcError):  # the channel closed: it ends at its deadline
                unread.add(session.client.release_sent(lease.engine_id, lease.lease_id))
        return None
    return later


def _release_late(session: Session) -> Callable[[Sent[AcquiredBlocks]], None]:
    """Release the lease of a Probe answered after its load gave up on it (on a call thread)."""
    def release(pending: Sent[AcquiredBlocks]) -> None:
        with contextlib.suppress(grpc.RpcError):  # failed, or the lease ends at its deadline
            reply = pending.result()
            if reply.num_blocks:
                session.client.release(session.engine_id, reply.lease_id)
    return release
