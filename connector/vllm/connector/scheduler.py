"""The scheduler half of the vLLM adapter: which blocks to load and which to save, per step.

Metadata only (no KV bytes). Per request scheduled from the waiting queue, one ``Lookup`` (the
tier of each hit, for vLLM's hit-source stats; the one the daemon counts for its hit ratio, so
once per request, as vLLM counts its own prefix-cache queries) and one ``Acquire`` per TP rank:
**the hit it reports is pinned** under a lease, so between this answer and the workers' load
only a dead daemon can make the load fail. vLLM asks again at every step a request waits; those
asks are answered from the first answer without a round trip while its pin is fresh. A hit
with SSD blocks is not waited for. With host KV it is an asynchronous load (vLLM's
``load_async``), not pinned here: the workers acquire and copy it chunk by chunk as the daemon
reads it (``streaming``) and report it through ``get_finished``. With CUDA KV its Acquires run
as futures while the daemon stages the blocks into DRAM, and the lookup answers None until
they resolve (vLLM asks again at its next step). A pin is released on
every path: when every worker has reported the load done (``TierdWorkerMetadata.loaded``), when
vLLM allocates no external tokens, when the request is looked up afresh, finishes or is aborted
(an abandoned staging is released as its Acquires resolve), and at the latest when its lease
expires.

The plan for each step goes to the workers as a ``TierdConnectorMetadata``:

* loads: the blocks ``get_num_new_matched_tokens`` promised, in the vLLM block ids that
  ``update_state_after_alloc`` reports for those positions;
* saves: for every scheduled request, the full blocks this step completes (computed tokens +
  scheduled tokens), once each, never the loaded ones or the local prefix-cache hits. Each save
  names the blocks of loads not yet reported (this step's and earlier ones') that its request's
  table holds (``depends_on``), so a worker drops it if one of those fails: nothing computed on
  top of a failed load is stored.

After a failed load (``TierdWorkerMetadata.failed``) every tracked request holding a failed block
rewinds its save position to that block, and is named in the next step's ``recomputing``: from
then on its saves are the blocks vLLM recomputes. With TP > 1 each step's metadata also carries
the verdict on the steps every rank has reported (``TierdConnectorMetadata.verdict``), which
releases the Commits the workers hold.

Block hashes are vLLM's own ``request.block_hashes``: vLLM 0.33 attaches its block hasher to
every request whenever a KV connector is configured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from tierd.connector.core.link import DaemonLink
from tierd.types import BlockHash, Tier
from tierd.wire.replies import AcquiredBlocks

from .metadata import LoadSpec, SaveSpec, TierdConnectorMetadata, TierdWorkerMetadata

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    """A request between ``update_state_after_alloc`` and ``request_finished``."""

    request: Any
    next_save: int                 # first block position not yet handed to workers to save
    block_ids: list[int] = field(default_factory=list)  # vLLM block id of each position


@dataclass(slots=True)
class _Pin:
    """The leases (one per TP rank) that hold a request's reported hit in the daemon's DRAM."""

    start: int                     # block position of the first hit
    hashes: list[BlockHash]        # the hit blocks, chain order
    tiers: list[Tier]              # where each was when looked up
    leases: list[tuple[int, str]]  # (rank, lease id)
    reports: int = 0               # workers that reported the load done
    block_ids: list[int] = field(default_factory=list)  # where vLLM loads it (once planned)
    failed_from: int | None = None  # first hit block some worker failed to load
    stream: bool = False           # loaded asynchronously, the workers acquire it (no leases)
    skipped: int = 0               # leading leased blocks dropped since (the local hit grew)
    fresh_until: float = float("inf")  # clock time after which the answer is asked again


@dataclass(frozen=True, slots=True)
class _Answer:
    """What the daemon said of a waiting request's blocks ``[start, end)``: the first ``held``
    are held (pinned or streamed, ``_Pin``), the rest are not. vLLM asks again at every step a
    request waits; such asks are answered from here."""

    start: int
    held: int
    end: int


_IN_DRAM: tuple[Tier, ...] = ("dram", "hbm")
"""Tiers an Acquire pins without a disk read (an HBM report implies the daemon's DRAM copy is
what it would serve)."""


@dataclass(slots=True)
class _Staging:
    """A hit whose Acquires are in flight (the daemon stages its SSD blocks into DRAM)."""

    start: int
    hashes: list[BlockHash]
    tiers: list[Tier]
    futures: list[Future[AcquiredBlocks]]  # one per TP rank
    deadline: float
    clock: Callable[[], float]
    end: int = 0                   # the end of the range asked for (``_Answer.end``)
    asked: float = 0.0             # clock time the Acquires were sent

    def ready(self) -> bool:
        return all(f.done() for f in self.futures)

    def expired(self) -> bool:
        return self.clock() >= self.deadline


class SchedulerSide:
    """State of the scheduler-side connector. Called from vLLM's scheduler thread only.

    ``links[r]`` is the registration under TP rank ``r``'s layout (rank 0's namespace is the
    one looked up)."""

    def __init__(self, links: Sequence[DaemonLink], *, load: bool, save: bool,
                 stream: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        """``stream``: hand hits with SSD blocks to the workers as asynchronous loads (host
        KV: the workers copy each chunk as the daemon reads it); else stage them (CUDA)."""
        assert links, "need one link per TP rank"
        self._links = list(links)
        self._stream = stream
        self._clock = clock
        self._staging: dict[str, _Staging] = {}
        self._abandoned: list[tuple[int, Future[AcquiredBlocks]]] = []  # (rank, Acquire)
        self._load, self._save = load, save
        self._block_size = links[0].layout.block_size
        self._tracked: dict[str, _Tracked] = {}
        self._pins: dict[str, _Pin] = {}
        self._loads: list[LoadSpec] = []
        self._recomputing: set[str] = set()
        self._local: dict[str, int] = {}          # block position past the local hit, per lookup
        self._answers: dict[str, _Answer] = {}    # waiting requests the daemon answered for
        self._counted: set[str] = set()           # requests whose Lookup the daemon counted
        self._failures_seen: set[int] = set()     # failed blocks reported since the last build
        self._step = 0                            # steps built
        self._reported = 0                        # steps whose workers' report arrived
        self._bad_until: dict[str, int] = {}      # request -> last step whose saves are bad
        self._last_save_step = 0                  # last step that planned a save
        self._verdict_sent = 0                    # step the last verdict covered
        self._warned_unhashed = False

    # -- lookups and pins --------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (the local prefix-cache hit, block-aligned) that
        tierd holds and has now pinned for this request: full blocks only, and never the block
        holding the request's last token (vLLM must compute that one to sample). 0 if the
        daemon is unreachable.

        A hit with SSD blocks never makes the scheduler wait for a disk: with ``stream`` it is
        answered at once as an asynchronous load (``streams``: vLLM parks the request while the
        workers copy it as the daemon reads it; nothing pinned here); otherwise None while the
        daemon stages it into DRAM (vLLM asks again at its next step). The first ask of a
        request blocks for a Lookup (the one the daemon counts for its hit ratio) and, for a
        DRAM hit, an Acquire round trip.

        vLLM asks again at every step a request waits (for KV space, say): such an ask is
        answered from the first answer (``_answered``), with no round trip, while its pin is
        fresh (less than half its lease gone) and the local hit has not shrunk. Otherwise the
        range is acquired again without a Lookup (counted nothing), as futures, and the ask
        answers None until they resolve. A hit answered this way is pinned like any other, so
        a block the daemon lost since fails its load and vLLM recomputes it."""
        req_id, bs = request.request_id, self._block_size
        start = -(-num_computed_tokens // bs)
        self._local[req_id] = start
        staging = self._staging.pop(req_id, None)
        if staging is not None:
            if staging.start == start and not staging.ready() and not staging.expired():
                self._staging[req_id] = staging
                return None
            if staging.start == start:
                staged = self._settle(req_id, staging)
                return (start + staged) * bs - num_computed_tokens if staged else 0
            self._abandon(staging)  # vLLM's local hit moved since: ask afresh
        end = self._end(request, start)
        known = self._answered(req_id, start, end)
        if known is not None:
            return (start + known) * bs - num_computed_tokens if known else 0
        before = self._pins.get(req_id)
        self._unpin(req_id)
        if end <= start or not all(link.connect() for link in self._links):
            return 0
        wanted = [BlockHash(h) for h in self._hashes(request)[start:end]]
        if req_id in self._counted:  # asked before: Acquires alone, counted nothing
            seen = {before.start + i: t for i, t in enumerate(before.tiers)} if before else {}
            tiers: list[Tier] = [seen.get(start + i, "dram") for i in range(len(wanted))]
            self._staging[req_id] = self._stage(start, wanted, tiers, end, block=False)
            return None
        looked_up = self._look_up(wanted)
        if looked_up is None:
            return 0
        self._counted.add(req_id)
        tiers, hits = looked_up, wanted[:len(looked_up)]
        if not hits:
            self._answers[req_id] = _Answer(start, 0, end)
            return 0
        on_disk = any(tier not in _IN_DRAM for tier in tiers)
        if on_disk and self._stream:  # the workers acquire it as they copy it
            self._pins[req_id] = _Pin(start, hits, list(tiers), [], stream=True)
            self._answers[req_id] = _Answer(start, len(hits), end)
            return (start + len(hits)) * bs - num_computed_tokens
        staging = self._stage(start, hits, tiers, end, block=not on_disk)
        if on_disk:
            self._staging[req_id] = staging
            return None
        held = self._settle(req_id, staging)
        return (start + held) * bs - num_computed_tokens if held else 0

    def _end(self, request: Any, start: int) -> int:
        """The end of the block range to ask the daemon for from ``start``: the full blocks
        that leave the last token out, cut to the daemon's ``max_blocks_per_request`` (``start``
        when there is nothing to ask)."""
        usable = (int(request.num_tokens) - 1) // self._block_size
        if not self._load or usable <= start:
            return start
        hashes = self._hashes(request)
        most = min(int(link.engine.max_blocks_per_request) if link.up else 1 << 30
                   for link in self._links)
        return max(start, min(usable, len(hashes), start + most))

    def _answered(self, req_id: str, start: int, end: int) -> int | None:
        """Blocks from ``start`` held for ``req_id`` as its last answer says, its pin cut to
        them; None if that answer cannot tell (none yet, the local hit shrank, the range grew,
        the pin was planned, released or is no longer fresh)."""
        answer = self._answers.get(req_id)
        if answer is None or start < answer.start or end > answer.end:
            return None
        if start >= answer.start + answer.held:  # the daemon held nothing from here
            self._unpin(req_id)
            return 0
        pin = self._pins.get(req_id)
        if (pin is None or pin.block_ids or pin.start > start
                or (not pin.stream and self._clock() >= pin.fresh_until)):
            return None
        skip = start - pin.start
        del pin.hashes[:skip], pin.tiers[:skip], pin.hashes[end - start:], pin.tiers[end - start:]
        pin.start, pin.skipped = start, pin.skipped + skip
        return len(pin.hashes)

    def _settle(self, req_id: str, staging: _Staging) -> int:
        """Pin what ``staging``'s Acquires hold (``_collect``) and remember the answer unless a
        call failed; the blocks held."""
        pin = self._collect(staging)
        if pin is not None:
            self._pins[req_id] = pin
        held = len(pin.hashes) if pin is not None else 0
        if all(f.exception() is None for f in staging.futures):
            self._answers[req_id] = _Answer(staging.start, held, staging.end)
        return held

    def streams(self, req_id: str) -> bool:
        """The hit last reported for ``req_id`` is an asynchronous (streamed) load."""
        pin = self._pins.get(req_id)
        return pin is not None and pin.stream

    def _look_up(self, wanted: list[BlockHash]) -> list[Tier] | None:
        """Where rank 0's daemon holds the leading run of ``wanted`` (None if unreachable)."""
        first = self._links[0]
        try:
            return list(first.client.lookup(first.engine.engine_id, wanted))
        except grpc.RpcError as exc:
            first.failed(exc)
            return None

    def _stage(self, start: int, hits: list[BlockHash], tiers: list[Tier], end: int, *,
               block: bool) -> _Staging:
        """Start an Acquire of ``hits`` (rank 0 holds them in ``tiers``, as far as known) on
        every rank: with ``block`` one blocking round trip (all in DRAM: no disk read), else
        futures while the daemon stages the SSD blocks into DRAM. ``end``: the end of the range
        asked for."""
        asked = self._clock()
        # A hold: the workers' Acquires load the blocks and count them as served.
        if block:
            futures = [_now(link.client.acquire, link.engine.engine_id, hits, hold=True)
                       for link in self._links]
        else:
            futures = [link.client.acquire_async(link.engine.engine_id, hits, hold=True)
                       for link in self._links]
        return _Staging(start, hits, list(tiers), futures,
                        asked + self._links[0].timeout_seconds, self._clock, end, asked)

    def _collect(self, staging: _Staging) -> _Pin | None:
        """Wait for ``staging``'s Acquires and pin the prefix every rank holds (the shortest
        wins), fresh until half the shortest lease has gone. None if some rank holds none or its
        call failed (leases taken are released)."""
        pin = _Pin(staging.start, list(staging.hashes), list(staging.tiers), [])
        for rank, (link, future) in enumerate(zip(self._links, staging.futures)):
            try:
                got = future.result()
            except grpc.RpcError as exc:
                if link.up:
                    link.failed(exc)
                pin.hashes = []
                continue
            if got.num_blocks:
                pin.leases.append((rank, got.lease_id))
                pin.fresh_until = min(pin.fresh_until, staging.asked + got.seconds_left / 2)
            if got.num_blocks == 0 or not pin.hashes:
                pin.hashes = []
            else:
                del pin.hashes[got.num_blocks:], pin.tiers[got.num_blocks:]
        if not pin.hashes:
            self._release(pin)
            return None
        return pin

    def _abandon(self, staging: _Staging) -> None:
        """Drop a staging nobody will use: its leases are released as its Acquires resolve
        (``_sweep``, on this thread)."""
        self._abandoned += [(rank, future) for rank, future in enumerate(staging.futures)]

    def _sweep(self, wait: bool = False) -> None:
        """Release the leases of abandoned Acquires that have resolved (all of them, waiting,
        with ``wait``); a failed call holds nothing."""
        keep: list[tuple[int, Future[AcquiredBlocks]]] = []
        for rank, future in self._abandoned:
            if not wait and not future.done():
                keep.append((rank, future))
                continue
            try:
                got = future.result()
            except grpc.RpcError:
                continue
            if got.num_blocks:
                self._release(_Pin(0, [], [], [(rank, got.lease_id)]))
        self._abandoned = keep

    def _unpin(self, req_id: str) -> None:
        pin = self._pins.pop(req_id, None)
        if pin is not None:
            self._release(pin)

    def _release(self, pin: _Pin) -> None:
        """Release every rank's lease; after a failed load, name the first failed block so the
        daemon re-checks it and drops it if it is corrupt (a false report changes nothing)."""
        for rank, lease_id in pin.leases:
            link = self._links[rank]
            if not link.up:
                continue  # the daemon forgot the lease with the engine
            corrupt_from = None if pin.failed_from is None else pin.skipped + pin.failed_from
            try:
                link.client.release(link.engine.engine_id, lease_id, corrupt_from=corrupt_from)
            except grpc.RpcError as exc:  # the lease ended (nothing held any more), or the
                link.failed(exc, names_lease=True)  # daemon is gone
        pin.leases.clear()

    def hit_tiers(self, req_id: str, num_tokens: int) -> dict[Tier, int]:
        """Tokens of the first ``num_tokens`` loaded for ``req_id`` by the tier that held
        them at lookup (for vLLM's hit-source stats)."""
        pin = self._pins.get(req_id)
        out: dict[Tier, int] = {}
        if pin is None:
            return out
        for tier in pin.tiers[:num_tokens // self._block_size]:
            out[tier] = out.get(tier, 0) + self._block_size
        return out

    # -- plans -------------------------------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Start tracking ``request`` (again, after a preemption) and, if vLLM accepted
        ``num_external_tokens`` of our match, plan the load into the allocated blocks at those
        positions (``block_ids``: all of the request's blocks, first KV cache group). Without
        a load the request's pin is released now."""
        bs, req_id = self._block_size, request.request_id
        count = num_external_tokens // bs
        pin = self._pins.get(req_id)
        assert count == 0 or (pin is not None and count <= len(pin.hashes)), (
            f"vLLM accepted {count} external blocks for {req_id}, more than "
            "get_num_new_matched_tokens offered")
        # vLLM sets request.num_computed_tokens only after this call: the local hit is the one
        # get_num_new_matched_tokens saw.
        local = self._local.pop(req_id, request.num_computed_tokens // bs)
        self._answers.pop(req_id, None)  # admitted: a later ask (after a preemption) is new
        if count == 0 or pin is None:
            self._unpin(req_id)
            start = local
        else:
            start = pin.start
            del pin.hashes[count:], pin.tiers[count:]
            pin.block_ids = list(block_ids[start:start + count])
            self._loads.append(LoadSpec(req_id, pin.block_ids, [bytes(h) for h in pin.hashes],
                                        stream=pin.stream))
        tracked = self._tracked.get(req_id)
        if tracked is None:
            self._tracked[req_id] = _Tracked(request, next_save=start + count)
        else:  # resumed after a preemption: what was saved before stays saved
            tracked.next_save = max(tracked.next_save, start + count)

    def build(self, scheduler_output: Any) -> TierdConnectorMetadata:
        """This step's plan; forgets the loads it hands out. Reads ``scheduler_output`` only."""
        self._sweep()
        loads, self._loads = self._loads, []
        # Saves may sit on this step's loads and on loads of earlier steps whose report has
        # not arrived yet (async scheduling: a local hit on blocks still being checked).
        loading = {b for pin in self._pins.values() for b in pin.block_ids}
        saves: list[SaveSpec] = []
        bs = self._block_size
        self._step += 1
        prefill = 0
        for req_id, new_ids, resumed in _scheduled(scheduler_output):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            prefill += max(0, min(int(scheduler_output.num_scheduled_tokens[req_id]),
                                  tracked.request.num_prompt_tokens
                                  - tracked.request.num_computed_tokens))
            if resumed:
                tracked.block_ids = list(new_ids or ())
            else:
                tracked.block_ids.extend(new_ids or ())
            request = tracked.request
            done = min(request.num_computed_tokens
                       + scheduler_output.num_scheduled_tokens[req_id], request.num_tokens)
            hashes = self._hashes(request)
            end = min(done // bs, len(hashes), len(tracked.block_ids))
            if self._save and end > tracked.next_save:
                depends = [b for b in tracked.block_ids[:end] if b in loading] if loading else []
                saves.append(SaveSpec(req_id, tracked.block_ids[tracked.next_save:end],
                                      [bytes(h) for h in hashes[tracked.next_save:end]],
                                      depends))
            tracked.next_save = max(tracked.next_save, end)
        if saves:
            self._last_save_step = self._step
        recomputing, self._recomputing = sorted(self._recomputing), set()
        seen, self._failures_seen = sorted(self._failures_seen), set()
        verdict = self._verdict() if len(self._links) > 1 else None
        return TierdConnectorMetadata(loads=loads, saves=saves, recomputing=recomputing,
                                      failures_seen=seen, step=self._step, verdict=verdict,
                                      prefill_tokens=prefill)

    def _verdict(self) -> tuple[int, dict[str, int]]:
        """TP > 1: (every step up to this one has all ranks' report, request -> last step whose
        saves of it sit on a block some rank failed to load). Workers hold their Commits until
        a verdict covers them, so no rank stores what another rank's failure spoiled."""
        bad = dict(self._bad_until)
        self._bad_until = {r: u for r, u in self._bad_until.items() if u > self._reported}
        self._verdict_sent = self._reported
        return self._reported, bad

    def has_pending_verdicts(self) -> bool:
        """TP > 1: a step planned saves whose verdict the workers have not received yet (vLLM
        must keep stepping, empty steps included, so the held Commits land)."""
        return len(self._links) > 1 and self._verdict_sent < self._last_save_step

    def on_worker_report(self, report: TierdWorkerMetadata) -> None:
        """Take the workers' report of a step: unpin loads every worker has done (naming the
        first failed block, if any), and rewind the saves of every request that holds a block
        whose load failed."""
        self._reported = max(self._reported, report.step)
        failed = set(report.failed)
        self._failures_seen |= failed
        for req_id, count in report.loaded.items():
            pin = self._pins.get(req_id)
            if pin is None:
                continue
            first = next((i for i, b in enumerate(pin.block_ids) if b in failed), None)
            if first is not None:
                pin.failed_from = min(first, pin.failed_from if pin.failed_from is not None
                                      else first)
                tracked = self._tracked.get(req_id)
                if tracked is not None:  # a streamed load's request has no table here yet
                    tracked.next_save = min(tracked.next_save, pin.start + first)
                    self._recomputing.add(req_id)
                    if len(self._links) > 1:
                        self._bad_until[req_id] = self._step
            pin.reports += count
            if pin.reports >= len(self._links):
                self._unpin(req_id)
        if not failed:
            return
        for req_id, tracked in self._tracked.items():
            if not any(b in failed for b in tracked.block_ids):
                continue
            held = tracked.block_ids[:tracked.next_save]
            first = next((i for i, b in enumerate(held) if b in failed), None)
            if first is not None:
                tracked.next_save = first
            self._recomputing.add(req_id)
            if len(self._links) > 1:  # for the verdict: every step built so far computed on it
                self._bad_until[req_id] = self._step

    def finished(self, request: Any) -> None:
        """Forget ``request`` (finished, aborted or failed) and release its pin."""
        self._unpin(request.request_id)
        staging = self._staging.pop(request.request_id, None)
        if staging is not None:
            self._abandon(staging)
        self._tracked.pop(request.request_id, None)
        self._recomputing.discard(request.request_id)
        self._local.pop(request.request_id, None)
        self._bad_until.pop(request.request_id, None)
        self._answers.pop(request.request_id, None)
        self._counted.discard(request.request_id)

    def close(self) -> None:
        """Release every pin, unregister."""
        for req_id in list(self._pins):
            self._unpin(req_id)
        for staging in self._staging.values():
            self._abandon(staging)
        self._staging.clear()
        self._sweep(wait=True)
        for link in self._links:
            link.close()

    def _hashes(self, request: Any) -> Sequence[bytes]:
        hashes: Sequence[bytes] = getattr(request, "block_hashes", None) or ()
        if not hashes and request.num_tokens >= self._block_size and not self._warned_unhashed:
            self._warned_unhashed = True
            _log.warning("tierd: request %s carries no block hashes (vLLM attaches them when a "
                         "KV connector is set; tierd speaks vLLM 0.33): it is neither loaded "
                         "nor saved", request.request_id)
        return hashes


def _now(acquire: Callable[..., AcquiredBlocks], *args: Any,
         **kwargs: Any) -> Future[AcquiredBlocks]:
    """``acquire(*args, **kwargs)`` called now, as a resolved future (or one holding its
    RpcError)."""
    out: Future[AcquiredBlocks] = Future()
    try:
        out.set_result(acquire(*args, **kwargs))
    except grpc.RpcError as exc:
        out.set_exception(exc)
    return out


def _scheduled(scheduler_output: Any) -> Iterator[tuple[str, list[int] | None, bool]]:
    """(request id, block ids new this step (first KV cache group), resumed after preemption)
    for every scheduled request. Resumed requests list all their block ids."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, list(new.block_ids[0]), False
    cached = scheduler_output.scheduled_cached_reqs
    resumed_ids = cached.resumed_req_ids
    for i, req_id in enumerate(cached.req_ids):
        groups = cached.new_block_ids[i]
        yield req_id, (list(groups[0]) if groups else None), req_id in resumed_ids
