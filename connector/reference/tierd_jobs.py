"""What ``TierdHooks``' engine thread hands its runner: the queued jobs (saves, Releases,
hot-tier reports) of a ``core.link.Session``, with the merge of several reports into one.

Internal to ``tierd_hooks``; a job of a session that is gone is dropped when it runs, never
applied to the next session.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierd.connector.core.lease import Lease
from tierd.connector.core.link import Session
from tierd.connector.reference.staging import Span
from tierd.types import BlockHash


@dataclass(frozen=True, slots=True)
class SaveJob:
    session: Session
    hashes: list[BlockHash]
    span: Span
    queued: float  # time.monotonic() at save
    query_tokens: int = 0  # lookups answered from the presence filter, for the node's count


@dataclass(frozen=True, slots=True)
class ReleaseJob:
    session: Session
    lease_id: str
    corrupt_from: int | None = None  # first block that failed its checksum: the daemon re-checks


@dataclass(frozen=True, slots=True)
class Held:
    """A prefix ``lookup`` pinned for one request: its lease lives until that request's
    ``load`` (or ``request_finished`` / ``step_end``, whichever comes first) queues the
    Release."""

    session: Session
    hashes: list[BlockHash]     # the acquired blocks' hashes, chain order
    lease: Lease


@dataclass(frozen=True, slots=True)
class HotJob:
    session: Session
    stored: list[BlockHash]
    removed: list[BlockHash]
    cleared: bool
    queued: float  # time.monotonic() at step_end
    speed: float = 0.0  # measured prefill tokens per second to report (0: none)


def merged_reports(reports: list[HotJob]) -> HotJob:
    """One report with the net effect of ``reports`` (in order) as the daemon applies each
    (``cleared``, then ``stored``, then ``removed``): a hash's last event wins."""
    if len(reports) == 1:
        return reports[0]
    held: dict[BlockHash, bool] = {}
    cleared = False
    for report in reports:
        if report.cleared:
            held.clear()
            cleared = True
        held.update(dict.fromkeys(report.stored, True))
        held.update(dict.fromkeys(report.removed, False))
    speed = next((r.speed for r in reversed(reports) if r.speed), 0.0)  # the latest
    return HotJob(reports[0].session, [h for h, v in held.items() if v],
                   [h for h, v in held.items() if not v], cleared, reports[0].queued, speed)


Job = SaveJob | ReleaseJob | HotJob
GATHERED = (SaveJob, HotJob)
"""Jobs a gathering takes together over ``save_batch_s``; a Release ends a gathering."""
