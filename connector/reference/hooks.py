"""The reference engine's extension point for moving KV blocks to and from outside tiers.

Modelled on vLLM's KV connector split, reduced to what a synchronous single-process engine needs.
The engine (``engine``) calls a ``KVTransferHooks`` at fixed points of a step;
``NullHooks`` does nothing and is what the engine runs with when tierd is absent. The tierd
daemon connector implements these hooks (load warm/cold blocks, write full blocks through).

Order of calls, per engine::

    register_kv_caches(kv_cache, model_id)        # once, at engine construction
    per step:
        for each request scheduled for the first time (or again after preemption):
            n = lookup(request)                   # after the hot-tier hit
            ok = load(request, block_ids, hashes) # only if n > 0 and blocks could be allocated
        ... forward pass ...
        save(block_ids, hashes)                   # blocks that became full and hashed this step
        request_finished(request)                 # for each request that finished this step
        step_end()

Optional: hooks with an ``attach_step_timings(take)`` method get the engine's
``take_step_timings`` at construction ((prompt tokens computed, seconds) of each forward pass:
its measured prefill speed; ``TierdHooks`` reports it to the daemon for the savings counters).

All calls come from the engine's thread, one at a time. Block ids index rows of the engine's
``tierd.gpu.layout.KVCache`` pool (and dimension 0 of its per-layer views). A block hash is the
``tierd.hashing`` chain hash of that block (the engine's ``hash_algo`` and seed, the request's
``cache_salt`` in block 0), so equal hashes mean equal KV for the same model and layout; a hook
scopes hashes by model/layout (``kv_cache.spec.layout_tag``) and tenant itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tierd.gpu import KVCache
from tierd.types import BlockHash

if TYPE_CHECKING:
    from tierd.connector.reference.engine import Request


class KVTransferHooks(Protocol):
    """What the engine calls to reach KV outside its own pool. Implement all methods."""

    def register_kv_caches(self, kv_cache: KVCache, model_id: str) -> None:
        """Receive the engine's pool once, before the first step, and keep the reference.
        ``model_id`` names the weights that compute its KV (``tierd.model_identity``): blocks
        are shared only with engines of the same model id.

        ``kv_cache.pool`` is ``[num_blocks, block_bytes]`` uint8: row ``b`` is block ``b`` of
        every layer, K and V (exactly one daemon slot); ``k_caches``/``v_caches`` are per-layer
        views of it in vLLM's original paged layout (``tierd.gpu.layout``), FP8 scales in
        ``k_scales``/``v_scales``. Move blocks with ``tierd.gpu.cache_ops.gather_blocks`` /
        ``scatter_blocks``. The tensors live as long as the engine; write them in place, never
        replace them."""
        ...

    def lookup(self, request: Request) -> int:
        """How many full blocks of ``request.block_hashes`` can be loaded from outside,
        counting from block ``request.num_computed_tokens // block_size`` (the end of the
        hot-tier hit) and stopping at the first block that cannot. 0 for none.

        Called when the request is scheduled with no blocks (first time, or after a preemption),
        and only with ``EngineConfig.enable_prefix_caching`` on.
        May block (one round trip per request, not per block). A promise, not a pin: ``load``
        may still fail. The engine clamps the answer so the last prompt token is computed."""
        ...

    def load(self, request: Request, block_ids: Sequence[int],
             block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Copy the external KV of ``block_hashes[i]`` into pool block ``block_ids[i]`` (freshly
        allocated, unhashed, owned by ``request``), in one batched transfer. Returns one flag
        per block: True only if that block's bytes are in place and verified.

        Blocks until the copies are done: the engine runs the forward pass that reads these
        blocks right after it returns. The engine keeps the leading run of True and recomputes
        the first False block and every block after it (wrong KV is worse than no KV), so a
        partial success is safe. Must not raise for an expected failure (daemon gone, lease
        expired, checksum mismatch): return False instead."""
        ...

    def save(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Blocks that became full and got a hash this step, after the forward pass wrote them
        (write-through). Their bytes are valid and stay unchanged until ``step_end`` returns
        (afterwards a block may be evicted and reused). Must not stall compute: copy out into
        staging memory now or in ``step_end``, and queue the slow part. Blocks loaded by
        ``load`` or hit in the hot tier are not passed again."""
        ...

    def request_finished(self, request: Request) -> None:
        """``request`` finished this step; its blocks are freed (still hittable until reused)
        once this returns. Release per-request state."""
        ...

    def step_end(self) -> None:
        """The step is over: the last point at which this step's ``save`` blocks are sure to
        hold their bytes. Flush batched work here; must not block on slow tiers."""
        ...


class NullHooks:
    """No outside tiers: nothing to load, nowhere to save. The engine's default."""

    def register_kv_caches(self, kv_cache: KVCache, model_id: str) -> None:
        pass

    def lookup(self, request: Request) -> int:
        return 0

    def load(self, request: Request, block_ids: Sequence[int],
             block_hashes: Sequence[BlockHash]) -> list[bool]:
        return [False] * len(block_ids)

    def save(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        pass

    def request_finished(self, request: Request) -> None:
        pass

    def step_end(self) -> None:
        pass
