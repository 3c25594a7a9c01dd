"""A worker's load of a hit the scheduler answered from the presence filter (``LoadSpec.probe``):
no pin came with it, so the worker pins the blocks itself by one Probe (``Probes``) and releases
them after its copy without waiting (``release_later``). The Probe goes out at the step's first
hook (vLLM's ``handle_preemptions``, before it prepares the step's inputs), so the daemon answers
while vLLM does that work, and is waited for at the load. Both calls are sent from the worker's
own thread (``TierdClient.probe_sent``, ``release_sent``): the Probe's answer is read by the
thread that waits for it, and the Release's at the worker's next step (``Unread``), so no call
thread wakes on the forward pass's core for them."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tierd.connector.core.lease import Lease, Release
from tierd.connector.core.link import DaemonLink, Session
from tierd.types import BlockHash
from tierd.wire.replies import AcquiredBlocks
from tierd.wire.sent import Sent

_log = logging.getLogger(__name__)

PROBE_WAIT_SECONDS = 0.05
"""How long a load waits for the Probe of a hit the scheduler answered from the presence filter
(one round trip, usually a millisecond or two) before it gives up and vLLM recomputes."""


@dataclass(frozen=True, slots=True)
class _Probing:
    """A Probe sent, its answer not read yet."""

    session: Session
    pending: Sent[AcquiredBlocks]
    asked: float                        # clock time it was sent (its lease runs from here)


class Probes:
    """The Probes of a step's probed loads: sent ahead (``send``) and taken at the load
    (``lease``). Engine thread only."""

    def __init__(self, link: DaemonLink, clock: Callable[[], float]) -> None:
        self._link, self._clock = link, clock
        self._sent: dict[str, _Probing] = {}

    def send(self, session: Session, req_id: str, hashes: list[BlockHash]) -> None:
        """Send the Probe of ``req_id``'s load now (a failed send leaves it to ``lease``; one
        sent before for it and never taken is given up on)."""
        earlier = self._sent.pop(req_id, None)
        if earlier is not None:
            _drop(earlier)
        asked = self._clock()
        try:
            self._sent[req_id] = _Probing(session, session.client.probe_sent(
                session.engine_id, hashes), asked)
        except grpc.RpcError as exc:
            self._link.failed(exc, session)

    def lease(self, session: Session, req_id: str, hashes: list[BlockHash]) -> Lease | None:
        """Pin the leading DRAM run of ``hashes`` by the Probe sent for ``req_id`` (one sent
        now if none was, or one of another session): the daemon counts the request's lookup;
        nothing is read from disk. None if the daemon failed or did not answer within
        ``PROBE_WAIT_SECONDS`` (the forward pass waits no longer: vLLM recomputes the blocks;
        a late answer's lease is released when it comes, on one of the client's call
        threads)."""
        probing = self._sent.pop(req_id, None)
        if probing is not None and probing.session is not session:
            _drop(probing)
            probing = None
        if probing is None:
            self.send(session, req_id, hashes)
            probing = self._sent.pop(req_id, None)
            if probing is None:
                return None
        try:
            if probing.pending.done(PROBE_WAIT_SECONDS):
                return Lease.of(session.engine_id, probing.pending.result(), probing.asked)
        except grpc.RpcError as exc:
            self._link.failed(exc, session)
            return None
        _log.warning("tierd: the daemon did not answer a load's Probe within %.0f ms; vLLM "
                     "recomputes its %d blocks", PROBE_WAIT_SECONDS * 1e3, len(hashes))
        _drop(probing)
        return None

    def __len__(self) -> int:
        """Probes sent and not taken yet."""
        return len(self._sent)

    def drop_all(self) -> None:
        """Give up on the Probes no load took (their leases released when they come)."""
        for probing in self._sent.values():
            _drop(probing)
        self._sent = {}


class Unread:
    """Calls sent without waiting whose answers nobody needs (a probed load's Release, a
    prefill speed's report): read at the worker's next step once in (``reap``), so their lane
    connections go back to the client; one not answered within ``timeout`` seconds is
    abandoned. Engine thread only."""

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


def _drop(probing: _Probing) -> None:
    """Release the lease of a Probe whose load gave up on it once it is answered (on one of
    the client's call threads)."""
    def release(pending: Sent[AcquiredBlocks]) -> None:
        with contextlib.suppress(grpc.RpcError):  # failed, or the lease ends at its deadline
            reply = pending.result()
            if reply.num_blocks:
                probing.session.client.release(probing.session.engine_id, reply.lease_id)
    with contextlib.suppress(grpc.RpcError):  # the channel closed: it ends at its deadline
        probing.session.client.when_answered(probing.pending, release)
