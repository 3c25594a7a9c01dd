"""The worker half of the vLLM adapter: loads before the forward pass, saves during and after it.

Per step, with the metadata the scheduler half built (``begin`` takes it at vLLM's
``handle_preemptions``, before vLLM prepares the step's inputs, and sends what the step will
wait for; vLLM calls ``start_load_kv`` before the forward pass only on a step with a
synchronous load, after it otherwise):

* ``load`` (vLLM's ``start_load_kv``): per request, ``core.load.load_leased`` under this rank's
  part of the scheduler's pin (``PinnedRun``: slot ids, checksums and deadline came in the
  metadata, so no daemon call; the scheduler releases the pin once every worker has reported
  the load) through the ``LayerViews`` sink: the pinned slots are checked where they lie in the
  arena and copied straight into vLLM's KV tensors in one pass (``native.verified_copy``: each
  16 KiB of a slot is hashed, then copied while still in cache, blocks split over the torch
  threads). A pin made in another arena than the one this worker maps (the daemon restarted
  since) is not used: the worker Acquires the blocks itself and releases them after the copy.
  A hit the scheduler answered from the presence filter (``LoadSpec.probe``) carries no pin:
  its Probe (the leading DRAM run pinned, no disk read) goes out at ``begin``; the load waits
  for it at most ``probed.PROBE_WAIT_SECONDS``, copies under that lease and releases it
  without waiting.
  Without the native helper (no C compiler), or with layers not in one buffer: verify every
  slot, then one strided copy per run of verified blocks, all layers at once. Synchronous: the
  forward pass that reads them starts after it returns.
  Every block that did not verify or arrive (a checksum mismatch, a miss of the worker's own
  Acquire, the daemon gone) and every block after it in that request, or all of them if the
  lease's deadline passed before the copy was done, is reported by ``take_load_errors`` in the
  same step, so vLLM recomputes from there (whatever bytes those blocks hold);
  ``outcomes.Outcomes`` keeps the books.
* ``load`` of a streamed spec (an SSD hit vLLM loads asynchronously, host KV): handed to
  ``streaming.Streams``, which acquires and copies it chunk by chunk on its own thread while the
  daemon reads it; ``finished_loads`` (vLLM's ``get_finished``) reports each ended stream as
  received and its failed blocks as load errors of that same step.
* saves: at ``begin`` on a step with no synchronous load, at the end of ``load`` on one with
  (after its loads, which can poison a request's saves), the blocks the step completes take
  the next slots of the stock of blank slots (host KV, one TP rank: ``step_stock``, no round
  trip; the stock's one Commit names the blocks of several steps); else (no stock answered, no
  room in it, CUDA, TP > 1) their Reserve goes out without waiting, sent by this thread
  (``TierdClient.reserve_sent``), answered during the forward pass. ``save_layer`` (vLLM's
  ``save_kv_layer``) marks each layer as handed over (on CUDA its K/V is gathered then, so the
  first layer waits for the answer). Host KV is copied into the slots after the step
  (``finish_save``), every layer at once (one native call, ``LayerViews.store``).
  Saves of a request whose load failed, or that sit on a block whose load failed
  (``SaveSpec.depends_on``; failed blocks are kept until the scheduler has seen them), are
  dropped, and that request's saves stay dropped until the scheduler names it in
  ``recomputing``: nothing computed on wrong KV is stored.
* write-back saves (``meta.evicted``, host KV): blocks vLLM gives to other tokens this step,
  copied out and their Commit sent by ``begin``, before anything of the step writes vLLM's KV.
* ``finish_save`` (``wait_for_save``): with host KV, returns at once: the step's save is
  *late*, closed (the Reserve's answer read, the copy into the slots, the Commit handed over to
  ``commits.Committer``, sent at a later step's ``begin``; or the stock told) by the committer
  thread right after the step, while this thread samples the step's tokens and waits for the
  next one, or at the latest first thing at the next step's ``begin``, before vLLM prepares
  that step: no KV of vLLM's is written between the end of one step and the ``begin`` of the
  next (not by the forward pass, nor by a load), and ``begin`` waits for a close the committer
  thread has under way. So the copy is not on the path of the step's sampled tokens. The
  Commit names the written slots and the daemon checksums them itself (in its own process, so
  the engine's part of a store is the copy out of its KV), and the blocks become visible to
  other engines only whole, when it lands. If some layer never arrived, Abort instead. A step
  that outlasted half of its write lease (a slow forward pass) is *re-offered* first: a fresh
  Reserve, into which every layer is copied from vLLM's blocks (they hold the step's KV until
  the next step's ``begin``; on CUDA gathered again), the old reservation aborted, so a slow
  step does not lose its saves to a lapsed lease (``reoffered_blocks``); a Commit that still
  finds its lease ended is a WARNING and ``lapsed_blocks`` (``commits``).

On CUDA (vLLM's KV tensors on a GPU) the copies go through ``device_path.DevicePath`` (its
doc): loads queued on a side stream, saves gathered per layer and copied back after the step.

The forward pass (from ``bind_connector_metadata``, or the end of the step's synchronous loads,
to ``finish_save``) is timed for the engine's prefill speed (``core.prefill_speed``), sent to the
daemon, which counts the cache's savings at it.

Best effort: a save that fails is a future miss, never an error to vLLM; nothing holds vLLM's
blocks past the step (``get_finished`` has nothing to report: on CUDA a save's gathers are
ordered before the next step's work on vLLM's stream, so the blocks are free at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import grpc
import torch

from tierd.connector.core.lease import Lease, Release, acquire, releaser
from tierd.connector.core.link import DaemonLink, Session
from tierd.connector.core.load import load_leased, start_load
from tierd.connector.core.prefill_speed import PrefillSpeed
from tierd.connector.core.save import abort, reservation_of
from tierd.types import BlockHash

from ..config import TierdVllmConfig
from . import commits
from .commits import Committer
from .device_path import DevicePath, cuda_event
from .kv_tensors import SlotFormat, byte_view, runs, slot_format
from .metadata import LoadSpec, SaveSpec, TierdConnectorMetadata, TierdWorkerMetadata
from .outcomes import Outcomes
from .pins import kept_under_pin
from .probed import Probes, Unread, release_later
from .sinks import LayerViews
from .stats import Counters, TierdConnectorStats
from .step_save import Asked, LateSave, PendingSave, StepSave
from .step_stock import StepStock
from .streaming import StreamState

_log = logging.getLogger(__name__)


class WorkerSide:
    """State of one worker's connector. Called from the worker's model-runner thread only."""

    def __init__(self, config: TierdVllmConfig, kv_caches: Mapping[str, torch.Tensor],
                 block_size: int, cache_dtype: str, tp_rank: int, tp_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 device_path: bool | None = None) -> None:
        """Take vLLM's per-layer caches (``ValueError`` naming the fix for ones tierd cannot
        store) of the model ``config.model_id`` (resolved: never None), derive the slot format
        and try to reach the daemon (down is fine: see ``DaemonLink.connect``).
        ``device_path``: copy through ``DeviceTransfer`` (default: when the caches are CUDA
        tensors; True on CPU tensors runs its logic with no-op streams, which is how the CPU
        suite covers it)."""
        assert config.model_id is not None, "the connector resolves the model id first"
        self._clock = clock
        self.format: SlotFormat
        self.format, layout = slot_format(kv_caches, block_size, cache_dtype, tp_rank, tp_size,
                                          config.model_id)
        self._layers = {name: i for i, name in enumerate(self.format.layer_names)}
        kv_bytes = [byte_view(t) for t in kv_caches.values()]
        self._host = LayerViews(self.format, kv_bytes)  # one pass where the layers share a buffer
        self._rank = tp_rank
        self.link = DaemonLink(config, layout, f"{config.engine_name}-tp{tp_rank}", attach=True,
                               clock=clock)
        self.link.connect()
        self._counters = Counters()
        self._outcomes = Outcomes(self._counters, self.format.slot_bytes, tp_size)
        self._save = StepSave()
        self._late: LateSave | None = None  # a step's save, closed after the step
        self._late_lock = threading.Lock()  # held while a late save is closed (either thread)
        self._begun: int | None = None  # the step ``begin`` took (``meta.step``), until it ends
        device = kv_bytes[0].is_cuda if device_path is None else device_path
        self._stock = StepStock(lambda: commits.HOLD_SECONDS, clock) \
            if tp_size == 1 and not device else None  # host KV, one rank: saves share slots
        self._commits = Committer(self.link, self._counters, self.format.slot_bytes, tp_size,
                                  clock, self._stock)
        self._unread = Unread(self.link.timeout_seconds)  # probed loads' Releases
        self._probes = Probes(self.link, clock)
        self._device = DevicePath(self.format, kv_bytes, device)
        self._streaming = StreamState(self._host.with_threads(1))  # the forward pass keeps the rest
        self._speed = PrefillSpeed(clock, events=cuda_event if kv_bytes[0].is_cuda else None)
        self._device.sink(self.link)  # register the arena now, not on a copy

    @property
    def waits_per_layer(self) -> bool:
        """Loads are queued per layer (CUDA): ``wait_layer`` has work (host KV: none)."""
        return self._device.enabled

    @property
    def totals(self) -> TierdConnectorStats:
        """Counters since start (logs, tests)."""
        return self._counters.totals

    # -- loads -------------------------------------------------------------------------------

    def begin(self, meta: TierdConnectorMetadata) -> None:
        """The step's first hook (vLLM's ``handle_preemptions``, before it prepares the step's
        inputs; else ``bind_connector_metadata``); once per step: take the step's metadata
        (accept saves of requests vLLM is recomputing; commit the held saves the scheduler's
        verdict names), send the Commits handed over since the last step and the Probes of
        the step's probed loads. A step with no synchronous load sends the Reserve of its
        saves now (vLLM calls ``start_load_kv`` after the forward pass on such a step); one
        with a synchronous load does it in ``load``, after its loads (a load that fails
        poisons its request's saves)."""
        if self._begun == meta.step:
            return
        self._begun = meta.step
        self._close_late()  # before anything of this step writes vLLM's KV
        self._outcomes.begin_step(meta)
        if meta.verdict is not None and self._commits.verdict(*meta.verdict):
            self._commits.harvest(wait=True)  # before this step's Reserve of the blocks left out
        if meta.evicted:  # write-back: before anything of this step writes vLLM's KV
            self._save_evicted(meta.evicted, meta.step)
        self._commits.send(now=bool(meta.evicted))  # while vLLM's scheduler waits for this step
        if self._unread:
            self._unread.reap()
        loads = meta.loads
        if loads:
            session = self.link.session
            for spec in loads:
                if (spec.probe and not spec.stream and spec.block_ids and session is not None
                        and spec.pin_of(self._rank, session.engine.arena_name) is None):
                    self._probes.send(session, spec.req_id,
                                      [BlockHash(h) for h in spec.block_hashes])
            if any(not spec.stream for spec in loads):
                return
        if meta.saves and not self._save.tried:  # its answer comes during the forward pass
            self._begin_save(meta.saves)

    def bound(self, meta: TierdConnectorMetadata) -> None:
        """vLLM's ``bind_connector_metadata``, right before the forward pass: ``begin`` if no
        hook did; on a step with no synchronous load, start the prefill timer."""
        self.begin(meta)
        if not meta.loads or all(spec.stream for spec in meta.loads):
            self._speed.begin(meta.prefill_tokens)

    def load(self, meta: TierdConnectorMetadata) -> None:
        """vLLM's ``start_load_kv``: fill every planned block or report it (see the module
        doc); blocks until done. On a step with synchronous loads (before the forward pass),
        then send the Reserve of its saves and start the prefill timer."""
        self.begin(meta)  # vLLM binds every step's metadata first; a caller may not
        if not meta.loads and not self._probes:
            return  # the usual step: nothing to load, no Probe to give up on
        sync = False
        for spec in meta.loads:
            if spec.stream:
                self._streaming.start(spec, self.link, self.format.slot_bytes, self._clock,
                                      self._device.enabled)
            else:
                sync = True
                self._outcomes.loaded(spec.req_id, spec.block_ids, self._load_one(spec))
        self._probes.drop_all()
        if not sync:
            return
        if meta.saves and not self._save.tried:  # its answer comes during the forward pass
            self._begin_save(meta.saves)
        self._speed.begin(meta.prefill_tokens)  # the forward pass starts after this returns

    def finished_loads(self, finished_req_ids: Iterable[str]) -> set[str]:
        """vLLM's ``get_finished``: stop the streamed loads of requests vLLM finished, and
        hand over (report, count, failed blocks as load errors this step) the streamed loads
        that ended; their request ids (finished receiving)."""
        if not finished_req_ids and self._streaming.idle:
            return set()  # the usual step: no stream, nothing finished
        finished = set(finished_req_ids)
        ended = self._streaming.ended(finished)
        for load in ended:
            spec = load.spec
            self._outcomes.loaded(spec.req_id, spec.block_ids, load.placed,
                                  load.cancelled or spec.req_id in finished)
        self.finished(finished)
        return {load.spec.req_id for load in ended}

    def _load_one(self, spec: LoadSpec) -> int:
        """Load ``spec``'s leading blocks; returns how many were written and are valid (on
        CUDA: verified and queued; ``_finish_loads`` takes them back if the lease ran out).
        Under this rank's part of the scheduler's pin where the spec carries one in the arena
        this worker maps (no daemon call: the scheduler releases the pin once every worker has
        reported the load); else under an Acquire of its own, released after the copy."""
        if not spec.block_ids or not self.link.connect():
            return 0
        session = self.link.session
        assert session is not None and session.slots is not None
        pinned = spec.pin_of(self._rank, session.engine.arena_name)
        release: Release = kept_under_pin
        hashes = [BlockHash(h) for h in spec.block_hashes]
        if pinned is not None:
            lease = Lease(session.engine_id, "", pinned.slot_ids, pinned.checksums,
                          pinned.deadline)
        elif spec.probe:
            got = self._probes.lease(session, spec.req_id, hashes)
            if got is None:
                return 0
            lease, release = got, release_later(session, self._release_for(session),
                                                self._unread)
        else:
            try:
                lease = acquire(session.client, session.engine_id, hashes, clock=self._clock)
            except grpc.RpcError as exc:
                self.link.failed(exc, session)
                return 0
            release = self._release_for(session)
        device = self._device.sink(self.link)
        if device is not None:  # queued: the lease is released once the DMAs have read it
            opened = start_load(lease, spec.block_ids, session.slots, device)
            self._device.opened(spec.req_id, release, opened, device)
            if opened.corrupt_from is not None:
                _log.warning("tierd: block %d of %s failed its checksum; vLLM recomputes from "
                             "there", opened.verified, spec.req_id)
            return opened.verified
        done = load_leased(lease, spec.block_ids, session.slots, self._host, release,
                           self._clock)
        if done.lease_lost:
            _log.warning("tierd: lease on %d blocks of %s expired before the copy finished; "
                         "vLLM recomputes them", done.acquired, spec.req_id)
        elif done.corrupt:
            _log.warning("tierd: block %d of %s failed its checksum; vLLM recomputes from there",
                         done.verified, spec.req_id)
        return done.placed

    def _release_for(self, session: Session) -> Release:
        """Release leases of ``session`` now; one of a session the link has dropped is gone."""
        now = releaser(session.client,
                       lambda exc: self.link.failed(exc, session, names_lease=True))

        def release(lease: Lease, corrupt_from: int | None) -> bool | None:
            return now(lease, corrupt_from) if self.link.session is session else False
        return release

    def wait_layer(self, layer_name: str) -> None:
        """CUDA: make the current stream (the forward pass) wait until this step's loads of
        layer ``layer_name`` are in vLLM's blocks; the host does not wait. Nothing on CPU,
        where ``load`` is synchronous."""
        layer = self._layers.get(layer_name)
        if layer is not None:
            self._device.wait_layer(layer)

    def _finish_loads(self) -> bool:
        """CUDA: once this step's queued loads have read their slots, release their leases. A
        lease that ran out first (or a daemon gone) makes its blocks load errors and its request
        poisoned; True if one did (the step's saves are then dropped)."""
        if not self._device.enabled:
            return False  # host KV: loads are done within ``load``
        lost = False
        for load, done in self._device.finish(self._clock):
            verified = load.load.block_ids[:done.verified]
            if not done.lease_lost or not verified:
                continue
            _log.warning("tierd: lease on %d blocks of %s expired before the copy finished; "
                         "vLLM recomputes them", len(verified), load.req_id)
            lost = True
            self._outcomes.taken_back(load.req_id, verified)
        return lost

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose planned load failed since the last call (then forgotten)."""
        self._save.lease_lost |= self._finish_loads()
        return self._outcomes.take_errors()

    # -- saves -------------------------------------------------------------------------------

    def save_layer(self, layer_name: str, saves: list[SaveSpec]) -> None:
        """Take ``layer_name``'s part of this step's saved blocks (their Reserve was sent at
        ``load``, or is sent now): on CUDA gather it now, which needs the reserved slots; host
        KV is copied at ``finish_save``."""
        if not saves:
            return
        step = self._save
        if not step.tried:
            self._begin_save(saves)
        layer = self._layers.get(layer_name)
        if layer is None:
            return
        step.layers.add(layer)
        if self._device.enabled:
            pending = self._pending()
            if pending is not None and pending.device is not None:
                pending.device.transfer.save_layer(layer)

    def _begin_save(self, saves: list[SaveSpec]) -> None:
        """Take this step's ``saves`` (those ``Outcomes`` accepts after the step's loads): into
        slots of the stock (``_from_stock``), else send their Reserve without waiting
        (``_ask``)."""
        step = self._save
        step.tried = True
        step.saves = self._outcomes.accepted(saves)
        step.pending = self._from_stock(step.saves)
        step.asked = None if step.pending is not None else self._ask(step.saves)

    def _save_evicted(self, saves: list[SaveSpec], number: int) -> None:
        """Write-back: copy out the blocks vLLM reuses this step and hand their Commit over."""
        step = StepSave(True, saves=self._outcomes.accepted(saves),
                        layers=set(range(len(self.format.layer_names))))
        step.pending = self._from_stock(step.saves) or self._reserve(step.saves)
        self._gather_all(step.pending)
        self._close(step, False, number)

    def _gather_all(self, pending: PendingSave | None) -> None:
        """CUDA: gather every layer of ``pending``'s blocks now (nothing with host KV)."""
        if pending is not None and pending.device is not None:
            for layer in range(len(self.format.layer_names)):
                pending.device.transfer.save_layer(layer)

    def _from_stock(self, saves: list[SaveSpec]) -> PendingSave | None:
        """The accepted ``saves`` laid out for the copy into the stock's next slots
        (``step_stock``: no round trip), or None (no stock, or none with room)."""
        block_ids = [b for spec in saves for b in spec.block_ids]
        session = self.link.session
        if self._stock is None or not block_ids or session is None or not self.link.up:
            return None
        taken = self._stock.take(session, len(block_ids))
        return None if taken is None else PendingSave.stocked(
            taken, session.engine.geometry, saves, block_ids, self.format.slot_bytes)

    def _pending(self) -> PendingSave | None:
        """This step's reservation, waiting for the Reserve's answer if it is still in flight."""
        step = self._save
        if step.asked is not None:
            asked, step.asked = step.asked, None
            step.pending = self._settle(asked)
        return step.pending

    def _reserve(self, saves: list[SaveSpec]) -> PendingSave | None:
        """Reserve slots for the accepted ``saves`` and wait for them (``_ask``, ``_settle``)."""
        asked = self._ask(saves)
        return None if asked is None else self._settle(asked)

    def _ask(self, saves: list[SaveSpec]) -> Asked | None:
        """Send the Reserve of the accepted ``saves``' blocks (cut to the daemon's
        ``max_blocks_per_request``) without waiting. None if there is nothing to ask or no
        daemon (the blocks counted as dropped)."""
        block_ids = [b for spec in saves for b in spec.block_ids]
        if not block_ids:
            return None
        counts: list[tuple[str, int]] = []
        if not self.link.connect():
            self._count(counts, "dropped_blocks", len(block_ids))
            return None
        session = self.link.session
        assert session is not None
        limit = session.engine.max_blocks_per_request
        hashes = [BlockHash(h) for spec in saves for h in spec.block_hashes][:limit]
        owners = [spec.req_id for spec in saves for _ in spec.block_hashes][:limit]
        self._count(counts, "dropped_blocks", len(block_ids) - len(hashes))
        asked = self._clock()
        try:
            reply = session.client.reserve_sent(session.engine_id, hashes)
        except grpc.RpcError as exc:  # the channel closed under it
            self.link.failed(exc, session)
            self._count(counts, "dropped_blocks", len(hashes))
            return None
        return Asked(session, reply, asked, block_ids[:len(hashes)], owners, counts)

    def _settle(self, asked: Asked) -> PendingSave | None:
        """Wait for ``asked``'s answer and lay out its copy: the reserved slots' offsets, the
        runs of vLLM blocks to copy; on CUDA open the device save. None if the Reserve failed
        or its session was dropped since (the blocks counted as dropped)."""
        counts, session = asked.counts, asked.session
        try:
            reservation = reservation_of(session.engine_id, asked.reply.result())
        except grpc.RpcError as exc:
            self.link.failed(exc, session)
            self._count(counts, "dropped_blocks", len(asked.block_ids))
            return None
        if self.link.session is not session:  # its slots are in an arena no longer mapped
            self._count(counts, "dropped_blocks", len(asked.block_ids))
            return None
        geometry = session.engine.geometry
        targets = [(i, geometry.offset(slot))
                   for i, slot in enumerate(reservation.slot_ids) if slot is not None]
        self._count(counts, "skipped_blocks", len(asked.block_ids) - len(targets))
        block_runs = runs([asked.block_ids[i] for i, _ in targets], [o for _, o in targets],
                          self.format.slot_bytes)
        device = self._device.sink(self.link) if targets else None
        if device is not None:  # blocks beyond the device staging bound are not written
            kept = device.transfer.open_save(block_runs)
            self._count(counts, "dropped_blocks", len(targets) - kept)
            targets = targets[:kept]
        return PendingSave(reservation, targets, block_runs,
                            [asked.owners[i] for i, _ in targets],
                            asked.asked + reservation.seconds_left / 2, counts, device=device)

    def _count(self, counts: list[tuple[str, int]], name: str, amount: int) -> None:
        """Count ``amount`` of ``name`` for a save, remembered in ``counts`` (undone if the
        save is re-offered)."""
        self._counters.count(name, amount)
        counts.append((name, amount))

    def _reoffer(self, old: PendingSave, saves: list[SaveSpec]) -> PendingSave | None:
        """The step outlasted half of its write lease, so its Commit might land after the lease
        ended and store nothing: abort that reservation, reserve anew and take every layer again
        from vLLM's blocks (they hold this step's KV until the step ends). The old reservation's
        counts are undone; the new one counts its own. None if nothing was reserved (its blocks
        counted as dropped)."""
        if old.device is not None:
            old.device.transfer.drop_save()
        for name, amount in old.counts:
            self._counters.count(name, -amount)
        session = self.link.session
        if old.taken is not None and self._stock is not None:  # the stock's slots stay blank
            self._stock.done(old.taken, [], False)
        elif session is not None:
            try:
                abort(session.client, old.reservation)
            except grpc.RpcError as exc:
                self.link.failed(exc, session, names_lease=True)
        new = self._reserve(saves)
        if new is None:
            return None
        self._gather_all(new)
        self._counters.count("reoffered_blocks", len(new.targets))
        return new

    def finish_save(self) -> None:
        """Hand this step's Commit over (``commits``), or Abort the reservation if a layer
        is missing (``_close``); host KV is closed after the step (module doc). Returns
        without waiting for the daemon; never raises for a daemon failure (outcomes are
        counted when they arrive)."""
        self._speed.end()
        self._report_speed()
        self._begun = None  # the step ends here
        lease_lost = self._finish_loads() or self._save.lease_lost
        self._commits.harvest()
        self._close_late()  # one left by a caller that skipped ``begin``
        step = self._save
        if not step.tried and not step.layers and not step.lease_lost:
            return  # the step saved nothing: its blank state serves the next one
        self._save = StepSave()
        if (step.asked is not None or step.pending is not None) and not self._device.enabled:
            with self._late_lock:
                self._late = LateSave(step, lease_lost, self._outcomes.step)
            self._commits.soon(self._close_late)
            return
        self._close(step, lease_lost, self._outcomes.step)

    def _close_late(self) -> None:
        """Close the late save, if any (the committer thread right after the step, or the
        engine thread at the next ``begin`` if it comes first); whoever comes second finds it
        closed, or waits for the close under way (only the engine thread hands one over)."""
        if self._late is None and not self._late_lock.locked():
            return  # the usual look: no late save
        with self._late_lock:
            late, self._late = self._late, None
            if late is not None:
                self._close(late.step, late.lease_lost, late.number)

    def _close(self, step: StepSave, lease_lost: bool, number: int) -> None:
        """The end of step ``number``'s save: its Reserve's answer (waited for), the copy of
        host KV into the slots and the Commit handed over (into the stock's slots: the stock
        told, its Commit comes later); the Abort where nothing is to be written; the re-offer
        of a step that outlasted half of its write lease."""
        pending = self._settle(step.asked) if step.asked is not None else step.pending
        complete = len(step.layers) == len(self.format.layer_names)
        if (pending is not None and not lease_lost and self._clock() >= pending.renew_at
                and complete):
            pending = self._reoffer(pending, step.saves)
        # CUDA: close the device save (D2H queued, or nothing written if a layer is missing)
        ticket = pending.device.transfer.finish_save() if pending and pending.device else None
        if pending is not None and pending.taken is not None:  # the stock's slots (no Commit)
            assert self._stock is not None
            ok = self.link.up and not lease_lost and complete
            if ok:
                self._host.store(self.link.arena_tensor, pending.block_runs)
            elif self.link.up:
                self._counters.count("dropped_blocks", len(pending.targets))
            self._stock.done(pending.taken, pending.names, ok)  # not written: freed at its Commit
            return
        if pending is None or not self.link.up:
            return
        session = self.link.session
        assert session is not None
        if lease_lost or not complete or not pending.targets:
            self._counters.count("dropped_blocks", len(pending.targets))
            if all(slot is None for slot in pending.reservation.slot_ids):
                return  # nothing was reserved: no lease to end
            try:
                abort(session.client, pending.reservation)
            except grpc.RpcError as exc:
                self.link.failed(exc, session, names_lease=True)
            return
        if pending.device is None and pending.targets:
            self._host.store(self.link.arena_tensor, pending.block_runs)
        self._commits.commit(number, pending.reservation, pending.written(),
                             pending.owner_of_each(), ticket)

    def _report_speed(self) -> None:
        """Send the measured prefill speed when one is due (``core.prefill_speed``: the
        daemon counts the cache's savings at it), without waiting: its answer is read at a
        later step (``probed.Unread``); a call that fails to go out drops the session."""
        speed = self._speed.take()
        session = self.link.session
        if speed is None or session is None:
            return
        try:
            self._unread.add(session.client.report_speed_sent(session.engine_id, speed))
        except grpc.RpcError as exc:
            self.link.failed(exc, session)

    def flush(self) -> None:
        """Wait until every handed-off Commit (a late save's, the stock's) has landed."""
        self._close_late()
        self._commits.harvest(wait=True, stock=True)

    # -- reports -----------------------------------------------------------------------------

    def finished(self, req_ids: Iterable[str]) -> None:
        """Forget requests vLLM finished (their poison, if any)."""
        self._outcomes.finished(req_ids)

    def take_report(self) -> TierdWorkerMetadata | None:
        """This step's ``TierdWorkerMetadata`` (None if there is nothing to report)."""
        return self._outcomes.take_report()

    def take_stats(self) -> TierdConnectorStats | None:
        """Counters since the last call (None if all are 0)."""
        self._commits.harvest()
        return self._counters.take()

    def close(self) -> None:
        """Land the pending Commits, stop the helper threads, unregister. Commits still waiting
        for a verdict are dropped (their reservations lapse on the daemon)."""
        self._close_late()
        self._finish_loads()
        if self._streaming.streams is not None:
            self._streaming.streams.close()
        self._commits.close()
        self._probes.drop_all()
        self._unread.close()
        self._device.close()
        self.link.close()
