"""The worker half of the vLLM adapter: loads before the forward pass, saves during and after it.

Per step, with the metadata the scheduler half built:

* ``load`` (vLLM's ``start_load_kv``): per request, one Acquire; copy the leased slots into host
  staging memory, Release, verify each block's checksum on the private copy, then write the
  leading run of verified blocks into the KV tensors. Synchronous: the forward pass that reads
  them starts after it returns. Every block not written (a miss since the lookup, a checksum
  mismatch, an expired lease, the daemon gone) and every block after it in that request is
  reported by ``take_load_errors`` so vLLM recomputes from there; a bad block is never written.
* ``save_layer`` (vLLM's ``save_kv_layer``): on the first layer, one Reserve for all blocks the
  step completes; each layer's K/V is copied into the reserved slots as soon as vLLM hands it over.
* ``finish_save`` (``wait_for_save``): checksums of the written slots and one Commit, so the
  blocks become visible only whole. If some layer never arrived, Abort instead.

Best effort: a save that fails is a future miss, never an error to vLLM; nothing holds vLLM's
blocks past the step (``get_finished`` has nothing to report).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
import torch

from .vllm_copy import (SlotFormat, byte_view, read_slots, scatter_slots,
                                       slot_checksum, slot_format, verified_prefix, write_layer)
from .vllm_link import DaemonLink, TierdVllmConfig
from .vllm_meta import LoadSpec, SaveSpec
from tierd.types import BlockHash

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerCounters:
    """Totals since start, for logs and tests."""

    loaded_blocks: int = 0        # written into vLLM's cache, verified
    failed_blocks: int = 0        # planned loads reported back for recompute
    saved_blocks: int = 0         # committed to the daemon
    skipped_blocks: int = 0       # planned saves the daemon already held, or had no room for
    dropped_blocks: int = 0       # planned saves lost (daemon down, a layer missing, a failed call)


@dataclass(slots=True)
class _PendingSave:
    """One step's reservation while the layers are being copied into it."""

    lease_id: str
    num_hashes: int
    targets: list[tuple[int, int, int]]        # (index in the reservation, vLLM block, offset)
    layers_done: set[int] = field(default_factory=set)


class WorkerSide:
    """State of one worker's connector. Called from the worker's model-runner thread only."""

    def __init__(self, config: TierdVllmConfig, kv_caches: Mapping[str, torch.Tensor],
                 cache_dtype: str, tp_rank: int, tp_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Take vLLM's per-layer caches, derive the slot format and try to reach the daemon
        (down is fine: see ``DaemonLink.connect``)."""
        self._config, self._clock = config, clock
        self.format: SlotFormat
        self.format, layout = slot_format(kv_caches, config.kv_cache_layout, cache_dtype,
                                          tp_rank, tp_size)
        self._layers = {name: i for i, name in enumerate(self.format.layer_names)}
        self._kv_bytes = [byte_view(t, config.kv_cache_layout) for t in kv_caches.values()]
        self.link = DaemonLink(config, layout, f"{config.engine_name}-tp{tp_rank}", attach=True,
                               clock=clock)
        self.link.connect()
        self.counters = WorkerCounters()
        self._errors: set[int] = set()
        self._pending: _PendingSave | None = None
        self._reserved = False  # this step's Reserve was tried (it may have failed)

    # -- loads -------------------------------------------------------------------------------

    def load(self, loads: list[LoadSpec]) -> None:
        """Fill every planned block or report it (see the module doc). Blocks until done."""
        for spec in loads:
            good = self._load_one(spec)
            failed = spec.block_ids[good:]
            self._errors.update(failed)
            self.counters.loaded_blocks += good
            self.counters.failed_blocks += len(failed)

    def _load_one(self, spec: LoadSpec) -> int:
        """Load ``spec``'s leading blocks; returns how many were written."""
        if not spec.block_ids or not self.link.connect():
            return 0
        link = self.link
        engine_id, slot_bytes = link.engine.engine_id, self.format.slot_bytes
        asked = self._clock()
        try:
            got = link.client.acquire(engine_id, [BlockHash(h) for h in spec.block_hashes])
        except grpc.RpcError as exc:
            link.failed(exc)
            return 0
        offsets = [link.engine.geometry.offset(s) for s in got.slot_ids[:len(spec.block_ids)]]
        staged = read_slots(link.arena_tensor, offsets, slot_bytes)
        in_time = self._clock() < asked + got.seconds_left
        try:
            link.client.release(engine_id, got.lease_id)
        except grpc.RpcError as exc:  # expired on the daemon's side: the copy is not trusted
            link.failed(exc)
            in_time = False
        if not in_time:
            _log.warning("tierd: lease on %d blocks of %s expired before the copy finished; "
                         "vLLM recomputes them", len(offsets), spec.req_id)
            return 0
        good = verified_prefix(staged, got.checksums[:len(offsets)])
        if good < len(offsets):
            _log.warning("tierd: block %d of %s failed its checksum; vLLM recomputes from there",
                         good, spec.req_id)
        scatter_slots(staged, self.format, self._kv_bytes, spec.block_ids[:good])
        return good

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose planned load failed since the last call (then forgotten)."""
        errors, self._errors = self._errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------------

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, saves: list[SaveSpec]) -> None:
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
        kv_bytes = byte_view(kv_layer, self._config.kv_cache_layout)
        write_layer(self.link.arena_tensor, [t[2] for t in pending.targets], self.format, layer,
                    kv_bytes, [t[1] for t in pending.targets])
        pending.layers_done.add(layer)

    def _reserve(self, saves: list[SaveSpec]) -> _PendingSave | None:
        block_ids = [b for spec in saves for b in spec.block_ids]
        if not self.link.connect():
            self.counters.dropped_blocks += len(block_ids)
            return None
        link = self.link
        limit = link.engine.max_blocks_per_request
        hashes = [BlockHash(h) for spec in saves for h in spec.block_hashes][:limit]
        self.counters.dropped_blocks += len(block_ids) - len(hashes)
        try:
            reserved = link.client.reserve(link.engine.engine_id, hashes)
        except grpc.RpcError as exc:
            link.failed(exc)
            self.counters.dropped_blocks += len(hashes)
            return None
        geometry = link.engine.geometry
        targets = [(i, block_ids[i], geometry.offset(slot))
                   for i, slot in enumerate(reserved.slot_ids) if slot is not None]
        self.counters.skipped_blocks += len(hashes) - len(targets)
        return _PendingSave(reserved.lease_id, len(hashes), targets)

    def finish_save(self) -> None:
        """Publish this step's reservation (Commit with checksums), or Abort it if a layer is
        missing. Blocks for one round trip; never raises for a daemon failure."""
        pending, self._pending, self._reserved = self._pending, None, False
        if pending is None or not self.link.up:
            return
        link, slot_bytes = self.link, self.format.slot_bytes
        complete = len(pending.layers_done) == len(self.format.layer_names)
        try:
            if not complete:
                link.client.abort(link.engine.engine_id, pending.lease_id)
                self.counters.dropped_blocks += len(pending.targets)
                return
            checksums: list[int | None] = [None] * pending.num_hashes
            for index, _, offset in pending.targets:
                checksums[index] = slot_checksum(link.arena_tensor, offset, slot_bytes)
            self.counters.saved_blocks += link.client.commit(link.engine.engine_id,
                                                             pending.lease_id, checksums)
        except grpc.RpcError as exc:
            link.failed(exc)
            self.counters.dropped_blocks += len(pending.targets)

    def close(self) -> None:
        self.link.close()

