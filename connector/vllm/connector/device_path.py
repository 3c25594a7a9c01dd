"""``DevicePath``: a CUDA worker's copies through ``cuda_copy.DeviceTransfer``.

The transfer works over one arena mapping, registered as pinned memory
(``register_host_memory``) when the link attaches it; a link that re-registers (a new arena
mapping) gets a new transfer, the old one drained and unpinned first. Loads queued in a step
(``core.load.start_load`` through the ``DeviceLoads`` sink) stay open, their leases held, until
``finish`` (vLLM's ``wait_for_save`` or ``get_block_ids_with_load_errors``, whichever comes
first) has waited for their DMAs' reads and released the leases.

In the worker: a load is queued on a side stream after the checksums and ``start_load_kv``
returns; ``wait_layer`` (``wait_for_layer_load``) makes the forward pass's stream wait for each
layer; at ``finish_save`` (or ``take_load_errors``, whichever vLLM calls first), once the DMAs
have read the slots, the worker's own leases are released, and a lease found expired then makes
its blocks load errors and drops the step's saves. A save gathers each layer on the device;
``finish_save`` queues the D2H copies, and the Commit goes out once they have landed (at a
later step's ``begin``, or from the committer thread): neither the host nor the next step waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from tierd.connector.core.lease import Clock, Release
from tierd.connector.core.link import DaemonLink
from tierd.connector.core.load import LoadResult, OpenLoad, finish_load
from tierd.connector.core.prefill_speed import DeviceEvent

from .cuda_copy import DeviceTransfer, register_host_memory, unregister_host_memory
from .kv_tensors import SlotFormat
from .sinks import DeviceLoads


@dataclass(frozen=True, slots=True)
class DeviceLoad:
    """A load queued on the side stream: its lease is released by ``DevicePath.finish``."""

    req_id: str
    release: Release            # ends its lease (the session's Release, or none under a pin)
    load: OpenLoad
    sink: DeviceLoads           # the transfer that queued it


class DevicePath:
    """The device copies of one worker (one thread: the model runner's)."""

    def __init__(self, fmt: SlotFormat, kv_bytes: list[torch.Tensor], enabled: bool) -> None:
        """``enabled``: copy through a ``DeviceTransfer`` (KV on CUDA; True on CPU tensors runs
        the same logic synchronously, which is how the CPU suite covers it)."""
        self.enabled = enabled
        self._fmt, self._kv_bytes = fmt, kv_bytes
        self._sink: DeviceLoads | None = None
        self._open: list[DeviceLoad] = []
        self._waits: DeviceLoads | None = None  # the sink holding this step's loads

    def sink(self, link: DaemonLink) -> DeviceLoads | None:
        """The sink over the link's current arena mapping, made (the mapping registered as
        pinned memory) at the first call after each attach; None when disabled or while the
        link is down. Blocks while a mapping is registered."""
        if not self.enabled or not link.up:
            return None
        arena = link.arena_tensor
        if self._sink is None or self._sink.transfer.arena is not arena:
            self.close()
            self._sink = DeviceLoads(DeviceTransfer(arena, self._fmt, self._kv_bytes,
                                                    pinned=register_host_memory(arena)))
        return self._sink

    def opened(self, req_id: str, release: Release, load: OpenLoad, sink: DeviceLoads) -> None:
        """Keep a load ``sink`` queued (or, a miss, did not need to) until ``finish``, which
        ends its lease with ``release``."""
        self._open.append(DeviceLoad(req_id, release, load, sink))
        if sink.queued:
            self._waits = sink

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until this step's loads of ``layer`` are in place."""
        if self._waits is not None:
            self._waits.transfer.wait_layer(layer)

    def finish(self, clock: Clock) -> list[tuple[DeviceLoad, LoadResult]]:
        """Wait for the reads of this step's loads, release their leases and apply the
        lease-outlives-copy rule (``core.load.finish_load``); each load with its result."""
        loads, self._open, self._waits = self._open, [], None
        return [(load, finish_load(load.load, load.sink, load.release, clock))
                for load in loads]

    def close(self) -> None:
        """Wait for every queued device copy, then unpin the mapping they used."""
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.transfer.close()
            if sink.transfer.pinned:
                unregister_host_memory(sink.transfer.arena)


def cuda_event() -> DeviceEvent:
    """A timing event on the current CUDA stream (``PrefillSpeed`` times the forward pass)."""
    return cast(DeviceEvent, torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
