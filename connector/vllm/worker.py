"""The worker half of the vLLM adapter: loads before the forward pass, saves during and after it.

Per step, with the metadata the scheduler half built:

* ``load`` (vLLM's ``start_load_kv``): per request, one Acquire (the scheduler's pin keeps the
  blocks in DRAM since its lookup); each leased slot's checksum is verified where it lies in the
  arena, the leading run of verified blocks is copied straight into vLLM's KV tensors (one
  strided copy per run of blocks, all layers at once), and the lease is released. (Verifying
  while another thread copies measured slower on these 2-core hosts: both passes are bound by
  memory bandwidth.) Synchronous: the forward pass that reads them starts after it returns.
  Every block not written (a miss since the lookup, a checksum mismatch, the daemon gone) and
  every block after it in that request, or all of them if the lease expired during the copy,
  is reported by ``take_load_errors`` in the same step, so vLLM recomputes from there.
* ``save_layer`` (vLLM's ``save_kv_layer``): on the first layer, one Reserve for the blocks the
  step completes; each layer's K/V is copied into the reserved slots as vLLM hands it over.
  Saves of a request whose load failed, or that sit on top of any block that failed to load this
  step (``SaveSpec.depends_on``), are dropped, and that request's saves stay dropped until the
  scheduler names it in ``recomputing``: nothing computed on wrong KV is stored.
* ``finish_save`` (``wait_for_save``): hands the step's Commit to the committer thread and
  returns: vLLM may reuse its blocks at once (the bytes are already in the arena). The Commit
  names the written slots and the daemon checksums them itself (in its own process, so the
  engine's part of a store is the copy out of its KV), and the blocks become visible to other
  engines only whole, when it lands. If some layer never arrived, Abort instead.

Best effort: a save that fails is a future miss, never an error to vLLM; nothing holds vLLM's
blocks past the step (``get_finished`` has nothing to report).
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
from .kv_tensors import (Run, SlotFormat, byte_view, load_blocks, runs, save_layer,
                         slot_format, stack_layers)
from .link import DaemonLink
from .metadata import LoadSpec, SaveSpec, TierdConnectorMetadata, TierdWorkerMetadata
from .stats import TierdConnectorStats
from tierd.checksum import block_checksum
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

    def written(self) -> list[bool]:
        """The Commit's written flags: True where a slot was reserved (and every layer copied
        into it); the daemon checksums those slots itself."""
        out = [False] * self.num_hashes
        for index, _ in self.targets:
            out[index] = True
        return out


class WorkerSide:
    """State of one worker's connector. Called from the worker's model-runner thread only."""

    def __init__(self, config: TierdVllmConfig, kv_caches: Mapping[str, torch.Tensor],
                 block_size: int, cache_dtype: str, tp_rank: int, tp_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Take vLLM's per-layer caches (``ValueError`` naming the fix for ones tierd cannot
        store), derive the slot format and try to reach the daemon (down is fine: see
        ``DaemonLink.connect``)."""
        self._config, self._clock = config, clock
        self.format: SlotFormat
        self.format, layout = slot_format(kv_caches, block_size, cache_dtype, tp_rank, tp_size)
        self._layers = {name: i for i, name in enumerate(self.format.layer_names)}
        self._kv_bytes = [byte_view(t) for t in kv_caches.values()]
        self._stacked = stack_layers(self._kv_bytes)
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
        self._held: list[tuple[int, str, str, list[bool], list[str]]] = []
        self._pending: _PendingSave | None = None
        self._reserved = False  # this step's Reserve was tried (it may have failed)
        # Committer: Commits, in order, off the engine thread, on a client of its own; it only
        # returns outcomes (``_harvest`` applies them on this thread).
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tierd-commit")
        self._commits: list[Future[tuple[int, int, grpc.RpcError | None]]] = []
        self._commit_client: TierdClient | None = None

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
        slot_bytes = self.format.slot_bytes
        for spec in meta.loads:
            good = self._load_one(spec)
            failed = spec.block_ids[good:]
            self._report.loaded[spec.req_id] = 1
            self._count("loaded_blocks", good)
            self._count("loaded_bytes", good * slot_bytes)
            if failed:
                self._errors.update(failed)
                self._report.failed.update(failed)
                self._failed.update(failed)
                self._poisoned.add(spec.req_id)
                self._count("failed_blocks", len(failed))

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
        arena, offset_of = link.arena_tensor, link.engine.geometry.offset
        offsets = [offset_of(s) for s in got.slot_ids[:len(spec.block_ids)]]
        good = _verified_prefix(link.arena_bytes, offsets, got.checksums, fmt.slot_bytes)
        load_blocks(arena, fmt, self._kv_bytes,
                    runs(spec.block_ids[:good], offsets[:good], fmt.slot_bytes), self._stacked)
        in_time = self._clock() < asked + got.seconds_left
        try:
            link.client.release(engine_id, got.lease_id,
                                corrupt_from=good if good < len(offsets) else None)
        except grpc.RpcError as exc:  # expired on the daemon's side: the copy is not trusted
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the lease ended, not the link
                link.failed(exc)
            in_time = False
        if not in_time:
            _log.warning("tierd: lease on %d blocks of %s expired before the copy finished; "
                         "vLLM recomputes them", len(offsets), spec.req_id)
            return 0
        if good < len(offsets):
            _log.warning("tierd: block %d of %s failed its checksum; vLLM recomputes from there",
                         good, spec.req_id)
        return good

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose planned load failed since the last call (then forgotten)."""
        errors, self._errors = self._errors, set()
        return errors

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
        return _PendingSave(reserved.lease_id, len(hashes), targets, block_runs,
                            [owners[i] for i, _ in targets])

    def finish_save(self) -> None:
        """Hand this step's Commit to the committer thread, or Abort the reservation if a layer
        is missing. Returns without waiting for the daemon; never raises for a daemon failure
        (outcomes are counted when they arrive)."""
        self._harvest()
        pending, self._pending, self._reserved = self._pending, None, False
        if pending is None or not self.link.up:
            return
        link = self.link
        if len(pending.layers_done) < len(self.format.layer_names):
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
                               owners))
            return
        self._submit_commit(link.engine.engine_id, pending.lease_id, written)

    def _submit_commit(self, engine_id: str, lease_id: str, written: list[bool]) -> None:
        if self._commit_client is None:
            config = self._config
            self._commit_client = TierdClient(socket_path=config.socket_path,
                                              address=config.address, token=config.token,
                                              timeout=config.timeout_seconds)
        self._commits.append(self._committer.submit(
            _commit, self._commit_client, engine_id, lease_id, written))

    def _release_held(self, step: int, bad: dict[str, int]) -> None:
        """Commit the held saves of steps up to ``step``, leaving out (as not written) the
        blocks of requests the verdict names for that step."""
        keep = []
        for held_step, engine_id, lease_id, written, owners in self._held:
            if held_step > step:
                keep.append((held_step, engine_id, lease_id, written, owners))
                continue
            spoiled = [i for i, r in enumerate(owners) if r in bad and held_step <= bad[r]]
            for i in spoiled:
                if written[i]:
                    written[i] = False
                    self._count("dropped_blocks", 1)
            self._submit_commit(engine_id, lease_id, written)
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
        self.flush()
        self._committer.shutdown()
        if self._commit_client is not None:
            self._commit_client.close()
        self.link.close()


def _commit(client: TierdClient, engine_id: str, lease_id: str,
            written: list[bool]) -> tuple[int, int, grpc.RpcError | None]:
    """Committer thread: publish a reservation, the daemon checksumming the written slots;
    (blocks stored, blocks lost, the error)."""
    try:
        return client.commit_written(engine_id, lease_id, written), 0, None
    except grpc.RpcError as exc:
        return 0, sum(written), exc


def _verified_prefix(arena: memoryview, offsets: list[int], checksums: list[int],
                     slot_bytes: int) -> int:
    """How many leading slots at ``offsets`` hold bytes whose checksum is ``checksums[i]``
    (read where they lie: the caller's lease pins them)."""
    for i, (offset, want) in enumerate(zip(offsets, checksums)):
        if block_checksum(arena[offset:offset + slot_bytes]) != want:
            return i
    return len(offsets)
