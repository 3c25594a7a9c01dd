"""``TierdHooks``: the reference engine's ``KVTransferHooks`` over a tierd node daemon.

Per engine step (the call order is ``tierd.connector.reference.hooks``'s):

- ``lookup``: none if the daemon's presence filter says it holds no copy of the first block past
  the hot-tier hit; else one Acquire that pins the loadable prefix under a lease until ``load``.
- ``load``: no round trip; ``core.load.load_leased`` through the ``PoolRows`` sink (each block
  checked as it is copied). The Release is queued at ``step_end``, after the forward pass.
- ``save``: pool -> staging ring on the engine thread; the runner gathers saves for up to
  ``save_batch_s``, then one Reserve, memcpys into the slots and one Commit (``core.save``).
- ``step_end``: the engine's hot-tier events are queued for ReportHotBlocks, with the engine's
  measured prefill speed when one is due (``core.prefill_speed`` over the engine's step
  timings, ``attach_step_timings``): the daemon counts the cache's savings at it.

Failure is never an exception out of the engine: a failed load returns False for that block and
all after it (recomputed); a save that cannot be queued is dropped and counted; a lost daemon
makes the hooks act as ``NullHooks`` while the runner reconnects (``core.link.DaemonLink``).
One ``core.runner.Runner`` thread does the round trips, Releases ahead of saves and reports;
work for a lost session is dropped, never replayed.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Concatenate, ParamSpec, TypeVar

import grpc

from tierd.connector.core.errors import Failure, describe
from tierd.connector.core.lease import Lease, Release, acquire, probe_acquire
from tierd.connector.core.link import DaemonLink, Session
from tierd.connector.core.load import load_leased
from tierd.connector.core.prefill_speed import PrefillSpeed
from tierd.connector.core.runner import Runner
from tierd.connector.core.save import commit, reserve, write_rows
from tierd.connector.core.sinks import PoolRows
from tierd.connector.reference.engine import Request
from tierd.connector.reference.staging import StagingRing, gather_rows
from tierd.connector.reference.tierd_config import TierdHooksConfig, TierdHooksStats, layout_for
from tierd.connector.reference.tierd_jobs import (
    GATHERED,
    Held,
    HotJob,
    Job,
    ReleaseJob,
    SaveJob,
    merged_reports,
)
from tierd.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tierd.gpu.layout import KVCache
from tierd.types import BlockHash, Namespace, make_key

# The hooks and the values they take and report (defined in tierd_config).
__all__ = ["TierdHooks", "TierdHooksConfig", "TierdHooksStats", "layout_for"]

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _engine_thread(method: Callable[Concatenate[TierdHooks, _P], _R]
                   ) -> Callable[Concatenate[TierdHooks, _P], _R]:
    """A hook the engine thread calls: its wall time adds to ``stats.engine_thread_s``."""
    @wraps(method)
    def timed(self: TierdHooks, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.stats.engine_thread_s += time.perf_counter() - start
    return timed


class TierdHooks:
    """``KVTransferHooks`` backed by a tierd daemon; see the module docstring.

    Create, pass to ``LLMEngine`` (which calls ``register_kv_caches``), optionally
    ``attach_block_events(engine.manager.take_events)``, and ``close()`` when done."""

    def __init__(self, config: TierdHooksConfig | None = None) -> None:
        self.config = config or TierdHooksConfig()
        self.stats = TierdHooksStats()
        self._kv: KVCache | None = None
        self._link: DaemonLink | None = None
        self._runner: Runner | None = None  # started by register_kv_caches
        self._gathered: deque[SaveJob | HotJob] = deque()  # saves and reports to write
        self._more = threading.Condition()  # guards _gathered; notified as jobs come
        self._connecting = False  # a reconnect job is queued or running (under _more)
        self._ring: StagingRing | None = None
        self._sink: PoolRows | None = None
        self._pending: set[BlockHash] = set()  # queued for save; guarded by _lock
        self._held: dict[str, Held] = {}  # request id -> its looked-up lease (engine thread)
        self._loaded: list[ReleaseJob] = []  # Releases of this step's loads (engine thread)
        self._filtered_tokens = 0  # lookups answered from the presence filter, not yet sent
        self._lock = threading.Lock()
        self._events: Callable[[], list[KVEvent]] | None = None
        self._timings: Callable[[], list[tuple[int, float]]] | None = None
        self._speed = PrefillSpeed(time.monotonic)
        self._hot_cleared = False
        self._closing = threading.Event()
        self._flushing = threading.Event()

    # -- lifecycle -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: KVCache, model_id: str) -> None:
        """Keep the pool, allocate staging, try to connect once (never raises for a missing
        daemon) and start the runner. Blocks are shared under ``model_id`` (or the
        config's ``model_id`` override)."""
        assert self._kv is None, "register_kv_caches is called once per engine"
        cfg, row = self.config, kv_cache.spec.block_bytes
        self._kv = kv_cache
        layout = layout_for(kv_cache.spec, cfg.model_id or model_id, cfg.tp_rank, cfg.tp_size)
        self._ring = StagingRing(max(1, cfg.save_staging_bytes // row), row)
        self._sink = PoolRows(kv_cache.pool, cfg.load_staging_bytes // row)
        self._link = DaemonLink(cfg, layout, attach=True, presence=True,
                                on_session=self._session_changed)
        self._runner = Runner(1, "tierd-hooks", ("release", "write", "connect"))
        if cfg.worker_nice and sys.platform == "linux":  # per thread on Linux only
            self._runner.submit("release", self._renice)
        if not self._link.connect():
            self._reconnect_later()

    def attach_block_events(self, take_events: Callable[[], list[KVEvent]]) -> None:
        """Report the engine's hot-tier events (e.g. ``engine.manager.take_events``) to the
        daemon, batched once per step, so ``tierd stats`` and routers see the HBM tier."""
        self._events = take_events
        self._hot_cleared = True  # the first report starts the daemon's view afresh

    def attach_step_timings(self, take: Callable[[], list[tuple[int, float]]]) -> None:
        """Measure the engine's prefill speed from ``take`` ((prompt tokens, seconds) per
        forward pass; the engine attaches its ``take_step_timings`` itself) and report it."""
        self._timings = take

    @property
    def _session(self) -> Session | None:
        """The link's current session (None while the daemon is out of reach)."""
        return self._link.session if self._link is not None else None

    @property
    def connected(self) -> bool:
        return self._session is not None

    def wait_connected(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until a session is up (tests, the demo)."""
        deadline = time.monotonic() + timeout
        while self._session is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self._session is not None

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until every queued save, release and report has been sent (or dropped)."""
        self._queue_loaded()
        runner = self._runner
        if runner is None:
            return True
        self._flushing.set()  # a gathering stops waiting for more saves and sends them now
        self._wake()
        done = runner.drain(timeout, ("release", "write"))
        self._flushing.clear()
        return done

    def close(self) -> None:
        """Send what is queued (up to ``timeout_seconds``), stop the runner, unregister.
        Idempotent."""
        if self._runner is None or self._closing.is_set():
            return
        self._release_all()
        self._queue_loaded()
        self.flush(self.config.timeout_seconds)
        self._closing.set()
        self._wake()
        self._runner.stop(self.config.timeout_seconds + 1)
        if self._link is not None:
            self._link.close()

    # -- KVTransferHooks -----------------------------------------------------------------------

    @_engine_thread
    def lookup(self, request: Request) -> int:
        """Blocks of ``request`` past the hot hit now pinned for its ``load``: one Probe round
        trip (``probe_acquire``: an Acquire follows where the hit reaches SSD). The lease is kept
        per request (a repeated lookup of the same request releases the previous one first)."""
        self._release(self._held.pop(request.request_id, None))
        session = self._session
        start = request.num_computed_tokens // self._block_size
        hashes = request.block_hashes[start:]
        if session is None or not hashes:
            return 0
        self.stats.lookups += 1
        if session.presence is not None and not session.presence.may_hold(
                make_key(Namespace(session.engine.namespace), hashes[0])):
            # A certain miss: no round trip. The node counts it with our next Reserve.
            self.stats.filtered_lookups += 1
            self._filtered_tokens += len(hashes) * self._block_size
            return 0
        lease = self._acquire(session, hashes, probe=True)
        if lease is None:
            return 0
        if lease.num_blocks:
            self._held[request.request_id] = Held(session, hashes[:lease.num_blocks], lease)
        self.stats.lookup_hit_blocks += lease.num_blocks
        return lease.num_blocks

    @_engine_thread
    def load(self, request: Request, block_ids: Sequence[int],
             block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Copy and verify under the lease ``lookup`` took (Acquire now if there is none for
        these hashes; ``core.load.load_leased``); True for each leading block now in the pool
        (none if the lease's deadline passed before the copy was done). The lease's Release is
        queued to the runner at ``step_end``, so its round trip never runs beside the forward
        pass that computes the request's first token (the lease is held one step longer); one
        that reports a corrupt block is queued at once, ahead of the step's saves, so the
        daemon drops the bad copy before the recomputed block is written through."""
        n = len(block_ids)
        held = self._held.pop(request.request_id, None)
        session = self._session
        if held is not None and (held.session is not session
                                 or held.hashes[:n] != list(block_hashes)):
            self._release(held)  # pinned for another chain or a lost session: not usable
            held = None
        if session is None or not n:
            self._release(held)
            self.stats.failed_load_blocks += n
            return [False] * n
        self.stats.loads += 1
        if held is None:
            lease = self._acquire(session, block_hashes, probe=False)
            if lease is None:
                self.stats.failed_load_blocks += n
                return [False] * n
            held = Held(session, list(block_hashes[:lease.num_blocks]), lease)
        assert self._sink is not None and session.slots is not None
        done = load_leased(held.lease, block_ids, session.slots, self._sink,
                           self._deferred_release(session), time.monotonic)
        self.stats.checksum_failures += done.corrupt
        self.stats.lease_expiries += done.lease_lost
        self.stats.loaded_blocks += done.placed
        self.stats.failed_load_blocks += n - done.placed
        return [i < done.placed for i in range(n)]

    @_engine_thread
    def save(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Copy the new blocks into the staging ring now; the runner writes them through."""
        session, ring = self._session, self._ring
        if session is None or ring is None or not block_ids:
            return
        with self._lock:
            todo = [(b, h) for b, h in zip(block_ids, block_hashes) if h not in self._pending]
            span = ring.take(len(todo)) if todo and not self._full() else None
            if span is not None:
                self._pending.update(h for _, h in todo)
        if not todo:
            return
        if span is None:
            self.stats.dropped_save_blocks += len(todo)
            return
        assert self._kv is not None
        gather_rows(self._kv.pool, [b for b, _ in todo], ring.rows[span.start:span.stop])
        if self._put(SaveJob(session, [h for _, h in todo], span, time.monotonic(),
                              self._filtered_tokens)):
            self._filtered_tokens = 0

    @_engine_thread
    def request_finished(self, request: Request) -> None:
        """Release the request's looked-up lease if its ``load`` never came."""
        self._release(self._held.pop(request.request_id, None))

    @_engine_thread
    def step_end(self) -> None:
        """Release every lease looked up this step whose ``load`` did not come (the admission
        failed: a later lookup pins afresh); batch this step's hot-tier events into one queued
        report."""
        self._queue_loaded()
        self._release_all()
        session, take = self._session, self._events
        speed = self._measured_speed()
        if take is None:
            if speed and session is not None:
                self._put(HotJob(session, [], [], False, time.monotonic(), speed))
            return
        events = take()
        if session is None:
            self._hot_cleared = True  # the daemon's view is stale: resend from scratch later
            return
        stored: list[BlockHash] = []
        removed: list[BlockHash] = []
        cleared = self._hot_cleared
        for event in events:
            if event.tier != "hbm":
                continue
            if isinstance(event, BlockStored):
                stored += event.block_hashes
            elif isinstance(event, BlockRemoved):
                removed += event.block_hashes
            elif isinstance(event, AllBlocksCleared):
                cleared, stored, removed = True, [], []
        if stored or removed or cleared or speed:
            self._hot_cleared = not self._put(HotJob(session, stored, removed, cleared,
                                                      time.monotonic(), speed))

    # -- internals -----------------------------------------------------------------------------

    def _measured_speed(self) -> float:
        """The engine's prefill speed to report now (0.0: none due)."""
        if self._timings is None:
            return 0.0
        for tokens, seconds in self._timings():
            self._speed.observe(tokens, seconds)
        return self._speed.take() or 0.0

    @property
    def _block_size(self) -> int:
        assert self._kv is not None, "register_kv_caches first"
        return int(self._kv.spec.block_size)

    def _acquire(self, session: Session, hashes: Sequence[BlockHash], *,
                 probe: bool) -> Lease | None:
        """Acquire on the engine thread (``probe``: counted as a Lookup, ``probe_acquire``);
        None (counted, the session dropped if lost) on a failed call."""
        try:
            get = probe_acquire if probe else acquire
            return get(session.client, session.engine_id, hashes, clock=time.monotonic)
        except grpc.RpcError as exc:
            self._failed(session, exc)
            return None

    def _deferred_release(self, session: Session) -> Release:
        """A load's Release, queued to the runner (``core.load``: the lease's deadline alone
        decides): one that reports a corrupt block at once, ahead of the step's saves, so the
        daemon drops the bad copy before the recomputed block is written through; the others
        at ``step_end``, after the forward pass."""
        def release(lease: Lease, corrupt_from: int | None) -> None:
            job = ReleaseJob(session, lease.lease_id, corrupt_from)
            if corrupt_from is not None:
                self._put(job)
            else:
                self._loaded.append(job)
        return release

    def _release(self, held: Held | None) -> None:
        """Queue the Release of a held lease (the runner sends it; nothing for an empty one)."""
        if held is not None and held.lease.num_blocks:
            self._put(ReleaseJob(held.session, held.lease.lease_id, None))

    def _queue_loaded(self) -> None:
        """Queue the Releases of the leases this step's loads are done with."""
        loaded, self._loaded = self._loaded, []
        for job in loaded:
            self._put(job)

    def _release_all(self) -> None:
        held, self._held = self._held, {}
        for h in held.values():
            self._release(h)

    def _full(self) -> bool:
        """As many jobs wait as ``max_queued_jobs``: a new one is dropped (and counted)."""
        runner = self._runner
        with self._more:
            waiting = len(self._gathered)
        return runner is None or (waiting + runner.queued("release")
                                  >= self.config.max_queued_jobs)

    def _put(self, job: Job) -> bool:
        """Queue ``job`` on the runner: a Release at once, a save or report for the next
        gathering (``_write``); False (counted) if too many wait."""
        runner = self._runner
        if runner is None or self._closing.is_set() or self._full():
            self.stats.dropped_jobs += 1
            return False
        if isinstance(job, GATHERED):
            with self._more:
                self._gathered.append(job)
                self._more.notify_all()
            runner.submit("write", self._write)
        else:
            runner.submit("release", functools.partial(self._do, [job]))
            self._wake()  # a Release ends a gathering
        return True

    def _wake(self) -> None:
        with self._more:
            self._more.notify_all()

    def _session_changed(self, session: Session | None) -> None:
        """The link's listener: count (re)connects and losses; after a loss queue the reconnect
        job; a new session gets the hot-tier view afresh."""
        if session is None:
            self.stats.disconnects += 1
            self._reconnect_later()
        else:
            self.stats.connects += 1
            self._hot_cleared = True

    def _failed(self, session: Session, exc: grpc.RpcError, *,
                names_lease: bool = False) -> Failure:
        """A call of ``session`` failed: classify it (``core.errors``, through the link, which
        drops the session if it is lost) and count a lease that had ended."""
        assert self._link is not None
        failure = self._link.failed(exc, session, names_lease=names_lease)
        if failure == "lease":
            self.stats.lease_expiries += 1  # counted from either thread: advisory
        elif failure == "request":
            log.warning("tierd call failed: %s", describe(exc))
        return failure

    def _renice(self) -> None:
        """The runner thread's niceness: the process's plus ``worker_nice`` (Linux)."""
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, 0) + self.config.worker_nice)

    def _reconnect_later(self) -> None:
        """Queue the reconnect job, unless one is queued or running."""
        runner = self._runner
        with self._more:
            if runner is None or self._connecting or self._closing.is_set():
                return
            self._connecting = True
        runner.submit("connect", self._reconnect)

    def _reconnect(self) -> None:
        """The reconnect job: try as the link's back-off allows until up or closing; it yields
        the runner thread (queued again) whenever a Release or a save waits."""
        link, runner = self._link, self._runner
        assert link is not None and runner is not None
        while not self._closing.is_set() and not link.connect():
            if runner.queued("release") or runner.queued("write"):
                runner.submit("connect", self._reconnect)
                return
            self._closing.wait(min(0.05, max(0.0, link.retry_at - time.monotonic())))
        with self._more:
            self._connecting = False

    def _write(self) -> None:
        """A gathering (one runner job): the oldest queued save or report and those of the same
        session queued within ``save_batch_s`` of it, up to half the staging ring of saves, then
        one Reserve/Commit and one merged report (``_do``). It ends early for a Release, a job
        of another session, ``flush`` or ``close``. Nothing to do if an earlier one took all."""
        assert self._ring is not None
        with self._more:
            if not self._gathered:
                return
            first = self._gathered.popleft()
            batch: list[Job] = [first]
            rows = len(first.hashes) if isinstance(first, SaveJob) else 0
            deadline = first.queued + self.config.save_batch_s
            runner = self._runner
            assert runner is not None
            while True:
                while (self._gathered and self._gathered[0].session is first.session
                       and rows < self._ring.capacity // 2):
                    job = self._gathered.popleft()
                    batch.append(job)
                    rows += len(job.hashes) if isinstance(job, SaveJob) else 0
                left = deadline - time.monotonic()
                if (self._gathered or rows >= self._ring.capacity // 2 or left <= 0
                        or self._flushing.is_set() or self._closing.is_set()
                        or runner.queued("release")):
                    break
                self._more.wait(left)
        self._do(batch)

    def _do(self, batch: list[Job]) -> None:
        """One gathered batch (saves and hot-tier reports of one session: one Reserve/Commit,
        then one merged report) or a single other job."""
        job = batch[0]
        if isinstance(job, GATHERED):
            saves = [j for j in batch if isinstance(j, SaveJob)]
            reports = [j for j in batch if isinstance(j, HotJob)]
            if saves:
                try:
                    self._write_through(saves)
                finally:
                    with self._lock:
                        for save in saves:
                            self._pending.difference_update(save.hashes)
                    assert self._ring is not None
                    for save in saves:
                        self._ring.give_back(save.span)
            if not reports:
                return
            job = merged_reports(reports)
        if job.session is not self._session:
            return  # the daemon that held this lease or HBM view is gone
        try:
            if isinstance(job, ReleaseJob):
                dropped = job.session.client.release(job.session.engine.engine_id, job.lease_id,
                                                     corrupt_from=job.corrupt_from)
                self.stats.corrupt_dropped += dropped
            else:
                job.session.client.report_hot_blocks(job.session.engine.engine_id, job.stored,
                                                     job.removed, job.cleared,
                                                     prefill_tokens_per_second=job.speed)
                self.stats.hot_reports += 1
        except grpc.RpcError as exc:
            release = isinstance(job, ReleaseJob)
            if self._failed(job.session, exc, names_lease=release) != "lease" or not release:
                self.stats.rpc_errors += 1  # a Release of a lease that had ended is no error

    def _write_through(self, saves: list[SaveJob]) -> None:
        """``core.save``: one Reserve for every queued save, host memcpys of the staged rows
        into the reserved slots, one Commit of the written flags (the daemon checksums)."""
        session = saves[0].session
        hashes = [h for save in saves for h in save.hashes]
        n = len(hashes)
        if session is not self._session:
            self.stats.unsaved_blocks += n
            return
        assert self._ring is not None and session.slots is not None
        try:
            reserved = reserve(session.client, session.engine_id, hashes,
                               filtered_query_tokens=sum(save.query_tokens for save in saves))
        except grpc.RpcError as exc:
            self.stats.rpc_errors += 1
            self.stats.unsaved_blocks += n
            self._failed(session, exc)
            return
        self.stats.save_batches += 1
        written = reserved.all_written()
        try:
            done = 0
            for save in saves:
                slots = reserved.slot_ids[done:done + len(save.hashes)]
                done += len(save.hashes)
                write_rows(session.slots, slots, self._ring.rows[save.span.start:save.span.stop])
        except ValueError as exc:  # slots outside the arena we mapped: a daemon bug
            log.warning("tierd save rejected: %s", exc)
            written = [False] * n  # the commit frees every reserved slot
        try:
            stored = commit(session.client, reserved, written)
        except grpc.RpcError as exc:
            self.stats.rpc_errors += 1
            self.stats.unsaved_blocks += n
            self._failed(session, exc, names_lease=True)
            return
        already = sum(reserved.already_stored)
        self.stats.saved_blocks += stored
        self.stats.skipped_stored_blocks += already
        self.stats.unsaved_blocks += n - stored - already
