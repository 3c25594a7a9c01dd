"""The Commit side of the gRPC edge: ``Commit`` and ``CommitMany`` requests turned into
``NodeStore`` calls, with each written slot checksummed by the daemon itself: a large Commit on
hashing threads (the GIL released), so the event loop serves other calls meanwhile; a small one
on the loop, where waking a thread would cost more than the hashing.

A ``CommitMany`` makes each of its Commits as ``Commit`` would, in order: a Commit that fails
with a domain error (its lease lapsed, a bad flag) fails alone, named in its outcome with the
status code it would have had, and the others land. The written slots of all of them are
checksummed in one pass.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from tierd.checksum import checksums_at
from tierd.daemon.chunks import run_steps
from tierd.daemon.node import NodeStore
from tierd.daemon.status import DOMAIN_ERRORS, MAX_DETAILS_CHARS, status_for
from tierd.types import BlockHash
from tierd.v1 import tierd_pb2 as pb
from tierd.wire import convert

HASH_THREADS = 2
"""Threads that checksum the slots of a large Commit."""

INLINE_HASH_BYTES = 1 << 20
"""A Commit whose written slots hold at most this many bytes is checksummed on the event loop
itself (xxh3 at several GB/s: well under a millisecond), not handed to the hashing threads:
waking a thread costs more than hashing a few small blocks."""

MAX_COMMITS = 64
"""Commits one CommitMany carries at most."""

_Spans = list[tuple[int, int] | None]
"""A Commit's written slots as arena (offset, length), None for a slot not written."""


class CommitEdge:
    """Commits of engines the caller has already checked (``engine_id`` is the tenant's)."""

    def __init__(self, store: NodeStore) -> None:
        self._store = store
        self._hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="tierd-hash")

    async def commit(self, engine_id: str, request: pb.CommitRequest) -> int:
        """One Commit: the blocks that became stored (a domain error raises)."""
        spans, names = self._written(engine_id, request)
        return await self._publish(engine_id, request, names, await self._checksums(spans))

    async def commit_many(self, engine_id: str,
                          request: pb.CommitManyRequest) -> pb.CommitManyResponse:
        """Each Commit of ``request``, in order (module doc); more than ``MAX_COMMITS`` is a
        ``ValueError`` for the whole call."""
        if len(request.commits) > MAX_COMMITS:
            raise ValueError(f"a CommitMany carries at most {MAX_COMMITS} commits, got "
                             f"{len(request.commits)}: send the rest in another")
        outcomes = [pb.CommitOutcome() for _ in request.commits]
        taken: list[tuple[int, list[BlockHash], int, int]] = []  # index, names, span range
        spans: _Spans = []
        for i, item in enumerate(request.commits):
            try:
                if item.engine_id not in ("", request.engine_id):
                    raise ValueError(f"commit {i} names engine {item.engine_id!r}, not the "
                                     f"request's {request.engine_id!r}: leave it empty")
                its, names = self._written(engine_id, item)
            except DOMAIN_ERRORS as exc:  # fails this commit alone
                _refused(outcomes[i], exc)
                continue
            taken.append((i, names, len(spans), len(spans) + len(its)))
            spans += its
        checksums = await self._checksums(spans)
        for i, names, begin, end in taken:
            try:
                outcomes[i].stored = await self._publish(engine_id, request.commits[i], names,
                                                         checksums[begin:end])
            except DOMAIN_ERRORS as exc:
                _refused(outcomes[i], exc)
        return pb.CommitManyResponse(outcomes=outcomes)

    def _written(self, engine_id: str, request: pb.CommitRequest
                 ) -> tuple[_Spans, list[BlockHash]]:
        """A Commit's written slots, and its blank slots' names."""
        if request.blocks:
            raise ValueError("engine checksums (CommitRequest.blocks) are no longer accepted: "
                             "send written flags, the daemon checksums the slots; upgrade the "
                             "engine's tierd")
        names = convert.hashes_from_pb(request.block_hashes)
        return self._store.written_spans(request.lease_id, list(request.written),
                                         engine_id=engine_id, names=names), names

    async def _checksums(self, spans: _Spans) -> list[int | None]:
        """``checksums_at(spans)``: on the loop itself up to ``INLINE_HASH_BYTES``, else split
        over the hashing threads while the loop serves other calls."""
        if sum(span[1] for span in spans if span is not None) <= INLINE_HASH_BYTES:
            return checksums_at(spans)
        loop = asyncio.get_running_loop()
        step = -(-len(spans) // HASH_THREADS) or 1
        parts = await asyncio.gather(*(loop.run_in_executor(self._hashers, checksums_at,
                                                            spans[i:i + step])
                                       for i in range(0, len(spans), step)))
        return [c for part in parts for c in part]

    async def _publish(self, engine_id: str, request: pb.CommitRequest, names: list[BlockHash],
                       checksums: list[int | None]) -> int:
        """Store a Commit's checksummed slots: the blocks that became stored."""
        return await run_steps(self._store.commit_steps(request.lease_id, checksums,
                                                        engine_id=engine_id, names=names))


def _refused(outcome: pb.CommitOutcome, exc: Exception) -> None:
    """Fill ``outcome`` with the status a Commit failing with the domain error ``exc`` alone
    would get."""
    code = status_for(exc)
    assert code is not None, "only domain errors are caught"
    outcome.code, outcome.message = code.value[0], str(exc)[:MAX_DETAILS_CHARS]
