"""The daemon calls of ``TierdConnector``'s scheduler side, run as jobs on its ``core.runner``.

Every Acquire is a hold: the workers load the blocks under it, and its Release tells the daemon
how many they loaded (what it counts as served). The jobs touch no scheduler state: ``ask``
returns a ``Reply`` that the scheduler thread settles (``SchedulerSide._settle``) at a later ask
of the same request; ``end_leases`` releases pins; ``report_filtered`` tells the daemon of the
lookups the presence filter answered (batched by ``filtered.FilteredLookups``). Each runs on a
runner thread and may block for the daemon's call deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import grpc

from tierd.connector.core.link import DaemonLink, Session
from tierd.types import BlockHash, Tier
from tierd.wire.replies import AcquiredBlocks


@dataclass(frozen=True, slots=True)
class Reply:
    """What a lookup job learned, for the scheduler thread to settle."""

    asked: float                   # clock time the job began (leases run from here)
    tiers: list[Tier] | None       # rank 0's held run, chain order; None: the daemon failed
    got: list[AcquiredBlocks | None]  # per rank from 0: its Acquire (None: that call failed)
    counted: bool                  # the daemon counted this job as the request's lookup
    stream: bool = False           # a hit with SSD blocks handed to the workers, nothing pinned
    arenas: list[str] = field(default_factory=list)  # per rank: the arena of its Acquire's slots
    answered: float = 0.0          # clock time the job ended


@dataclass(frozen=True, slots=True)
class Asking:
    """A lookup job in flight for a waiting request's blocks ``[start, end)``."""

    start: int
    end: int
    hashes: list[BlockHash]        # the blocks asked for, from ``start``
    job: Future[Reply]
    counting: bool                 # the job's Acquire is the request's counted lookup
    submitted: float               # clock time the job was queued


@dataclass(frozen=True, slots=True)
class Answer:
    """What the daemon said of a waiting request's blocks ``[start, end)``: the first ``held``
    are held (pinned or streamed, ``Pin``), the rest are not. vLLM asks again at every step a
    request waits; such asks are answered from here."""

    start: int
    held: int
    end: int


def ask(links: Sequence[DaemonLink], wanted: list[BlockHash], known_tiers: list[Tier] | None,
        *, stream: bool, clock: Callable[[], float] = time.monotonic) -> Reply:
    """``_ask``, its reply stamped with the clock time it ended (``Reply.answered``)."""
    return replace(_ask(links, wanted, known_tiers, stream=stream, clock=clock),
                   answered=clock())


def _ask(links: Sequence[DaemonLink], wanted: list[BlockHash], known_tiers: list[Tier] | None,
         *, stream: bool, clock: Callable[[], float]) -> Reply:
    """The lookup job of ``wanted`` (``links[r]``: TP rank ``r``'s registration). With
    ``known_tiers`` None: rank 0's Probe (a hold) of the leading DRAM run, counted by the daemon
    as the request's lookup and naming the tiers of the held blocks after the run, then the same run
    acquired on every other rank; or, with SSD blocks after the run, the run released and
    either nothing pinned (``stream``: the workers acquire it as they copy it) or the whole
    held run staged into DRAM and acquired on every rank. With ``known_tiers`` (asked before):
    an uncounted Acquire of ``wanted`` on every rank. Connects first (a link that cannot:
    ``tiers`` None)."""
    asked = clock()
    if not all(link.connect() for link in links):
        return Reply(asked, None, [], False)
    if known_tiers is not None:
        acquired, arenas = acquire_all(wanted, links)
        return Reply(asked, known_tiers, acquired, False, arenas=arenas)
    first, session = links[0], links[0].session
    if session is None:
        return Reply(asked, None, [], False)
    try:
        got = session.client.probe(session.engine_id, wanted, hold=True)
    except grpc.RpcError as exc:
        first.failed(exc, session)
        return Reply(asked, None, [], False)
    dram: list[Tier] = ["dram"] * got.num_blocks
    tiers = dram + list(got.held_after)
    if not got.held_after:
        rest, arenas = acquire_all(wanted[:got.num_blocks], links[1:]) if tiers else ([], [])
        return Reply(asked, tiers, [got, *rest], True,
                     arenas=[session.engine.arena_name, *arenas])
    if got.num_blocks:  # the run is acquired again below, or streamed by the workers
        end_leases(links, [(0, got.lease_id)], None)
    if stream:
        return Reply(asked, tiers, [], True, stream=True)
    acquired, arenas = acquire_all(wanted[:len(tiers)], links)
    return Reply(asked, tiers, acquired, True, arenas=arenas)


def acquire_all(hashes: list[BlockHash], links: Sequence[DaemonLink]
                ) -> tuple[list[AcquiredBlocks | None], list[str]]:
    """Acquire ``hashes`` on every link at once (SSD blocks staged into DRAM) and wait: per
    link its answer (None for a link that is down or whose call failed) and the arena of the
    session it was made on ("" for None)."""
    sent: list[tuple[DaemonLink, Session, Future[AcquiredBlocks]] | None] = []
    for link in links:
        session = link.session
        sent.append(None if session is None else
                    (link, session, session.client.acquire_async(session.engine_id, hashes,
                                                                 hold=True)))
    out: list[AcquiredBlocks | None] = []
    arenas: list[str] = []
    for entry in sent:
        got: AcquiredBlocks | None = None
        if entry is not None:
            link, session, reply = entry
            try:
                got = reply.result()
            except grpc.RpcError as exc:
                link.failed(exc, session)
        out.append(got)
        arenas.append("" if got is None or entry is None else entry[1].engine.arena_name)
    return out, arenas


def end_leases(links: Sequence[DaemonLink], leases: list[tuple[int, str]],
               corrupt_from: int | None, served: int | None = None) -> None:
    """Release ``leases`` ((rank, lease id)); ``corrupt_from``: the first block some worker
    failed to check, which the daemon re-checks and drops if it is corrupt; ``served``: how
    many blocks of each the workers loaded (counted as served by the daemon). A lease
    of a dropped session is gone with it; a failed call is classified by its link."""
    for rank, lease_id in leases:
        link = links[rank]
        session = link.session
        if session is None:
            continue
        try:
            session.client.release(session.engine_id, lease_id, corrupt_from=corrupt_from,
                                   served=served)
        except grpc.RpcError as exc:  # the lease ended (nothing held any more), or the
            link.failed(exc, session, names_lease=True)  # daemon is gone


def reply_of(job: Future[Reply]) -> Reply:
    """A finished lookup job's reply; a job that raised (a bug, logged by the runner) counts as
    a daemon that did not answer."""
    error = job.exception()
    return Reply(0.0, None, [], False) if error is not None else job.result()


def report_filtered(link: DaemonLink, tokens: int) -> None:
    """Count ``tokens`` of lookups answered from the presence filter (certain misses, no round
    trip) as queried on the daemon: an empty Reserve carrying them, so its hit ratio covers
    every lookup. Lost with a daemon that is down (they are only counts)."""
    session = link.session
    if session is None:
        return
    try:
        session.client.reserve(session.engine_id, [], filtered_query_tokens=tokens)
    except grpc.RpcError as exc:
        link.failed(exc, session)
