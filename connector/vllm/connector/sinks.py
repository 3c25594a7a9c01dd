"""The load ``Sink``s (``tierd.connector.core.load``) of vLLM's KV tensors.

``LayerViews``: host KV, vLLM's per-layer views. Where the layers share one buffer and the
native helper is built, each slot is checked while it is copied into the blocks of every layer,
in one pass (``native.verified_copy``: the DRAM load ``tierd bench vllm`` measures); otherwise
every slot is verified where it lies, then one strided copy per run of verified blocks. Its
``store`` is the way back (a step's saved blocks, every layer, into their slots): one native
call, or one strided copy per layer and run.

``DeviceLoads``: KV on a GPU, through ``cuda_copy.DeviceTransfer`` over the arena mapping
(registered as pinned memory): the slots are verified where they lie, then the copies are
queued on a side stream; ``settle`` waits until the DMAs have read the slots (the leases may go
only then). On CPU tensors the same class runs the device path's logic synchronously (tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierd.connector.core.arena_slots import ArenaSlots
from tierd.connector.native import verified_copy
from tierd.connector.native.verified_copy import BlockRows

from .cuda_copy import DeviceTransfer
from .kv_tensors import Run, SlotFormat, load_blocks, runs, save_layer, stack_layers

_BYTES_PER_THREAD = 4 << 20
"""A store takes one more copying thread per this many bytes: the helper starts its threads per
call, and a start costs about as much as one core copying a MiB."""


class LayerViews:
    """Host KV (``kv_tensors.byte_view`` per layer, ``fmt``'s order); synchronous.
    ``threads``: copying threads of the one-pass copy (None: ``torch.get_num_threads()``)."""

    def __init__(self, fmt: SlotFormat, kv_bytes: Sequence[torch.Tensor],
                 threads: int | None = None) -> None:
        """Stack the layers (one buffer: one pass) and build the native helper now rather than
        on the first load."""
        self.format, self.kv_bytes, self.threads = fmt, list(kv_bytes), threads
        self.stacked = stack_layers(self.kv_bytes)
        self.rows = (BlockRows.of(self.stacked) if self.stacked is not None
                     and not self.stacked.is_cuda else None)
        if self.rows is not None:
            verified_copy.available()

    def with_threads(self, threads: int | None) -> LayerViews:
        """The same views, copied by ``threads`` threads (a streaming thread uses one core)."""
        twin = LayerViews.__new__(LayerViews)
        twin.format, twin.kv_bytes, twin.stacked, twin.rows = (self.format, self.kv_bytes,
                                                               self.stacked, self.rows)
        twin.threads = threads
        return twin

    def place(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
              block_ids: Sequence[int]) -> int:
        if self.rows is not None:
            good = slots.load_verified(slot_ids, checksums, self.rows, block_ids,
                                       threads=self.threads)
            if good is not None:
                return good
        good = slots.verified(slot_ids, checksums)
        offsets = [slots.geometry.offset(s) for s in slot_ids[:good]]
        load_blocks(slots.arena, self.format, self.kv_bytes,
                    runs(block_ids[:good], offsets, self.format.slot_bytes), self.stacked)
        return good

    def settle(self) -> None:
        pass

    def store(self, arena: torch.Tensor, block_runs: Sequence[Run]) -> None:
        """Copy every layer of each run's vLLM blocks into its slots in ``arena`` (the step's
        KV is complete: called once the forward pass is done). One native call, the GIL
        released, where the layers share a buffer and the helper is built; else one strided
        copy per layer and run. Blocks until the bytes are in the arena."""
        if self.rows is not None:
            ids = [r.block_id + i for r in block_runs for i in range(r.count)]
            base, size = arena.data_ptr(), self.format.slot_bytes
            addresses = [base + r.offset + i * size for r in block_runs for i in range(r.count)]
            most = torch.get_num_threads() if self.threads is None else self.threads
            threads = min(most, 1 + len(ids) * self.format.slot_bytes // _BYTES_PER_THREAD)
            if verified_copy.store_rows(self.rows, addresses, ids, threads=threads):
                return
        for layer, kv_bytes in enumerate(self.kv_bytes):
            save_layer(arena, self.format, layer, kv_bytes, block_runs)


class DeviceLoads:
    """KV on a device, through ``transfer`` (one arena mapping); asynchronous: ``place``
    verifies and queues, ``settle`` waits for the reads of everything queued."""

    def __init__(self, transfer: DeviceTransfer) -> None:
        self.transfer = transfer
        self.queued = False  # a load was queued since the last settle

    def place(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
              block_ids: Sequence[int]) -> int:
        good = slots.verified(slot_ids, checksums)  # where they lie: the lease pins them
        offsets = [slots.geometry.offset(s) for s in slot_ids[:good]]
        fmt = self.transfer.format
        self.transfer.start_load(runs(block_ids[:good], offsets, fmt.slot_bytes))
        self.queued = True
        return good

    def settle(self) -> None:
        if self.queued:
            self.transfer.wait_reads()
            self.queued = False
