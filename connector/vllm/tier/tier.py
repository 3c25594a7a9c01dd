"""``TierdTier``: tierd as a secondary tier of vLLM's native tiered offloading (vLLM 0.32+).

Enable it inside vLLM's ``OffloadingConnector`` (see docs/vllm.md)::

    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
      "cpu_bytes_to_use": 17179869184,
      "secondary_tiers": [{"type": "TierdTier", "module_path": "tierd.connector.vllm.tier",
                           "socket_path": "/run/tierd/tierd.sock"}]}

The tier's keys are ``TierdVllmConfig``'s (``socket_path``, ``address``, ``token``,
``engine_name``, ``timeout_seconds``, ``retry_seconds``, ``model_id``, ``load``, ``save``,
``workers``, ``max_queued_stores``) plus vLLM's ``locality`` and ``enable_kv_events``.

What vLLM's manager sees (every method runs on its scheduler thread, under its lock, and
returns at once; copies and daemon calls run on ``workers`` threads, ``jobs``):

* ``lookup``: RETRY for a key not seen yet; at the end of the step the keys a request looked up
  go to the daemon: one Probe pins the leading DRAM run and says where the rest of the held
  prefix lies, then Acquires of the rest in 32 MiB pieces pin it in DRAM (SSD hits are read in
  meanwhile) under leases; later lookups answer HIT for pinned keys, MISS for the rest.
  A key whose load failed answers MISS until it is stored again (else vLLM retries it forever).
  A daemon that is away answers MISS at once, and so does a tier still making its first
  connect (a request never waits for the tier's start).
* ``submit_load``: the pinned slots are copied into the primary rows, each slot verified in the
  same pass (``verified_copy``); a bad slot fails its key (``successful_keys`` names the others)
  and is reported so the daemon drops it; the lease is released when no key uses it.
* ``submit_store``: one copy of each chunk row into its slot, then the job is done (the primary
  chunks are free); the Commit that publishes the blocks follows on the same thread. The slots
  are blank ones reserved after the previous store (``core.stock``: no round trip before the
  copy), or for an engine's first store (and stores too large to keep slots for) a Reserve. A
  store that waits longer than ``timeout_seconds`` for a thread, or finds more than
  ``max_queued_stores`` jobs queued, or no daemon, is dropped and counted, never queued without
  bound. Every daemon error is a failed ``JobResult``, never an exception into vLLM.
* ``drain_jobs`` waits a bounded time; ``shutdown`` stops the threads, releases every lease,
  unregisters and drops the one view this tier made of the primary region.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import grpc
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tierd.connector.core.lease import Lease, PendingLease, acquire_async, probe_async, release
from tierd.connector.core.link import DaemonLink, Session
from tierd.connector.core.load import load_leased
from tierd.connector.core.runner import Runner
from tierd.connector.core.save import abort, commit, reserve
from tierd.connector.core.stock import SlotStock
from tierd.wire.client import target_for

from ..config import TierdVllmConfig
from ..identity import model_identity_for_tier
from .jobs import PrimaryRows, store_rows
from .layout import daemon_hash, slot_bytes, tier_layout
from .lookups import Answer, LoadPart, Lookups, Pin

_log = logging.getLogger(__name__)

METRICS = {
    "vllm:kv_offload_tierd_stores_dropped": "Chunks TierdTier did not store: no daemon, too many "
                                            "stores queued, a deadline passed, or save off.",
    "vllm:kv_offload_tierd_load_failures": "Chunks TierdTier failed to load (they answer MISS "
                                           "until stored again).",
    "vllm:kv_offload_tierd_checksum_failures": "Chunks whose slot failed its checksum on load.",
    "vllm:kv_offload_tierd_daemon_errors": "Daemon calls of TierdTier that failed.",
}
_RESULTS: dict[Answer, LookupResult] = {"hit": LookupResult.HIT, "miss": LookupResult.MISS,
                                        "retry": LookupResult.RETRY}
_SSD_PIECE_BYTES = 32 << 20
"""Bytes of chunks one Acquire asks for where a request's held prefix lies on SSD (an Acquire
answers once all of its blocks are read, so the first piece is copied while later ones are
read); its DRAM run goes as one Probe. Smaller pieces start the copies sooner; larger ones
make fewer round trips and load jobs (docs/bench-history.md has the runs behind the choice)."""


@dataclass(slots=True)
class _Probe:
    """One probe of a request's new keys: ``parts`` answers will come (set by the pool thread
    before it sends the first; read on the scheduler thread after it), ``answered`` so far."""

    parts: int = 0
    answered: int = 0


@dataclass(frozen=True, slots=True)
class _Probed:
    """Pool -> scheduler thread: the daemon's answer for ``keys``, one part of ``probe``: a
    Probe's or an Acquire's lease, or none (``session`` None: no daemon; ``error``: a call failed;
    keys the Lookup found not held); no lease means MISS."""

    keys: list[OffloadKey]
    session: Session | None
    lease: Lease | None
    error: grpc.RpcError | None
    probe: _Probe


@dataclass(frozen=True, slots=True)
class _Done:
    """Pool -> scheduler thread: a load or store job ended (``dropped``: a store not made)."""

    job_id: int
    ok: list[OffloadKey]
    failed: list[OffloadKey]
    corrupt: list[tuple[Pin, int]]  # (pin, index of its first bad slot)
    load: bool
    dropped: int = 0
    seconds: float | None = None
    nbytes: int | None = None


@dataclass(frozen=True, slots=True)
class _Stored:
    """Pool -> scheduler thread: a store's Commit landed; the daemon serves ``keys``."""

    keys: list[OffloadKey]


class TierdTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM's class (Any to mypy)
    """tierd as one of vLLM's secondary tiers: node-shared DRAM and a bounded, checksummed SSD
    tier behind vLLM's primary CPU tier (module doc)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
                for name, doc in METRICS.items()}

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("tierd_target", "tierd_model_id", "tierd_slot_bytes")

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, locality: str | None = None,
                 enable_kv_events: bool = False, **settings: Any) -> None:
        """Parse ``settings`` (``ValueError`` naming the fix), derive the model id and the
        namespace, start the threads. Reaches the daemon at the first lookup or store."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        config = TierdVllmConfig.from_extra_config(
            settings, where=f"secondary_tiers entry {tier_type!r}", front_end="TierdTier")
        offloading = offloading_spec.config
        identity = model_identity_for_tier(offloading, config.model_id)
        self._config = replace(config, model_id=identity.model_id)
        row_bytes = self.block_size_bytes
        self._layout = tier_layout(offloading, row_bytes, identity.model_id)
        _log.info("tierd tier: model id %s (%s); chunks of %d bytes in rows of %d",
                  identity.model_id, identity.source, self._layout.block_bytes, row_bytes)
        name = config.engine_name + "-tier"
        if int(offloading.parallel.data_parallel_size) > 1:
            name += f"-dp{offloading.parallel.data_parallel_index}"
        self.locality = Locality(locality) if locality is not None else None
        kv_events = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._events: list[OffloadingEvent] | None = [] if enable_kv_events and kv_events else None
        self._primary: PrimaryRows | None = PrimaryRows.of(primary_kv_view,
                                                           slot_bytes(offloading, row_bytes))
        self._link = DaemonLink(self._config, self._layout, name, attach=True)
        self._target = target_for(config.socket_path, config.address)
        self._pool = Runner(config.workers, f"tierd-{tier_type}", ("probe", "load", "store"))
        self._stock = SlotStock(config.timeout_seconds)
        self._inbox: queue.SimpleQueue[_Probed | _Done | _Stored] = queue.SimpleQueue()
        self._lookups = Lookups()
        self._jobs: set[int] = set()
        self._results: list[JobResult] = []
        self._probes = 0
        self._counts: dict[str, int] = {}
        self._counts_lock = threading.Lock()
        self._closed = False
        self._started = threading.Event()  # set once the first connect has ended, either way
        self._starting = threading.Thread(target=self._start, name=f"tierd-{tier_type}-connect",
                                          daemon=True)
        self._starting.start()

    def _start(self) -> None:
        """Register and map the arena before requests come, on a thread of its own: not a job,
        so vLLM is not kept stepping for it, and lookups meanwhile answer MISS (``lookup``)."""
        try:
            self.connect()
        finally:
            self._started.set()

    def connect(self) -> bool:
        """Register with the daemon and map its arena now, if not done yet (blocks for one
        round trip at most); whether the daemon is reachable. Called on a thread of its own at
        start; jobs and lookups connect by themselves. Once it returns True, lookups ask the
        daemon."""
        if self._session() is None:
            return False
        self._started.set()
        return True

    def _session(self) -> Session | None:
        """The current registration, registering first if needed (``DaemonLink.connect``: one
        round trip, at most once per retry period while the daemon is away); None while it
        cannot be reached. Any thread: work keeps the session it started with."""
        return self._link.session if self._link.connect() else None

    # -- lookups -------------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """MISS while the first connect is still under way (as for a daemon that is away: a
        request never waits for the tier's start), else ``Lookups.lookup`` (module doc)."""
        self._take_inbox()
        if not self._config.load or not self._started.is_set():
            return LookupResult.MISS
        answer, free = self._lookups.lookup(key, req_context)
        self._release_all(free)
        return _RESULTS[answer]

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Probe each request's new keys of this step on a pool thread (``_probe``)."""
        for keys in self._lookups.take_batches(1 << 30):
            self._probes += 1
            self._pool.submit("probe", functools.partial(self._probe, keys, _Probe()))

    def _probe(self, keys: list[OffloadKey], probe: _Probe) -> None:
        """Pool thread: one Probe pins the leading DRAM run of ``keys``' longest held prefix
        and says where the rest lies (a Lookup and an Acquire in one round trip); the rest is then
        asked for at once in pieces of ``_SSD_PIECE_BYTES``, so the first pieces answer (and vLLM
        starts loading them) while the daemon still reads later ones. Each answer goes to the
        inbox."""
        session = self._session()
        if session is None:
            probe.parts = 1
            self._inbox.put(_Probed(keys, None, None, None, probe))
            return
        hashes = [daemon_hash(k) for k in keys[:session.engine.max_blocks_per_request]]
        try:
            first = probe_async(session.client, session.engine_id, hashes, clock=time.monotonic)
            dram, rest = first.wait(), first.reply.result().held_after
        except grpc.RpcError as exc:
            probe.parts = 1
            self._inbox.put(_Probed(keys, session, None, exc, probe))
            return
        run, held = dram.num_blocks, dram.num_blocks + len(rest)
        pieces = probe_pieces(run, held, max(1, _SSD_PIECE_BYTES // self._layout.block_bytes))
        probe.parts = len(pieces) + 2
        self._inbox.put(_Probed(keys[:run], session, dram, None, probe))
        self._inbox.put(_Probed(keys[held:], session, None, None, probe))  # not held
        for piece in pieces:
            part = keys[piece.start:piece.stop]
            try:
                pending = acquire_async(session.client, session.engine_id,
                                        hashes[piece.start:piece.stop], clock=time.monotonic)
            except grpc.RpcError as exc:  # the channel closed under us
                self._inbox.put(_Probed(part, session, None, exc, probe))
                continue

            def answered(f: Any, part: list[OffloadKey] = part,
                         pending: PendingLease = pending) -> None:
                error = f.exception()
                self._inbox.put(_Probed(part, session, None if error else pending.wait(), error,
                                        probe))

            pending.reply.add_done_callback(answered)

    def _probed(self, done: _Probed) -> None:
        done.probe.answered += 1
        if done.probe.answered == done.probe.parts:
            self._probes -= 1
        if done.error is not None and done.session is not None:
            self._count("vllm:kv_offload_tierd_daemon_errors")
            session, error = done.session, done.error
            self._pool.submit("probe", lambda: self._link.failed(error, session))
        self._release_all(self._lookups.answer(done.keys, done.session, done.lease))

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._release_all(self._lookups.finish(req_context.req_id))

    def _release_all(self, pins: list[Pin]) -> None:
        for pin in pins:
            self._pool.submit("probe", functools.partial(self._release, pin))

    def _release(self, pin: Pin) -> None:
        """Pool thread: end a pin's lease (its damaged slot reported)."""
        try:
            release(pin.session.client, pin.lease, pin.corrupt_from)
        except grpc.RpcError as exc:  # NOT_FOUND before the deadline: a daemon that forgot
            # this engine (restarted): re-register now rather than lose the next stores
            self._link.failed(exc, pin.session,
                              names_lease=time.monotonic() >= pin.lease.deadline)

    # -- jobs --------------------------------------------------------------------------------

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Copy pinned slots into the job's primary rows on a pool thread (module doc)."""
        self._take_inbox()
        parts, missing = self._lookups.start_load(list(job_metadata.keys),
                                                  [int(c) for c in job_metadata.chunk_ids])
        self._jobs.add(job_metadata.job_id)
        job_id, keys = job_metadata.job_id, [p.key for p in parts] + missing
        self._pool.submit("load", self._guarded(job_id, keys, True,
                                                lambda: self._load(job_id, parts, missing)))

    def _load(self, job_id: int, parts: list[LoadPart], missing: list[OffloadKey]) -> None:
        """Pool thread: one ``core.load`` per pin, its slots checked while copied into the
        rows (``PrimaryRows`` is the sink); the outcome goes to the inbox. The pin's lease is
        released later, when no key holds it (``Lookups``), so its deadline alone decides
        whether a copy counts."""
        primary = self._primary
        assert primary is not None, "no job runs after shutdown"
        start = time.perf_counter()
        ok: list[OffloadKey] = []
        failed, corrupt = list(missing), []
        by_pin: dict[int, list[LoadPart]] = {}
        for part in parts:
            by_pin.setdefault(id(part.pin), []).append(part)
        for group in by_pin.values():
            pin, slots = group[0].pin, group[0].pin.session.slots
            assert slots is not None, "the tier's link attaches the arena"
            if time.monotonic() >= pin.expires:  # the pin may lapse mid-copy: do not copy
                failed += [p.key for p in group]
                continue
            lease = replace(pin.lease, slot_ids=[pin.lease.slot_ids[p.nth] for p in group],
                            checksums=[pin.lease.checksums[p.nth] for p in group])
            done = load_leased(lease, [p.chunk for p in group], slots, primary,
                               _released_later, time.monotonic)
            ok += [p.key for p in group[:done.placed]]
            failed += [p.key for p in group[done.placed:]]
            if done.corrupt:
                corrupt.append((pin, group[done.verified].nth))
        self._inbox.put(_Done(job_id, ok, failed, corrupt, load=True,
                              seconds=time.perf_counter() - start,
                              nbytes=len(ok) * primary.slot_bytes))

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Copy and commit on a pool thread, or drop the job at once (module doc)."""
        self._take_inbox()
        keys = list(job_metadata.keys)
        self._lookups.stored(keys)
        self._jobs.add(job_metadata.job_id)
        if not self._config.save or self._pool.queued("store") >= self._config.max_queued_stores:
            self._inbox.put(_Done(job_metadata.job_id, [], keys, [], load=False,
                                  dropped=len(keys)))
            return
        chunks = [int(c) for c in job_metadata.chunk_ids]
        queued = time.monotonic()
        job_id = job_metadata.job_id
        self._pool.submit("store", self._guarded(job_id, keys, False,
                                                 lambda: self._store(job_id, keys, chunks, queued)))

    def _guarded(self, job_id: int, keys: list[OffloadKey], load: bool,
                 work: Callable[[], None]) -> Callable[[], None]:
        """``work`` on a pool thread; if it raises (a bug, not a daemon error: those are
        handled inside), the job still ends, failed, so vLLM never waits on it (a job that had
        already reported keeps its first report: ``_take_inbox`` applies one per job)."""
        def run() -> None:
            try:
                work()
            except Exception:
                _log.exception("tierd tier: a %s job failed", "load" if load else "store")
                self._inbox.put(_Done(job_id, [], keys, [], load=load,
                                      dropped=0 if load else len(keys)))
        return run

    def _store(self, job_id: int, keys: list[OffloadKey], chunks: list[int],
               queued: float) -> None:
        """Pool thread: take the stock of blank slots (or Reserve), copy the rows, report the
        job done, ask for the next stock, then Commit."""
        primary = self._primary
        assert primary is not None, "no job runs after shutdown"
        session = self._session()
        if session is None or time.monotonic() - queued > self._config.timeout_seconds:
            self._inbox.put(_Done(job_id, [], keys, [], load=False, dropped=len(keys)))
            return
        assert session.slots is not None, "the tier's link attaches the arena"
        start = time.perf_counter()
        hashes = [daemon_hash(k) for k in keys]
        blank = self._stock.take(session, len(keys))
        try:
            reserved = blank or reserve(session.client, session.engine_id, hashes)
        except grpc.RpcError as exc:
            self._link.failed(exc, session)
            self._inbox.put(_Done(job_id, [], keys, [], load=False, dropped=len(keys)))
            self._count("vllm:kv_offload_tierd_daemon_errors")
            return
        try:
            written = store_rows(primary, session.slots, chunks, reserved.slot_ids[:len(keys)])
        except Exception:  # a bug: free the reservation now rather than at its lapse
            try:
                abort(session.client, reserved)
            except grpc.RpcError as exc:
                self._link.failed(exc, session, names_lease=True)
            raise
        self._inbox.put(_Done(job_id, keys, [], [], load=False,
                              seconds=time.perf_counter() - start,
                              nbytes=sum(written) * primary.slot_bytes))
        self._stock.refill(session, len(keys))
        try:  # also with nothing written: it ends the reservation (a stock's spare slots too)
            commit(session.client, reserved,
                   written + [False] * (len(reserved.slot_ids) - len(keys)),
                   hashes if blank else ())
        except grpc.RpcError as exc:  # the blocks are not stored; the job had freed its rows
            self._link.failed(exc, session)  # NOT_FOUND re-registers, as for a Release
            self._count("vllm:kv_offload_tierd_daemon_errors")
            return
        self._inbox.put(_Stored([k for k, w, done in zip(keys, written, reserved.already_stored)
                                 if w or done]))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._take_inbox()
        results, self._results = self._results, []
        return results

    def _take_inbox(self) -> None:
        """Apply what the pool threads reported (JobResults wait in ``_results``)."""
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, _Probed):
                self._probed(item)
            elif isinstance(item, _Stored):
                if self._events is not None and item.keys:
                    self._events.append(OffloadingEvent(keys=item.keys, medium=self.medium,
                                                        removed=False, locality=self.locality))
            elif item.job_id in self._jobs:  # one report per job (``_guarded``)
                self._results.append(self._finished(item))

    def _finished(self, done: _Done) -> JobResult:
        self._jobs.discard(done.job_id)
        if done.load:
            self._release_all(self._lookups.end_load(done.ok, done.failed, done.corrupt))
            if done.corrupt:
                self._count("vllm:kv_offload_tierd_checksum_failures", len(done.corrupt))
            if done.failed:
                self._count("vllm:kv_offload_tierd_load_failures", len(done.failed))
        elif done.dropped:
            self._count("vllm:kv_offload_tierd_stores_dropped", done.dropped)
        partial = tuple(done.ok) if done.failed and done.ok else None
        return JobResult(job_id=done.job_id, success=not done.failed, successful_keys=partial,
                         transfer_time=done.seconds, transfer_bytes=done.nbytes)

    # -- the rest of vLLM's interface ----------------------------------------------------------

    def has_pending_work(self) -> bool:
        """Jobs, probes, results or reports not yet taken, or pool tasks (a Commit, a Release)
        still running; not the first connect (``_start``), which needs no step of vLLM's."""
        return bool(self._jobs or self._probes or self._results or not self._inbox.empty()
                    or self._pool.busy())

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._take_inbox()
        if self._events:
            events, self._events = self._events, []
            yield from events

    def drain_jobs(self) -> None:
        """Wait (at most ``timeout_seconds`` + 10 s: every job's daemon calls have that
        deadline, and copies take milliseconds) until no load or store is queued or running."""
        if not self._pool.drain(self._config.timeout_seconds + 10.0, ("load", "store")):
            _log.error("tierd tier: jobs still running after %.0f s", self._config.timeout_seconds)

    def get_stats(self) -> OffloadingConnectorStats | None:
        self._take_inbox()
        with self._counts_lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return None
        stats = OffloadingConnectorStats()
        for name, value in counts.items():
            stats.increase_counter(name, value, (self.tier_type,))
        return stats

    def config_info(self) -> dict[str, str | int]:
        return {"tierd_target": self._target, "tierd_model_id": self._layout.model_id,
                "tierd_slot_bytes": self._layout.block_bytes}

    def shutdown(self) -> None:
        """Stop the threads (bounded), release every lease still held, unregister, and drop
        this tier's view of the primary region so vLLM can unmap it."""
        if self._closed:
            return
        self._closed = True
        self._starting.join(self._config.timeout_seconds + 10.0)
        if not self._pool.stop(self._config.timeout_seconds + 10.0):
            _log.error("tierd tier: a job still runs at shutdown; keeping the primary view")
            return
        self._link.close()  # unregistering ends every lease and reservation of this tier
        self._primary = None

    def check_integrity(self) -> None:
        """``Lookups.check_integrity``, and the in-flight counters are sane."""
        self._lookups.check_integrity()
        assert self._probes >= 0, "more answers than Probes and Acquires"

    def _count(self, name: str, value: int = 1) -> None:
        with self._counts_lock:  # pool threads count daemon errors too
            self._counts[name] = self._counts.get(name, 0) + value


def probe_pieces(run: int, held: int, ssd_piece: int) -> list[range]:
    """How a probe asks for the blocks of a held prefix of ``held`` blocks after its leading
    DRAM run of ``run`` (pinned by the first Acquire): in pieces of ``ssd_piece`` blocks."""
    return [range(i, min(i + ssd_piece, held)) for i in range(run, held, ssd_piece)]


def _released_later(lease: Lease, corrupt_from: int | None) -> None:
    """The ``core.load.Release`` of a load: none now (the pin's lease is released when no key
    holds it, ``TierdTier._release``), so the lease's deadline alone decides (``finish_load``)."""
    return None
