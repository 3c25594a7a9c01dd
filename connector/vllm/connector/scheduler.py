"""The scheduler half of the vLLM adapter: which blocks to load and which to save, per step.

Metadata only (no KV bytes), and never waiting for the daemon: every daemon call runs as a job
(``lookup_jobs``) on a ``core.runner.Runner`` and the lookup answers None ("asked, not answered
yet", vLLM's asynchronous lookup) until its job is done. With host KV and one TP rank
(``answer_from_filter``), a new request whose blocks the daemon's presence filter reads as
maybe in DRAM makes no call at all: the hit is answered at once, not pinned here, and the
worker pins it by a Probe (the request's counted lookup) as it loads it, so a block gone since
is a load error that vLLM recomputes; where such loads fail too often, hits are pinned by a
lookup first for a while (``filter_reads``). Otherwise, per request scheduled from the waiting
queue, one lookup job: a Probe (a hold) of the leading DRAM run that the daemon also counts as
the request's lookup (once per request, as vLLM counts its own prefix-cache queries; it names the
tiers of the held blocks after the run, for vLLM's hit-source stats), and the same run acquired
on the other TP ranks: **the hit it reports is pinned** under a lease, so between this answer and
the workers' load only a dead daemon can make the load fail. The workers load under that pin
(each rank's slot ids, checksums and lease deadline go in the metadata, ``PinnedRun``), with no
daemon call of their own; the pin's release tells the daemon how many blocks they loaded. vLLM
asks again at every step a request waits; those asks are answered from the first answer without
a round trip while its pin is fresh. A hit with SSD blocks is not waited for by the scheduler.
With host KV it is an asynchronous load (vLLM's ``load_async``), not pinned here: the workers
acquire and copy it chunk by chunk as the daemon reads it (``streaming``) and report it through
``get_finished``. With CUDA KV the job stages it into DRAM on every rank. A pin is released (a
runner job; one naming a failed block at once) on every path: when every worker has reported
the load done (``TierdWorkerMetadata.loaded``), when vLLM allocates no external tokens, when the
request is looked up afresh, finishes or is aborted (an abandoned lookup's leases are released
once it finishes; a pin whose load is planned, once every worker has reported it), and at the
latest when its lease expires.

The plan for each step goes to the workers as a ``TierdConnectorMetadata``:

* loads: the blocks ``get_num_new_matched_tokens`` promised, in the vLLM block ids that
  ``update_state_after_alloc`` reports for those positions;
* saves: for every scheduled request, the full blocks this step completes (computed tokens +
  scheduled tokens), once each, never the loaded ones or the local prefix-cache hits. Each save
  names the blocks of loads not yet reported (this step's and earlier ones') that its request's
  table holds (``depends_on``), so a worker drops it if one of those fails: nothing computed on
  top of a failed load is stored. With ``write_back`` (``save_policy: write_back``) those blocks
  are not saved yet but remembered (``write_back.DirtyBlocks``), and a step's ``evicted`` names
  the remembered blocks vLLM has just taken for other tokens: the workers save them before the
  step writes any KV.

After a failed load (``TierdWorkerMetadata.failed``) every tracked request holding a failed block
rewinds its save position to that block, and is named in the next step's ``recomputing``: from
then on its saves are the blocks vLLM recomputes. With TP > 1 each step's metadata also carries
the verdict on the steps every rank has reported (``TierdConnectorMetadata.verdict``), which
releases the Commits the workers hold.

Block hashes are vLLM's own ``request.block_hashes``: vLLM 0.33 attaches its block hasher to
every request whenever a KV connector is configured.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from tierd.connector.core.link import DaemonLink
from tierd.connector.core.runner import Runner
from tierd.types import BlockHash, Tier

from .filter_reads import FilterReads
from .filtered import FilteredLookups
from .lookup_jobs import Answer, Asking, Reply, ask, end_leases, reply_of
from .lookup_wait import LookupWait
from .metadata import LoadSpec, SaveSpec, TierdConnectorMetadata, TierdWorkerMetadata
from .pins import Pin
from .verdicts import Verdicts
from .write_back import DirtyBlocks

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    """A request between ``update_state_after_alloc`` and ``request_finished``."""

    request: Any
    next_save: int                 # first block position not yet handed to workers to save
    block_ids: list[int] = field(default_factory=list)  # vLLM block id of each position


_IN_DRAM: tuple[Tier, ...] = ("dram", "hbm")
"""Tiers an Acquire pins without a disk read (an HBM report implies the daemon's DRAM copy is
what it would serve)."""


LOOKUP_THREADS = 4
"""Runner threads of the scheduler side: lookups (one daemon round trip each, more when SSD
blocks are staged) and releases."""

MAX_QUEUED_LOOKUPS = 4096
"""Lookups queued beyond this are answered "no match" (the request computes its prefix)."""


class SchedulerSide:
    """State of the scheduler-side connector. Called from vLLM's scheduler thread only; the
    daemon calls run on a ``Runner`` and never make that thread wait.

    ``links[r]`` is the registration under TP rank ``r``'s layout (rank 0's namespace is the
    one looked up)."""

    def __init__(self, links: Sequence[DaemonLink], *, load: bool, save: bool,
                 stream: bool = False, lookup_wait: float = 0.0, from_filter: bool = False,
                 write_back: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        """``stream``: hand hits with SSD blocks to the workers as asynchronous loads (host
        KV: the workers copy each chunk as the daemon reads it); else stage them (CUDA).
        ``lookup_wait``: seconds a new lookup may take before the ask answers "not yet"
        (``lookup_wait_seconds``). ``from_filter``: answer a hit the presence filter reads as
        in DRAM at once, the workers pinning it as they load it (``answer_from_filter``;
        host KV and one TP rank only). ``write_back``: save blocks when vLLM reuses their
        memory, not when computed (``write_back``)."""
        assert links, "need one link per TP rank"
        self._links = list(links)
        self._stream = stream
        self._clock = clock
        self._presence = FilterReads(links[0], clock=clock,
                                     dram_hits=from_filter and stream and len(links) == 1)
        self._wait = LookupWait(lookup_wait)
        self._runner = Runner(LOOKUP_THREADS, "tierd-scheduler", ("lookup", "release"),
                              limits={"lookup": MAX_QUEUED_LOOKUPS})
        self._filtered = FilteredLookups(links[0], self._runner)
        self._asking: dict[str, Asking] = {}
        self._abandoned: list[Future[Reply]] = []
        self._load, self._save = load, save
        self._dirty = DirtyBlocks() if save and write_back else None
        self._block_size = links[0].layout.block_size
        self._tracked: dict[str, _Tracked] = {}
        self._pins: dict[str, Pin] = {}
        self._loading: list[tuple[str, Pin]] = []  # unpinned while workers load under them
        self._loads: list[LoadSpec] = []
        self._recomputing: set[str] = set()
        self._local: dict[str, int] = {}          # block position past the local hit, per lookup
        self._answers: dict[str, Answer] = {}     # waiting requests the daemon answered for
        self._counted: set[str] = set()           # requests whose lookup the daemon counted
        self._failures_seen: set[int] = set()     # failed blocks reported since the last build
        self._step = 0                            # steps built
        self._verdicts = Verdicts() if len(links) > 1 else None  # TP > 1 only
        self._warned_unhashed = False

    # -- lookups and pins --------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (the local prefix-cache hit, block-aligned) that
        tierd holds and has now pinned for this request: full blocks only, and never the block
        holding the request's last token (vLLM must compute that one to sample). 0 if the
        daemon is unreachable. None means "asked, not answered yet" (vLLM's asynchronous
        lookup: it keeps the request waiting and asks again at its next step, so the request
        starts a step later): a new lookup is answered at once if its job finishes within
        ``lookup_wait`` seconds (one round trip usually does), and no step waits more than
        ``lookup_wait.STEP_WAIT_ASKS`` times that in all, so a slow daemon costs the scheduler
        thread a bounded few milliseconds per step; it waits only where that costs the engine
        less than starting the request a step later (``lookup_wait.LookupWait``).

        The first ask of a request queues one lookup job: a Probe (a hold) of the leading DRAM
        run that the daemon also counts as the request's lookup (one round trip; with TP > 1 the
        other ranks acquire the same run). A hit with SSD blocks never makes the scheduler
        wait for a disk: with ``stream`` it is answered as an asynchronous load (``streams``:
        vLLM parks the request while the workers copy it as the daemon reads it; nothing
        pinned here); otherwise the job stages it into DRAM on every rank first.

        vLLM asks again at every step a request waits (for KV space, say): such an ask is
        answered from the first answer (``_answered``), with no round trip, while its pin is
        fresh (less than half its lease gone) and the local hit has not shrunk. Otherwise the
        range is acquired again by a job that counts nothing. A hit answered this way is
        pinned like any other, so a block the daemon lost since fails its load and vLLM
        recomputes it."""
        req_id, bs = request.request_id, self._block_size
        start = -(-num_computed_tokens // bs)
        self._local[req_id] = start
        self._sweep()
        asking = self._asking.pop(req_id, None)
        if asking is not None:
            if asking.start == start:
                if not asking.job.done():
                    self._asking[req_id] = asking
                    return None
                held = self._settle(req_id, asking)
                return (start + held) * bs - num_computed_tokens if held else 0
            self._abandon(asking)  # vLLM's local hit moved since: ask afresh
        end = self._end(request, start)
        known = self._answered(req_id, start, end)
        if known is not None:
            return (start + known) * bs - num_computed_tokens if known else 0
        before = self._pins.get(req_id)
        self._unpin(req_id)
        if end <= start or not all(link.may_connect() for link in self._links):
            return 0
        wanted = [BlockHash(h) for h in self._hashes(request)[start:end]]
        known_tiers: list[Tier] | None = None
        if req_id in self._counted:  # asked before: Acquires alone, counted nothing
            seen = {before.start + i: t for i, t in enumerate(before.tiers)} if before else {}
            known_tiers = [seen.get(start + i, "dram") for i in range(len(wanted))]
        if known_tiers is None and self._presence.certain_miss(wanted[0]):
            self._counted.add(req_id)  # counted on the daemon within REPORT_SECONDS
            self._filtered.add(len(wanted) * bs)
            self._answers[req_id] = Answer(start, 0, end)
            return 0
        vouched = self._presence.dram_run(wanted) if known_tiers is None else 0
        if vouched:  # the worker's Probe counts these blocks; the rest is counted here
            self._counted.add(req_id)
            if vouched < len(wanted):
                self._filtered.add((len(wanted) - vouched) * bs)
            session = self._links[0].session
            assert session is not None, "the filter vouched with no session"
            fresh = self._clock() + session.engine.lease_seconds / 2
            self._pins[req_id] = Pin(start, wanted[:vouched], ["dram"] * vouched, [],
                                     fresh_until=fresh, probed=True)
            self._answers[req_id] = Answer(start, vouched, end)
            return (start + vouched) * bs - num_computed_tokens
        job = self._runner.submit("lookup", functools.partial(
            ask, self._links, wanted, known_tiers, stream=self._stream, clock=self._clock))
        if job is None:
            return 0
        counting = known_tiers is None
        if counting:  # a later job for this request (its local hit moved meanwhile) counts none
            self._counted.add(req_id)
        asking = Asking(start, end, wanted, job, counting, self._clock())
        timeout = self._wait.timeout(len(self._tracked))
        if timeout > 0:
            began = time.monotonic()
            wait([job], timeout)
            self._wait.waited(time.monotonic() - began)
            if job.done():
                held = self._settle(req_id, asking)
                return (start + held) * bs - num_computed_tokens if held else 0
        self._asking[req_id] = asking
        return None

    def _end(self, request: Any, start: int) -> int:
        """The end of the block range to ask the daemon for from ``start``: the full blocks
        that leave the last token out, cut to the daemon's ``max_blocks_per_request`` (``start``
        when there is nothing to ask)."""
        usable = (int(request.num_tokens) - 1) // self._block_size
        if not self._load or usable <= start:
            return start
        hashes = self._hashes(request)
        sessions = [link.session for link in self._links]
        most = min(int(s.engine.max_blocks_per_request) if s is not None else 1 << 30
                   for s in sessions)
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

    def streams(self, req_id: str) -> bool:
        """The hit last reported for ``req_id`` is an asynchronous (streamed) load."""
        pin = self._pins.get(req_id)
        return pin is not None and pin.stream

    def _settle(self, req_id: str, asking: Asking) -> int:
        """Take a finished lookup job's reply: pin the prefix every rank holds (the shortest
        wins), fresh until half the shortest lease has gone, and remember the answer unless a
        call failed; the blocks held (0 if some rank holds none or failed: leases released)."""
        reply = reply_of(asking.job)
        if reply.answered:
            self._wait.answered(reply.answered - asking.submitted)
        if asking.counting and not reply.counted:  # it failed: the next ask counts
            self._counted.discard(req_id)
        if reply.tiers is None:
            self._release_got(reply)
            return 0
        tiers = reply.tiers[:len(asking.hashes)]
        if reply.stream:
            self._pins[req_id] = Pin(asking.start, asking.hashes[:len(tiers)], list(tiers), [],
                                      stream=True)
            self._answers[req_id] = Answer(asking.start, len(tiers), asking.end)
            return len(tiers)
        pin = Pin(asking.start, asking.hashes[:len(tiers)], list(tiers), [])
        for rank, got in enumerate(reply.got):
            if got is None:
                pin.hashes = []
                continue
            if got.num_blocks:
                pin.leases.append((rank, got.lease_id))
                pin.fresh_until = min(pin.fresh_until, reply.asked + got.seconds_left / 2)
                if rank < len(reply.arenas):
                    pin.runs.append((reply.arenas[rank], got, reply.asked + got.seconds_left))
            if got.num_blocks == 0 or not pin.hashes:
                pin.hashes = []
            else:
                del pin.hashes[got.num_blocks:], pin.tiers[got.num_blocks:]
        if len(pin.runs) < len(self._links):
            pin.runs = []  # some rank's answer is not there to load under: workers acquire
        held = len(pin.hashes)
        if held:
            self._pins[req_id] = pin
        else:
            self._release(pin)
        if all(got is not None for got in reply.got):
            self._answers[req_id] = Answer(asking.start, held, asking.end)
        return held

    def _abandon(self, asking: Asking) -> None:
        """Drop a lookup nobody will use: the leases it took are released once it finishes
        (``_sweep``)."""
        self._abandoned.append(asking.job)

    def _sweep(self) -> None:
        """Release the leases of abandoned lookups that have finished, and those of parked pins
        whose leases have run out with no report (they hold nothing any more)."""
        if self._abandoned:
            for job in [job for job in self._abandoned if job.done()]:
                self._abandoned.remove(job)
                self._release_got(reply_of(job))
        if self._loading:
            now = self._clock()
            for entry in [e for e in self._loading if now >= e[1].deadline]:
                self._loading.remove(entry)
                self._release(entry[1])

    def _release_got(self, reply: Reply) -> None:
        leases = [(rank, got.lease_id) for rank, got in enumerate(reply.got)
                  if got is not None and got.num_blocks]
        if leases:
            self._runner.submit("release", functools.partial(end_leases, self._links, leases, None))

    def _unpin(self, req_id: str) -> None:
        """Release ``req_id``'s pin, or, if workers may still be loading under it (planned, not
        reported by all of them), park it until they report (``_loading``)."""
        pin = self._pins.pop(req_id, None)
        if pin is None:
            return
        if pin.handed and pin.reports < len(self._links):
            self._loading.append((req_id, pin))
        else:
            self._release(pin)

    def _release(self, pin: Pin) -> None:
        """Release every rank's lease (a runner job), telling the daemon how many blocks the
        workers loaded under it (``served``); after a failed load, name the first failed block
        so the daemon re-checks it and drops it if it is corrupt (a false report changes
        nothing). That release is made at once, on this thread: the bad copy is gone before
        the recomputed block's Reserve, which would skip a block the node still holds."""
        if not pin.leases:
            return
        corrupt_from = None if pin.failed_from is None else pin.skipped + pin.failed_from
        release = functools.partial(end_leases, self._links, list(pin.leases), corrupt_from,
                                    pin.served(len(self._links)))
        pin.leases.clear()
        if corrupt_from is not None:
            release()
        else:
            self._runner.submit("release", release)

    def drain(self, timeout: float) -> bool:
        """Report the filtered lookups counted so far, then wait until no lookup or release is
        queued or running (tests); False if ``timeout`` s passed first."""
        self._filtered.send()
        return self._runner.drain(timeout)

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
            pin.handed = bool(pin.runs) and not pin.stream
            self._loads.append(LoadSpec(req_id, pin.block_ids, [bytes(h) for h in pin.hashes],
                                        stream=pin.stream,
                                        pinned=pin.pinned_runs(count) if pin.handed else [],
                                        probe=pin.probed))
        tracked = self._tracked.get(req_id)
        if tracked is None:
            self._tracked[req_id] = _Tracked(request, next_save=start + count)
        else:  # resumed after a preemption: what was saved before stays saved
            tracked.next_save = max(tracked.next_save, start + count)

    def build(self, scheduler_output: Any) -> TierdConnectorMetadata:
        """This step's plan; forgets the loads it hands out. Reads ``scheduler_output`` only."""
        self._sweep()
        self._wait.step(self._clock())
        loads, self._loads = self._loads, []
        saves: list[SaveSpec] = []
        bs, save, tracked_of = self._block_size, self._save, self._tracked.get
        scheduled_tokens = scheduler_output.num_scheduled_tokens
        loading: set[int] | None = None  # blocks of loads not reported yet (built when needed)
        self._step += 1
        prefill = 0
        dirty = self._dirty
        evicting: dict[str, SaveSpec] = {}  # write-back: the step's evictions, per request
        for req_id, new_ids, resumed in _scheduled(scheduler_output):
            tracked = tracked_of(req_id)
            if tracked is None:
                if dirty is not None and new_ids:  # not ours: whatever it held is evicted
                    dirty.reallocated(new_ids, 0, (), evicting)
                continue
            request = tracked.request
            computed, scheduled = request.num_computed_tokens, scheduled_tokens[req_id]
            left = request.num_prompt_tokens - computed
            if left > 0:
                prefill += min(scheduled, left)
            first = 0 if resumed else len(tracked.block_ids)
            if resumed:
                tracked.block_ids = list(new_ids or ())
            elif new_ids:
                tracked.block_ids.extend(new_ids)
            if dirty is not None and new_ids:  # write-back: blocks vLLM takes for new tokens
                dirty.reallocated(new_ids, first, self._hashes(request), evicting)
            if (computed + scheduled) // bs <= tracked.next_save:
                continue  # no block completes (a decode step, mostly)
            hashes = self._hashes(request)
            end = min(computed + scheduled, request.num_tokens) // bs
            end = min(end, len(hashes), len(tracked.block_ids))
            if save and end > tracked.next_save:
                # Saves may sit on this step's loads and on loads of earlier steps whose
                # report has not arrived yet (async scheduling: a local hit on blocks still
                # being checked).
                if loading is None:
                    loading = {b for pin in self._pins.values() for b in pin.block_ids}
                depends = [b for b in tracked.block_ids[:end] if b in loading] if loading else []
                spec = SaveSpec(req_id, tracked.block_ids[tracked.next_save:end],
                                [bytes(h) for h in hashes[tracked.next_save:end]], depends)
                if dirty is None:
                    saves.append(spec)
                else:
                    dirty.computed(spec)
            tracked.next_save = max(tracked.next_save, end)
        evicted: list[SaveSpec] = []
        if evicting:
            assert dirty is not None
            if loading is None:
                loading = {b for pin in self._pins.values() for b in pin.block_ids}
            evicted = dirty.unreported(evicting, loading)
        if (saves or evicted) and self._verdicts is not None:
            self._verdicts.saved(self._step)
        recomputing = sorted(self._recomputing) if self._recomputing else []
        seen = sorted(self._failures_seen) if self._failures_seen else []
        self._recomputing, self._failures_seen = set(), set()
        verdict = self._verdicts.take() if self._verdicts is not None else None
        return TierdConnectorMetadata(loads=loads, saves=saves, evicted=evicted,
                                      recomputing=recomputing,
                                      failures_seen=seen, step=self._step, verdict=verdict,
                                      prefill_tokens=prefill)

    def reset(self) -> None:
        """vLLM emptied its prefix cache and asks the connector to reset: what only vLLM held
        (write-back's unsaved blocks) is forgotten, never saved; what tierd holds stays."""
        if self._dirty is not None:
            self._dirty.clear()

    def has_pending_verdicts(self) -> bool:
        """TP > 1: a step planned saves whose verdict the workers have not received yet
        (``Verdicts.pending``)."""
        return self._verdicts is not None and self._verdicts.pending

    def on_worker_report(self, report: TierdWorkerMetadata) -> None:
        """Take the workers' report of a step: unpin loads every worker has done (naming the
        first failed block, if any), and rewind the saves of every request that holds a block
        whose load failed."""
        verdicts = self._verdicts
        if verdicts is not None:
            verdicts.reported(report.step)
        failed = set(report.failed)
        self._failures_seen |= failed
        for req_id, count in report.loaded.items():
            parked = next((entry for entry in self._loading if entry[0] == req_id), None)
            pin = self._pins.get(req_id) if parked is None else parked[1]
            if pin is None:
                continue
            first = next((i for i, b in enumerate(pin.block_ids) if b in failed), None)
            if pin.probed:
                self._presence.loaded(first is None)
            if first is not None:
                pin.failed_from = min(first, pin.failed_from if pin.failed_from is not None
                                      else first)
                tracked = self._tracked.get(req_id)
                if tracked is not None:  # a streamed load's request has no table here yet
                    tracked.next_save = min(tracked.next_save, pin.start + first)
                    self._recomputing.add(req_id)
                    if verdicts is not None:
                        verdicts.spoiled(req_id, self._step)
            pin.reports += count
            if pin.reports < len(self._links):
                continue
            if parked is None:
                self._unpin(req_id)
            else:
                self._loading.remove(parked)
                self._release(pin)
        if not failed:
            return
        if self._dirty is not None:
            self._dirty.failed(failed)
        for req_id, tracked in self._tracked.items():
            if not any(b in failed for b in tracked.block_ids):
                continue
            held = tracked.block_ids[:tracked.next_save]
            first = next((i for i, b in enumerate(held) if b in failed), None)
            if first is not None:
                tracked.next_save = first
            self._recomputing.add(req_id)
            if verdicts is not None:  # every step built so far computed on it
                verdicts.spoiled(req_id, self._step)

    def finished(self, request: Any) -> None:
        """Forget ``request`` (finished, aborted or failed) and release its pin."""
        self._unpin(request.request_id)
        asking = self._asking.pop(request.request_id, None)
        if asking is not None:
            self._abandon(asking)
        self._tracked.pop(request.request_id, None)
        self._recomputing.discard(request.request_id)
        self._local.pop(request.request_id, None)
        if self._verdicts is not None:
            self._verdicts.forget(request.request_id)
        self._answers.pop(request.request_id, None)
        self._counted.discard(request.request_id)

    def close(self) -> None:
        """Report the filtered lookups not yet counted, release every pin (waiting for the
        lookups in flight, within the call deadline), unregister."""
        self._filtered.close()
        for req_id in list(self._pins):
            self._unpin(req_id)
        for _, pin in self._loading:
            self._release(pin)
        self._loading.clear()
        for asking in self._asking.values():
            self._abandon(asking)
        self._asking.clear()
        timeout = self._links[0].timeout_seconds + 1.0
        self._runner.drain(timeout, ("lookup",))
        self._sweep()
        if not self._runner.stop(timeout):
            _log.warning("tierd: a daemon call of the scheduler side outlived its deadline")
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


def _scheduled(scheduler_output: Any) -> Iterator[tuple[str, list[int] | None, bool]]:
    """(request id, block ids new this step (first KV cache group), resumed after preemption)
    for every scheduled request. Resumed requests list all their block ids."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, list(new.block_ids[0]), False
    cached = scheduler_output.scheduled_cached_reqs
    resumed_ids = cached.resumed_req_ids
    for req_id, groups in zip(cached.req_ids, cached.new_block_ids):
        yield req_id, (groups[0] if groups else None), req_id in resumed_ids
