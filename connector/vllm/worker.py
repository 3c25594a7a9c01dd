"""The worker half of the vLLM adapter: loads before the forward pass, saves during and after it.

Per step, with the metadata the scheduler half built:

* ``load`` (vLLM's ``start_load_kv``): per request, one Acquire (the scheduler's pin keeps the
  blocks in DRAM since its lookup); the leased slots are checked where they lie in the arena
  and copied straight into vLLM's KV tensors in one pass (``native.verified_copy``: each 16 KiB
  of a slot is hashed, then copied while still in cache, blocks split over the torch threads),
  and the lease is released. Without the native helper (no C compiler), or with layers not in
  one buffer: verify every slot, then one strided copy per run of verified blocks, all layers
  at once. Synchronous: the forward pass that reads them starts after it returns.
  Every block that did not verify or arrive (a miss since the lookup, a checksum mismatch, the
  daemon gone) and every block after it in that request, or all of them if the lease expired
  during the copy, is reported by ``take_load_errors`` in the same step, so vLLM recomputes
  from there (whatever bytes those blocks hold).
* ``load`` of a streamed spec (an SSD hit vLLM loads asynchronously, host KV): handed to
  ``streaming.Streams``, which acquires and copies it chunk by chunk on its own thread while the
  daemon reads it; ``finished_loads`` (vLLM's ``get_finished``) reports each ended stream as
  received and its failed blocks as load errors of that same step.
* ``save_layer`` (vLLM's ``save_kv_layer``): on the first layer, one Reserve for the blocks the
  step completes; each layer's K/V is copied into the reserved slots as vLLM hands it over.
  Saves of a request whose load failed, or that sit on a block whose load failed
  (``SaveSpec.depends_on``; failed blocks are kept until the scheduler has seen them), are
  dropped, and that request's saves stay dropped until the scheduler names it in
  ``recomputing``: nothing computed on wrong KV is stored.
* ``finish_save`` (``wait_for_save``): hands the step's Commit to the committer thread and
  returns: vLLM may reuse its blocks at once (the bytes are already in the arena). The Commit
  names the written slots and the daemon checksums them itself (in its own process, so the
  engine's part of a store is the copy out of its KV), and the blocks become visible to other
  engines only whole, when it lands. If some layer never arrived, Abort instead.

On CUDA (vLLM's KV tensors on a GPU) the copies go through ``cuda_copy.DeviceTransfer`` over
the arena, registered as pinned memory at attach: a load is queued on a side stream after the
checksums and ``start_load_kv`` returns; ``wait_layer`` (``wait_for_layer_load``) makes the
forward pass's stream wait for each layer; the leases are released at ``finish_save`` (or
``take_load_errors``, whichever vLLM calls first) once the DMAs have read the slots, and a
lease found expired then makes its blocks load errors and drops the step's saves. A save
gathers each layer on the device; ``finish_save`` queues the D2H copies and the Commit waits
for them on the committer thread, so neither the host nor the next step waits for the
write-through.

Best effort: a save that fails is a future miss, never an error to vLLM; nothing holds vLLM's
blocks past the step (``get_finished`` has nothing to report: on CUDA a save's gathers are
ordered before the next step's work on vLLM's stream, so the blocks are free at once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from .config import TierdVllmConfig
from .cuda_copy import DeviceTransfer, SaveTicket, register_host_memory, unregister_host_memory
from .kv_tensors import (Run, SlotFormat, byte_view, load_blocks, runs, save_layer,
                         slot_format, stack_layers)
from tierd.connector.core.link import DaemonLink
from .metadata import LoadSpec, SaveSpec, TierdConnectorMetadata, TierdWorkerMetadata
from .stats import TierdConnectorStats
from .streaming import StreamedLoad, Streams
from tierd.connector.native import verified_copy
from tierd.connector.native.verified_copy import BlockRows
from tierd.connector.transfer import ArenaSlots
from tierd.daemon.client import TierdClient
from tierd.types import BlockHash

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _PendingSave:
    """One step's reservation while the layers are being copied into it."""

    lease_id: str
    num_hashes: int
    targets: list[tuple[int, int]]      # (index in the reservation, slot byte offset)
    block_runs: list[Run]
    reqs: list[str]                     # per target, the request it belongs to
    layers_done: set[int] = field(default_factory=set)
    device: DeviceTransfer | None = None  # CUDA: the transfer holding the open save

    def written(self) -> list[bool]:
        """The Commit's written flags: True where a slot was reserved (and every layer copied
        into it); the daemon checksums those slots itself."""
        out = [False] * self.num_hashes
        for index, _ in self.targets:
            out[index] = True
        return out


@dataclass(frozen=True, slots=True)
class _OpenLoad:
    """CUDA: a load queued on the side stream whose lease is released when its DMAs are done."""

    req_id: str
    block_ids: list[int]                # the vLLM blocks written (the verified prefix)
    engine_id: str
    lease_id: str
    corrupt_from: int | None
    deadline: float                     # the lease's end, on the worker's clock


class WorkerSide:
    """State of one worker's connector. Called from the worker's model-runner thread only."""

    def __init__(self, config: TierdVllmConfig, kv_caches: Mapping[str, torch.Tensor],
                 block_size: int, cache_dtype: str, tp_rank: int, tp_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 device_path: bool | None = None) -> None:
        """Take vLLM's per-layer caches (``ValueError`` naming the fix for ones tierd cannot
        store) of the model ``config.model_id`` (resolved: never None), derive the slot format and try to reach the daemon (down is fine: see
        ``DaemonLink.connect``). ``device_path``: copy through ``DeviceTransfer`` (default:
        when the caches are CUDA tensors; True on CPU tensors runs its logic with no-op
        streams, which is how the CPU suite covers it)."""
        assert config.model_id is not None, "the connector resolves the model id first"
        self._config, self._clock = config, clock
        self.format: SlotFormat
        self.format, layout = slot_format(kv_caches, block_size, cache_dtype, tp_rank, tp_size,
                                          config.model_id)
        self._layers = {name: i for i, name in enumerate(self.format.layer_names)}
        self._kv_bytes = [byte_view(t) for t in kv_caches.values()]
        self._stacked = stack_layers(self._kv_bytes)
        # Host KV in one buffer: loads verify while they copy (one pass, native helper, built
        # now rather than on the first load).
        self._rows = (BlockRows.of(self._stacked) if self._stacked is not None
                      and not self._stacked.is_cuda else None)
        if self._rows is not None:
            verified_copy.available()
        self.link = DaemonLink(config, layout, f"{config.engine_name}-tp{tp_rank}", attach=True,
                               clock=clock)
        self.link.connect()
        self.totals = TierdConnectorStats()  # since start, for logs and tests
        self._stats = TierdConnectorStats()  # since the last get_kv_connector_stats
        self._errors: set[int] = set()
        self._report = TierdWorkerMetadata()
        self._poisoned: set[str] = set()     # requests whose saves are dropped (see module doc)
        self._failed: set[int] = set()       # failed loads until the scheduler has seen them
        self._tp_size = tp_size
        self._step = 0                       # the step the bound metadata names
        # TP > 1: Commits wait here for the scheduler's verdict on their step (see metadata).
        self._held: list[tuple[int, str, str, list[bool], list[str], SaveTicket | None]] = []
        self._pending: _PendingSave | None = None
        self._reserved = False  # this step's Reserve was tried (it may have failed)
        # Committer: Commits, in order, off the engine thread, on a client of its own; it only
        # returns outcomes (``_harvest`` applies them on this thread).
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tierd-commit")
        self._commits: list[Future[tuple[int, int, grpc.RpcError | None]]] = []
        self._commit_client: TierdClient | None = None
        # CUDA: copies through a DeviceTransfer over the link's current arena mapping.
        self._on_cuda = self._kv_bytes[0].is_cuda if device_path is None else device_path
        self._device: DeviceTransfer | None = None
        self._open_loads: list[_OpenLoad] = []
        self._waits: DeviceTransfer | None = None  # the transfer holding this step's loads
        self._lease_lost = False                   # a lease of this step's loads ran out
        self._streams: Streams | None = None       # streamed (asynchronous) loads, host KV
        self._ended_now: list[StreamedLoad] = []   # streamed loads that ended at their start
        self._device_transfer()                    # register the arena now, not on a copy

    def _count(self, name: str, amount: int) -> None:
        if amount:
            self._stats.add(name, amount)
            self.totals.add(name, amount)

    # -- loads -------------------------------------------------------------------------------

    def load(self, meta: TierdConnectorMetadata) -> None:
        """Take the step's metadata: accept saves of requests vLLM is recomputing, then fill
        every planned block or report it (see the module doc). Blocks until done."""
        self._poisoned.difference_update(meta.recomputing)
        self._failed.difference_update(meta.failures_seen)
        self._step = self._report.step = meta.step
        if meta.verdict is not None:
            self._release_held(*meta.verdict)
        for spec in meta.loads:
            if spec.stream:
                self._start_stream(spec)
            else:
                self._account(spec, self._load_one(spec))

    def _account(self, spec: LoadSpec, good: int, cancelled: bool = False) -> None:
        """Report ``spec``'s load as done with ``good`` leading blocks in place: the rest are
        load errors (unless vLLM aborted the request) and poison the request's saves."""
        failed = spec.block_ids[good:]
        self._report.loaded[spec.req_id] = 1
        self._count("loaded_blocks", good)
        self._count("loaded_bytes", good * self.format.slot_bytes)
        if failed and not cancelled:
            self._errors.update(failed)
            self._report.failed.update(failed)
            self._failed.update(failed)
            self._poisoned.add(spec.req_id)
            self._count("failed_blocks", len(failed))

    def _start_stream(self, spec: LoadSpec) -> None:
        """Begin a streamed load (``streaming``). With the daemon down it fails now, and with
        CUDA KV too (the scheduler streams only to host KV; CUDA loads are staged instead); it is
        handed over at the next ``finished_loads`` either way."""
        link = self.link
        if self._on_cuda or not spec.block_ids or not link.connect():
            if self._on_cuda:
                _log.warning("tierd: a streamed load reached a CUDA worker; vLLM recomputes %s",
                             spec.req_id)
            self._ended_now.append(StreamedLoad(spec, ""))
            return
        if self._streams is None:
            config = self._config
            client = TierdClient(socket_path=config.socket_path, address=config.address,
                                 token=config.token, timeout=config.timeout_seconds)
            self._streams = Streams(client, self._stream_copy, self.format.slot_bytes,
                                    self._clock)
        self._streams.start(spec, link.engine.engine_id, link.slots, link.arena_tensor)

    def _stream_copy(self, slots: ArenaSlots, arena: torch.Tensor, slot_ids: list[int],
                     checksums: list[int], block_ids: list[int]) -> int:
        """Stream thread: one chunk, on one core (the forward pass keeps the others)."""
        return self._copy_in(slots, arena, slot_ids, checksums, block_ids, threads=1)

    def finished_loads(self, finished_req_ids: Iterable[str]) -> set[str]:
        """vLLM's ``get_finished``: stop the streamed loads of requests vLLM finished, and
        hand over (report, count, failed blocks as load errors this step) the streamed loads
        that ended; their request ids (finished receiving)."""
        finished = set(finished_req_ids)
        ended, self._ended_now = self._ended_now, []
        if self._streams is not None:
            self._streams.cancel(finished)
            ended += self._streams.take_finished()
        for load in ended:
            self._account(load.spec, load.placed, load.cancelled or load.spec.req_id in finished)
        self.finished(finished)
        return {load.spec.req_id for load in ended}

    def _load_one(self, spec: LoadSpec) -> int:
        """Load ``spec``'s leading blocks; returns how many were written and are valid."""
        if not spec.block_ids or not self.link.connect():
            return 0
        link, fmt = self.link, self.format
        engine_id = link.engine.engine_id
        asked = self._clock()
        try:
            got = link.client.acquire(engine_id, [BlockHash(h) for h in spec.block_hashes])
        except grpc.RpcError as exc:
            link.failed(exc)
            return 0
        slot_ids = got.slot_ids[:len(spec.block_ids)]
        block_ids, checksums = spec.block_ids[:len(slot_ids)], got.checksums[:len(slot_ids)]
        device = self._device_transfer()
        if device is not None:  # queued: the lease is released once the DMAs have read it
            good = link.slots.verified(slot_ids, checksums)  # where they lie: the lease pins them
            offsets = [link.engine.geometry.offset(s) for s in slot_ids[:good]]
            device.start_load(runs(block_ids[:good], offsets, fmt.slot_bytes))
            self._waits = device
            self._open_loads.append(_OpenLoad(spec.req_id, block_ids[:good], engine_id,
                                              got.lease_id,
                                              good if good < len(slot_ids) else None,
                                              asked + got.seconds_left))
            if good < len(slot_ids):
                _log.warning("tierd: block %d of %s failed its checksum; vLLM recomputes from "
                             "there", good, spec.req_id)
            return good
        good = self._copy_in(link.slots, link.arena_tensor, slot_ids, checksums, block_ids)
        in_time = self._clock() < asked + got.seconds_left
        try:
            link.client.release(engine_id, got.lease_id,
                                corrupt_from=good if good < len(slot_ids) else None)
        except grpc.RpcError as exc:  # expired on the daemon's side: the copy is not trusted
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the lease ended, not the link
                link.failed(exc)
            in_time = False
        if not in_time:
            _log.warning("tierd: lease on %d blocks of %s expired before the copy finished; "
                         "vLLM recomputes them", len(slot_ids), spec.req_id)
            return 0
        if good < len(slot_ids):
            _log.warning("tierd: block %d of %s failed its checksum; vLLM recomputes from there",
                         good, spec.req_id)
        return good

    def _copy_in(self, slots: ArenaSlots, arena: torch.Tensor, slot_ids: list[int],
                 checksums: list[int], block_ids: list[int], threads: int | None = None) -> int:
        """Host KV: check each leased slot where it lies in the arena and copy the leading
        verified blocks into vLLM's blocks; returns how many verified. One pass where the
        layers share one buffer and the native helper is built (a block that fails may then be
        partly written: it is reported, vLLM recomputes it), else verify, then copy."""
        if self._rows is not None:
            good = slots.load_verified(slot_ids, checksums, self._rows, block_ids,
                                       threads=threads)
            if good is not None:
                return good
        good = slots.verified(slot_ids, checksums)
        offsets = [slots.geometry.offset(s) for s in slot_ids[:good]]
        load_blocks(arena, self.format, self._kv_bytes,
                    runs(block_ids[:good], offsets, self.format.slot_bytes), self._stacked)
        return good

    def wait_layer(self, layer_name: str) -> None:
        """CUDA: make the current stream (the forward pass) wait until this step's loads of
        layer ``layer_name`` are in vLLM's blocks; the host does not wait. Nothing on CPU,
        where ``load`` is synchronous."""
        layer = self._layers.get(layer_name)
        if self._waits is not None and layer is not None:
            self._waits.wait_layer(layer)

    def _finish_loads(self) -> None:
        """CUDA: once this step's queued loads have read their slots, release their leases. A
        lease that ran out first (or a daemon gone) makes its blocks load errors, its request
        poisoned, and marks the step (``_lease_lost``) so that its saves are dropped."""
        loads, self._open_loads = self._open_loads, []
        device, self._waits = self._waits, None
        if device is not None:
            device.wait_reads()
        link = self.link
        for load in loads:
            in_time = link.up and self._clock() < load.deadline
            if link.up:
                try:
                    link.client.release(load.engine_id, load.lease_id,
                                        corrupt_from=load.corrupt_from)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        link.failed(exc)
                    in_time = False
            if in_time or not load.block_ids:
                continue
            _log.warning("tierd: lease on %d blocks of %s expired before the copy finished; "
                         "vLLM recomputes them", len(load.block_ids), load.req_id)
            self._lease_lost = True
            self._errors.update(load.block_ids)
            self._report.failed.update(load.block_ids)
            self._failed.update(load.block_ids)
            self._poisoned.add(load.req_id)
            self._count("loaded_blocks", -len(load.block_ids))
            self._count("loaded_bytes", -len(load.block_ids) * self.format.slot_bytes)
            self._count("failed_blocks", len(load.block_ids))

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose planned load failed since the last call (then forgotten)."""
        self._finish_loads()
        errors, self._errors = self._errors, set()
        return errors

    def _device_transfer(self) -> DeviceTransfer | None:
        """CUDA: the DeviceTransfer over the link's current arena mapping, made (the mapping
        registered as pinned memory) at the first call after each attach; None on CPU or
        while the link is down. Blocks while a mapping is registered."""
        if not self._on_cuda or not self.link.up:
            return None
        arena = self.link.arena_tensor
        if self._device is None or self._device.arena is not arena:
            self._close_device()
            self._device = DeviceTransfer(arena, self.format, self._kv_bytes,
                                          pinned=register_host_memory(arena))
        return self._device

    def _close_device(self) -> None:
        """Wait for every queued device copy, then unpin the mapping they used."""
        device, self._device = self._device, None
        if device is not None:
            device.close()
            if device.pinned:
                unregister_host_memory(device.arena)

    # -- saves -------------------------------------------------------------------------------

    def save_layer(self, layer_name: str, saves: list[SaveSpec]) -> None:
        """Copy ``layer_name``'s part of this step's saved blocks into their reserved slots
        (reserving them on the first layer of the step). Blocks until copied."""
        if not saves:
            return
        if not self._reserved:
            self._reserved = True
            self._pending = self._reserve(saves)
        pending, layer = self._pending, self._layers.get(layer_name)
        if pending is None or layer is None or not pending.targets:
            return
        if pending.device is not None:
            pending.device.save_layer(layer)
        else:
            save_layer(self.link.arena_tensor, self.format, layer, self._kv_bytes[layer],
                       pending.block_runs)
        pending.layers_done.add(layer)

    def _accepted(self, saves: Iterable[SaveSpec]) -> list[SaveSpec]:
        """The saves not computed on top of a failed load; poisons the requests of the rest."""
        failed = self._failed
        kept: list[SaveSpec] = []
        for spec in saves:
            if spec.req_id not in self._poisoned and not failed.intersection(spec.depends_on):
                kept.append(spec)
                continue
            self._poisoned.add(spec.req_id)
            self._count("dropped_blocks", len(spec.block_ids))
        return kept

    def _reserve(self, saves: list[SaveSpec]) -> _PendingSave | None:
        saves = self._accepted(saves)
        block_ids = [b for spec in saves for b in spec.block_ids]
        if not block_ids:
            return None
        if not self.link.connect():
            self._count("dropped_blocks", len(block_ids))
            return None
        link = self.link
        limit = link.engine.max_blocks_per_request
        hashes = [BlockHash(h) for spec in saves for h in spec.block_hashes][:limit]
        owners = [spec.req_id for spec in saves for _ in spec.block_hashes][:limit]
        self._count("dropped_blocks", len(block_ids) - len(hashes))
        try:
            reserved = link.client.reserve(link.engine.engine_id, hashes)
        except grpc.RpcError as exc:
            link.failed(exc)
            self._count("dropped_blocks", len(hashes))
            return None
        geometry = link.engine.geometry
        targets = [(i, geometry.offset(slot))
                   for i, slot in enumerate(reserved.slot_ids) if slot is not None]
        self._count("skipped_blocks", len(hashes) - len(targets))
        block_runs = runs([block_ids[i] for i, _ in targets], [o for _, o in targets],
                          self.format.slot_bytes)
        device = self._device_transfer() if targets else None
        if device is not None:  # blocks beyond the device staging bound are not written
            kept = device.open_save(block_runs)
            self._count("dropped_blocks", len(targets) - kept)
            targets = targets[:kept]
        return _PendingSave(reserved.lease_id, len(hashes), targets, block_runs,
                            [owners[i] for i, _ in targets], device=device)

    def finish_save(self) -> None:
        """Hand this step's Commit to the committer thread, or Abort the reservation if a layer
        is missing. Returns without waiting for the daemon; never raises for a daemon failure
        (outcomes are counted when they arrive)."""
        self._finish_loads()
        self._harvest()
        pending, self._pending, self._reserved = self._pending, None, False
        lease_lost, self._lease_lost = self._lease_lost, False
        # CUDA: close the device save (D2H queued, or nothing written if a layer is missing)
        ticket = pending.device.finish_save() if pending and pending.device else None
        if pending is None or not self.link.up:
            return
        link = self.link
        if lease_lost or len(pending.layers_done) < len(self.format.layer_names):
            self._count("dropped_blocks", len(pending.targets))
            try:
                link.client.abort(link.engine.engine_id, pending.lease_id)
            except grpc.RpcError as exc:
                link.failed(exc)
            return
        written = pending.written()
        owners: list[str] = [""] * pending.num_hashes
        for (index, _), req_id in zip(pending.targets, pending.reqs):
            owners[index] = req_id
        if self._tp_size > 1:  # wait for the verdict on this step (see TierdConnectorMetadata)
            self._held.append((self._step, link.engine.engine_id, pending.lease_id, written,
                               owners, ticket))
            return
        self._submit_commit(link.engine.engine_id, pending.lease_id, written, ticket)

    def _submit_commit(self, engine_id: str, lease_id: str, written: list[bool],
                       ticket: SaveTicket | None) -> None:
        if self._commit_client is None:
            config = self._config
            self._commit_client = TierdClient(socket_path=config.socket_path,
                                              address=config.address, token=config.token,
                                              timeout=config.timeout_seconds)
        self._commits.append(self._committer.submit(
            _commit, self._commit_client, engine_id, lease_id, written, ticket))

    def _release_held(self, step: int, bad: dict[str, int]) -> None:
        """Commit the held saves of steps up to ``step``, leaving out (as not written) the
        blocks of requests the verdict names for that step."""
        keep = []
        for held_step, engine_id, lease_id, written, owners, ticket in self._held:
            if held_step > step:
                keep.append((held_step, engine_id, lease_id, written, owners, ticket))
                continue
            spoiled = [i for i, r in enumerate(owners) if r in bad and held_step <= bad[r]]
            for i in spoiled:
                if written[i]:
                    written[i] = False
                    self._count("dropped_blocks", 1)
            self._submit_commit(engine_id, lease_id, written, ticket)
        self._held = keep

    def _harvest(self, wait: bool = False) -> None:
        """Count the outcomes of landed Commits (of all of them, with ``wait``)."""
        keep: list[Future[tuple[int, int, grpc.RpcError | None]]] = []
        for future in self._commits:
            if not wait and not future.done():
                keep.append(future)
                continue
            stored, lost, exc = future.result()
            if exc is not None:
                if self._commit_client is not None:  # a fresh channel next time
                    self._commit_client.close()
                    self._commit_client = None
                if self.link.up:
                    self.link.failed(exc)
            self._count("dropped_blocks", lost)
            self._count("saved_blocks", stored)
            self._count("saved_bytes", stored * self.format.slot_bytes)
        self._commits = keep

    def flush(self) -> None:
        """Wait until every handed-off Commit has landed and is counted."""
        self._harvest(wait=True)

    # -- reports -----------------------------------------------------------------------------

    def finished(self, req_ids: Iterable[str]) -> None:
        """Forget requests vLLM finished (their poison, if any)."""
        self._poisoned.difference_update(req_ids)

    def take_report(self) -> TierdWorkerMetadata | None:
        """This step's ``TierdWorkerMetadata`` (None if there is nothing to report)."""
        report, self._report = self._report, TierdWorkerMetadata()
        if self._tp_size > 1 and report.step:  # the verdicts count steps every rank finished
            return report
        return None if report.is_empty() else report

    def take_stats(self) -> TierdConnectorStats | None:
        """Counters since the last call (None if all are 0)."""
        self._harvest()
        stats, self._stats = self._stats, TierdConnectorStats()
        return None if stats.is_empty() else stats

    def close(self) -> None:
        """Land the pending Commits, stop the helper threads, unregister. Commits still waiting
        for a verdict are dropped (their reservations lapse on the daemon)."""
        self._count("dropped_blocks", sum(sum(h[3]) for h in self._held))
        self._held = []
        self._finish_loads()
        if self._streams is not None:
            self._streams.close()
        self.flush()
        self._close_device()
        self._committer.shutdown()
        if self._commit_client is not None:
            self._commit_client.close()
        self.link.close()


def _commit(client: TierdClient, engine_id: str, lease_id: str, written: list[bool],
            ticket: SaveTicket | None) -> tuple[int, int, grpc.RpcError | None]:
    """Committer thread: once the save's device copies are in the arena (``ticket``, CUDA),
    publish a reservation, the daemon checksumming the written slots; (blocks stored, blocks
    lost, the error)."""
    if ticket is not None:
        ticket.landed.synchronize()
    try:
        return client.commit(engine_id, lease_id, written), 0, None
    except grpc.RpcError as exc:
        return 0, sum(written), exc
