"""A worker's load of a hit the scheduler answered from the presence filter (``LoadSpec.probe``):
no pin came with it, so the worker pins the blocks itself by one Probe just before its copy
(``probe_run``) and releases them without waiting (``release_later``)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from tierd.connector.core.lease import Lease, Release, probe_async, release_async
from tierd.connector.core.link import DaemonLink, Session
from tierd.types import BlockHash
from tierd.wire.replies import AcquiredBlocks

_log = logging.getLogger(__name__)

PROBE_WAIT_SECONDS = 0.05
"""How long a load waits for the Probe of a hit the scheduler answered from the presence filter
(one round trip, usually a millisecond or two) before it gives up and vLLM recomputes."""


def probe_run(link: DaemonLink, session: Session, hashes: list[BlockHash],
              clock: Callable[[], float]) -> Lease | None:
    """Pin the leading DRAM run of ``hashes`` (``lease.probe_async``: the daemon counts the
    request's lookup; nothing is read from disk); None if the daemon failed or did not answer
    within ``PROBE_WAIT_SECONDS`` (the forward pass waits no longer: vLLM recomputes the
    blocks; a late answer's lease is released when it comes)."""
    try:
        pending = probe_async(session.client, session.engine_id, hashes, clock=clock)
    except grpc.RpcError as exc:
        link.failed(exc, session)
        return None
    try:
        return Lease.of(session.engine_id, pending.reply.result(PROBE_WAIT_SECONDS),
                        pending.asked)
    except grpc.RpcError as exc:
        link.failed(exc, session)
    except TimeoutError:
        _log.warning("tierd: the daemon did not answer a load's Probe within %.0f ms; vLLM "
                     "recomputes its %d blocks", PROBE_WAIT_SECONDS * 1e3, len(hashes))
        pending.reply.add_done_callback(functools.partial(_release_late, session))
    return None


def release_later(session: Session, now: Release) -> Release:
    """A ``Release`` of ``session``'s leases that does not wait (the copy's validity rests on
    the lease's deadline); one naming a corrupt block goes through ``now`` at once, so the
    daemon drops that copy before this engine's next Reserve could skip it as held."""

    def later(lease: Lease, corrupt_from: int | None) -> bool | None:
        if corrupt_from is not None:
            return now(lease, corrupt_from)
        if lease.num_blocks:
            with contextlib.suppress(grpc.RpcError):  # the channel closed: it ends at its deadline
                release_async(session.client, lease)
        return None
    return later


def _release_late(session: Session, reply: Future[AcquiredBlocks]) -> None:
    """Release the lease of a Probe answered after its load gave up on it (on a call thread)."""
    if reply.exception() is None and reply.result().num_blocks:
        with contextlib.suppress(grpc.RpcError):  # else it ends at its deadline
            session.client.release_async(session.engine_id, reply.result().lease_id)
