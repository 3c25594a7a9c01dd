"""``MemcpyTier``: the floor of any secondary tier under vLLM's native tiered offloading, for
``tierd bench vllm-tier``.

A tier that holds chunks in this process's memory (one pool of rows, kept and so already
touched across measurements, shared by every manager of the process) and does each job's copy
at once, on vLLM's scheduler thread, when it is submitted:
no daemon, no thread hand-off, no checksum. What the bench measures for it is vLLM's own cost
of a store or a load through its manager (lookups, RETRY/HIT, job bookkeeping) plus one memcpy,
the least any real tier can take; TierdTier's figures are read against it. Not for serving
(the copies block vLLM's scheduler, and nothing bounds the dict).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

CHUNKS: dict[OffloadKey, int] = {}
"""Every stored chunk's row in ``_POOL``, by key (``clear`` between measurements)."""
_POOL: list[torch.Tensor] = []


def _pool(rows: int, row_bytes: int) -> torch.Tensor:
    """The pool, grown to at least ``rows`` rows (zero-filled when made: no faults later)."""
    if not _POOL or _POOL[0].shape[0] < rows or _POOL[0].shape[1] != row_bytes:
        _POOL[:] = [torch.zeros(rows, row_bytes, dtype=torch.uint8)]
    return _POOL[0]


class MemcpyTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM's class (Any to mypy)
    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **settings: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._rows = torch.from_numpy(np.asarray(primary_kv_view).view(np.uint8))
        self._done: list[JobResult] = []

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in CHUNKS else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [k for k in job_metadata.keys if k not in CHUNKS]
        pool = _pool(len(CHUNKS) + len(keys), self._rows.shape[1])
        for key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids):
            if key not in CHUNKS:
                CHUNKS[key] = len(CHUNKS)
                pool[CHUNKS[key]].copy_(self._rows[int(chunk)])
        self._done.append(JobResult(job_metadata.job_id, True))

    def submit_load(self, job_metadata: TransferJob) -> None:
        pool = _POOL[0]
        for key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids):
            self._rows[int(chunk)].copy_(pool[CHUNKS[key]])
        self._done.append(JobResult(job_metadata.job_id, True))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self._done = self._done, []
        return done

    def drain_jobs(self) -> None:
        pass

    def shutdown(self) -> None:
        del self._rows  # vLLM unmaps its primary region once no view of it is left
