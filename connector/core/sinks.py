"""``PoolRows``: the load ``Sink`` of an engine whose KV blocks are rows of one pool.

A pool is a 2-D uint8 tensor ``[num_blocks, block_bytes]`` whose row ``b`` is block ``b`` of
every layer (the reference engine's ``KVCache.pool``; any engine can pass such a view), on the
host or a GPU. The sinks of vLLM's per-layer views and of device transfers are in
``tierd.connector.vllm.connector.sinks``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierd.connector.core.arena_slots import ArenaSlots, allocate_staging, load_blocks
from tierd.connector.native import verified_copy


class PoolRows:
    """Host pool: each slot checked while it is copied into its row, in one pass
    (``native.verified_copy``; verify, then copy, without the native helper). Device pool:
    arena -> private host staging -> checks there -> one scatter into the rows, in chunks of
    ``staging_rows``. Synchronous (``settle`` has nothing to wait for)."""

    def __init__(self, pool: torch.Tensor, staging_rows: int) -> None:
        """Allocate the staging (zero-filled now, so no page faults on the first load) and, for
        a host pool, build the one-pass helper now rather than on the first load."""
        if pool.dtype != torch.uint8 or pool.dim() != 2:
            raise ValueError("the pool must be a uint8 [num_blocks, block_bytes] tensor")
        self.pool = pool
        self.staging = allocate_staging(max(1, staging_rows), pool.shape[1])
        if pool.device.type == "cpu":
            verified_copy.available()

    def place(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
              block_ids: Sequence[int]) -> int:
        return load_blocks(slots, slot_ids, checksums, self.pool, block_ids, self.staging)

    def settle(self) -> None:
        pass
