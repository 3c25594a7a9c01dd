"""The scheduler half of the vLLM adapter: which blocks to load and which to save, per step.

Metadata only (no KV bytes): one ``Lookup`` round trip per request being scheduled from the
waiting queue, nothing per running request. The plan for each step goes to the workers as a
``TierdConnectorMetadata``:

* loads: the blocks ``get_num_new_matched_tokens`` promised, in the vLLM block ids that
  ``update_state_after_alloc`` reports for those positions;
* saves: for every scheduled request, the full blocks this step completes (computed tokens +
  scheduled tokens), once each, never the loaded ones or the local prefix-cache hits.

Block hashes are vLLM's own ``request.block_hashes`` when the request has them (prefix caching
on; they must be ``sha256_cbor``/``xxhash_cbor`` for tierd's engine to share them), otherwise
this side hashes the request's tokens with ``tierd.hashing`` (same algorithm and seed as vLLM).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from .vllm_link import DaemonLink, TierdVllmConfig
from .vllm_meta import LoadSpec, SaveSpec, TierdConnectorMetadata
from tierd.hashing import BlockHasher
from tierd.types import BlockHash

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    """A request between ``update_state_after_alloc`` and ``request_finished``."""

    request: Any
    next_save: int                 # first block position not yet handed to workers to save
    block_ids: list[int] = field(default_factory=list)  # vLLM block id of each position


@dataclass(slots=True)
class _OwnChain:
    """Hashes this side computes for a request that carries none from vLLM."""

    hasher: BlockHasher
    fed: int = 0                   # tokens of the request fed to ``hasher``
    hashes: list[BlockHash] = field(default_factory=list)


class SchedulerSide:
    """State of the scheduler-side connector. Called from vLLM's scheduler thread only."""

    def __init__(self, config: TierdVllmConfig, link: DaemonLink) -> None:
        self._config, self._link = config, link
        self._block_size = link.layout.block_size
        self._tracked: dict[str, _Tracked] = {}
        self._own: dict[str, _OwnChain] = {}
        # Per request, the last answer of get_num_new_matched_tokens: (first block position
        # past the local hit, hashes of the tierd hits from there).
        self._matches: dict[str, tuple[int, list[BlockHash]]] = {}
        self._loads: list[LoadSpec] = []

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (the local prefix-cache hit, block-aligned) that
        tierd holds: full blocks only, and never the block holding the request's last token
        (vLLM must compute that one to sample). One Lookup; 0 if the daemon is unreachable.
        Pins nothing, so a later load may still miss (it is then reported as a load error)."""
        bs = self._block_size
        start = -(-num_computed_tokens // bs)
        self._matches[request.request_id] = (start, [])
        usable = (request.num_tokens - 1) // bs  # full blocks that leave the last token out
        if not self._config.load or usable <= start or not self._link.connect():
            return 0
        hashes = self.hashes(request)
        end = min(usable, len(hashes), start + self._link.engine.max_blocks_per_request)
        if end <= start:
            return 0
        try:
            tiers = self._link.client.lookup(self._link.engine.engine_id, hashes[start:end])
        except grpc.RpcError as exc:
            self._link.failed(exc)
            return 0
        self._matches[request.request_id] = (start, list(hashes[start:start + len(tiers)]))
        return (start + len(tiers)) * bs - num_computed_tokens if tiers else 0

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Start tracking ``request`` (again, after a preemption) and, if vLLM accepted
        ``num_external_tokens`` of our match, plan the load into the allocated blocks at those
        positions (``block_ids``: all of the request's blocks, first KV cache group)."""
        start, hits = self._matches.pop(request.request_id, (0, []))
        count = num_external_tokens // self._block_size
        assert count <= len(hits), (
            f"vLLM accepted {count} external blocks for {request.request_id}, more than the "
            f"{len(hits)} get_num_new_matched_tokens offered")
        self._tracked[request.request_id] = _Tracked(request, next_save=start + count)
        if count:
            self._loads.append(LoadSpec(request.request_id,
                                        list(block_ids[start:start + count]),
                                        [bytes(h) for h in hits[:count]]))

    def build(self, scheduler_output: Any) -> TierdConnectorMetadata:
        """This step's plan; forgets the loads it hands out. Reads ``scheduler_output`` only."""
        saves: list[SaveSpec] = []
        bs = self._block_size
        for req_id, new_ids, resumed in _scheduled(scheduler_output):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            if resumed:
                tracked.block_ids = list(new_ids or ())
            else:
                tracked.block_ids.extend(new_ids or ())
            request = tracked.request
            done = min(request.num_computed_tokens
                       + scheduler_output.num_scheduled_tokens[req_id], request.num_tokens)
            hashes = self.hashes(request)
            end = min(done // bs, len(hashes), len(tracked.block_ids))
            if self._config.save and end > tracked.next_save:
                saves.append(SaveSpec(req_id, tracked.block_ids[tracked.next_save:end],
                                      [bytes(h) for h in hashes[tracked.next_save:end]]))
            tracked.next_save = max(tracked.next_save, end)
        meta = TierdConnectorMetadata(loads=self._loads, saves=saves)
        self._loads = []
        return meta

    def finished(self, request: Any) -> None:
        """Forget ``request`` (finished or aborted)."""
        self._tracked.pop(request.request_id, None)
        self._own.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)

    def close(self) -> None:
        self._link.close()

    def hashes(self, request: Any) -> Sequence[BlockHash]:
        """The chain hash of each full block of the request's tokens so far."""
        theirs: Sequence[BlockHash] | None = getattr(request, "block_hashes", None)
        if theirs:
            return theirs
        chain = self._own.get(request.request_id)
        if chain is None:
            lora = getattr(request, "lora_request", None)
            chain = _OwnChain(BlockHasher(self._block_size, algo=self._config.hash_algo,
                                          seed=self._config.hash_seed,
                                          cache_salt=getattr(request, "cache_salt", None),
                                          lora_name=getattr(lora, "lora_name", None)))
            self._own[request.request_id] = chain
        tokens = request.all_token_ids
        if len(tokens) > chain.fed:
            chain.hashes += chain.hasher.append(tokens[chain.fed:])
            chain.fed = len(tokens)
        return chain.hashes


def _scheduled(scheduler_output: Any) -> Iterator[tuple[str, list[int] | None, bool]]:
    """(request id, block ids new this step (first KV cache group), resumed after preemption)
    for every scheduled request. Resumed requests list all their block ids. Accepts both
    ``resumed_req_ids`` (current vLLM) and ``resumed_from_preemption`` (older)."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, list(new.block_ids[0]), False
    cached = scheduler_output.scheduled_cached_reqs
    resumed_ids = getattr(cached, "resumed_req_ids", None)
    flags = getattr(cached, "resumed_from_preemption", None)
    for i, req_id in enumerate(cached.req_ids):
        groups = cached.new_block_ids[i]
        resumed = req_id in resumed_ids if resumed_ids is not None else bool(flags and flags[i])
        yield req_id, (list(groups[0]) if groups else None), resumed
