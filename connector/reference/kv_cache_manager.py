"""Per-request block tables over a ``BlockPool``: prefix hits, allocation, free, fork and COW.

Modelled on vLLM v1's ``KVCacheManager`` / ``single_type_kv_cache_manager`` for one full-attention
group. Metadata only: the worker does every copy and write this module reports.

A scheduler step for one request::

    hit = mgr.get_computed_blocks(hashes, num_tokens)        # new requests only
    new = mgr.allocate_slots(rid, num_tokens, hit, hashes)   # None: preempt or wait
    copies = mgr.take_copies()         # worker: copy src -> dst before the forward pass
    slots = mgr.slot_mapping(rid, range(first_new, num_tokens))
    stored = mgr.take_newly_cached()   # connector: write these through once computed

``block_hashes`` is always the request's whole chain for its full blocks so far (it grows during
decode); the manager caches each block the first time it is both full and has a hash.

Connector paths, explicit on purpose:

* **Write-through.** Blocks that ``allocate_slots`` caches are queued for ``take_newly_cached()``
  as ``CachedBlock(request_id, index, block_id, block_hash)``. They are cached when allocated, so
  their KV exists only after the forward pass of that step: copy them out after it.
* **Loading a prefix from a lower tier.** Allocate with ``cache=False`` (the blocks stay unhashed,
  so nobody can hit data not yet there), copy the data in, then call ``mark_cached(rid, hashes,
  num_loaded_tokens)``. Keep passing ``cache=False`` until the load completed; if it failed, free
  the request (or recompute) and nothing wrong was ever hittable. ``mark_cached`` returns what it
  cached and does not queue it for write-through (it came from that tier).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

from tierd.connector.reference.block_pool import BlockPool, KVCacheBlock
from tierd.events import KVEvent
from tierd.types import BlockHash


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix hit: ``blocks`` hold the first ``num_tokens`` tokens. Not yet referenced."""

    blocks: tuple[KVCacheBlock, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy-on-write: the worker copies block ``src`` into ``dst`` before writing ``dst``."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class WriteSlot:
    """Where a position may now be written, and the copy the worker must do first (if any)."""

    slot: int
    copy: BlockCopy | None


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """Block ``index`` of ``request_id`` (tokens ``index*bs .. index*bs+bs-1``) got a hash."""

    request_id: str
    index: int
    block_id: int
    block_hash: BlockHash


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters in tokens, vLLM's ``prefix_cache_queries`` / ``_hits``."""

    queries: int = 0
    hits: int = 0


@dataclass(slots=True)
class _Request:
    blocks: list[KVCacheBlock]
    """The block table. Covers exactly ceil(num_tokens / block_size) blocks."""
    num_tokens: int
    """Tokens the table holds (written, or being written this step)."""
    num_cached: int
    """blocks[:num_cached] all have hashes; caching resumes from here."""


class KVCacheManager:
    """Block tables for requests (ids are ``str``), on a pool of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = self.pool.block_size
        self.stats = PrefixCacheStats()
        self._requests: dict[str, _Request] = {}
        self._newly_cached: list[CachedBlock] = []
        self._copies: list[BlockCopy] = []

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash],
                            num_tokens: int) -> ComputedBlocks:
        """Longest cached prefix of a new request of ``num_tokens`` tokens: stops at the first
        miss and never covers the last token (it must be computed to get logits), so at most
        ``(num_tokens - 1) // block_size`` blocks. Counts ``num_tokens`` queries and the hit
        tokens. Takes no reference: pass the result to ``allocate_slots`` before any other call."""
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max(num_tokens - 1, 0) // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += num_tokens
        self.stats.hits += len(hits) * self.block_size
        return ComputedBlocks(tuple(hits), len(hits) * self.block_size)

    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed: ComputedBlocks | None = None,
                       block_hashes: Sequence[BlockHash] = (), *,
                       cache: bool = True) -> list[KVCacheBlock] | None:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens in all (a new request starts
        with the ``computed`` prefix). Returns the blocks appended, or None with no effect at all
        when the pool has too few free blocks.

        Effects: references the computed blocks (they stop being evictable); pops new blocks
        (evicting cached ones from the queue head); if the first position written this step lies
        in a block shared by a fork, moves the request to a private copy (see ``take_copies``);
        with ``cache`` caches every block now full with a known hash (see ``take_newly_cached``).
        """
        req = self._requests.get(request_id)
        if req is not None and computed is not None and computed.blocks:
            raise ValueError(f"request {request_id!r} already has blocks: pass computed blocks "
                             "only on its first allocate_slots call")
        hit = computed.blocks if computed is not None and req is None else ()
        current = req.num_tokens if req is not None else len(hit) * self.block_size
        if num_tokens < current:
            raise ValueError(f"request {request_id!r} holds {current} tokens, asked for "
                             f"{num_tokens}: num_tokens is the running total and cannot shrink")
        num_blocks = len(req.blocks) if req is not None else len(hit)
        num_new = -(-num_tokens // self.block_size) - num_blocks
        cow = (req is not None and num_tokens > current
               and self._shared_block(req, current) is not None)
        revived = sum(1 for block in hit if block.ref_cnt == 0)
        if num_new + cow + revived > self.pool.num_free_blocks:
            return None
        if req is None:
            self.pool.touch(hit)
            req = self._requests[request_id] = _Request(list(hit), current, len(hit))
        elif cow:
            self._copies.append(self._make_private(req, current))
        new_blocks = self.pool.get_new_blocks(num_new)
        assert new_blocks is not None, "free-block count checked above"
        req.blocks += new_blocks
        req.num_tokens = num_tokens
        if cache:
            self._newly_cached += self._cache(request_id, req, block_hashes, num_tokens)
        return new_blocks

    def mark_cached(self, request_id: str, block_hashes: Sequence[BlockHash],
                    num_tokens: int) -> list[CachedBlock]:
        """Declare that the request's blocks up to ``num_tokens`` now hold valid data (e.g. loaded
        from DRAM/SSD into blocks allocated with ``cache=False``): every such full block with a
        hash is cached. Returns those blocks; not queued for ``take_newly_cached``."""
        req = self._get(request_id)
        if num_tokens > req.num_tokens:
            raise ValueError(f"request {request_id!r} holds {req.num_tokens} tokens, cannot mark "
                             f"{num_tokens}: allocate_slots first")
        return self._cache(request_id, req, block_hashes, num_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (so a shared prompt's root outlives
        its leaves in the LRU). Content and hashes stay: they are hits until reused."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}: it was already freed or never "
                             "allocated; free each request once, after allocate_slots")
        self.pool.free_blocks(reversed(req.blocks))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's table (parallel sampling n>1, beam): every block gains
        one reference, nothing is copied. The first write into a shared partial block makes the
        writer's private copy (``allocate_slots`` / ``prepare_write``)."""
        parent = self._get(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists: fork into a new id")
        self.pool.touch(parent.blocks)
        self._requests[child_id] = _Request(list(parent.blocks), parent.num_tokens,
                                            parent.num_cached)

    def prepare_write(self, request_id: str, position: int) -> WriteSlot | None:
        """Make ``position`` writable for the request: if its block is shared through a fork
        (ref > 1, no hash), allocate a private block, point the table at it and return the copy
        the worker must do first. None (no effect) if no block is free. Use this for writes that
        ``allocate_slots`` did not plan (it handles the normal next-token case itself); the copy
        is returned here only, not queued for ``take_copies``."""
        req = self._get(request_id)
        self._check_position(request_id, req, position)
        copy = None
        if self._shared_block(req, position) is not None:
            if self.pool.num_free_blocks == 0:
                return None
            copy = self._make_private(req, position)
        return WriteSlot(self._slot(req, position), copy)

    def slot_mapping(self, request_id: str, positions: Iterable[int]) -> list[int]:
        """Absolute slot of each position: ``table[p // bs] * bs + p % bs``. Raises if a position
        is past the table, or lies in a fork-shared block (writing it would corrupt the others)."""
        req = self._get(request_id)
        slots = []
        for position in positions:
            self._check_position(request_id, req, position)
            if self._shared_block(req, position) is not None:
                raise ValueError(f"request {request_id!r} position {position} is in a block shared "
                                 "by a fork: call prepare_write first")
            slots.append(self._slot(req, position))
        return slots

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids, in logical order."""
        return [block.block_id for block in self._get(request_id).blocks]

    def take_copies(self) -> list[BlockCopy]:
        """Copy-on-write copies made by ``allocate_slots`` since the last call, in order. The
        worker performs them before the step's forward pass."""
        copies, self._copies = self._copies, []
        return copies

    def take_newly_cached(self) -> list[CachedBlock]:
        """Blocks cached by ``allocate_slots`` since the last call, in order: write-through."""
        cached, self._newly_cached = self._newly_cached, []
        return cached

    def take_events(self) -> list[KVEvent]:
        """The pool's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (no effect) while any request holds blocks."""
        return self.pool.reset()

    def check_integrity(self) -> None:
        """Assert the pool is consistent and every ref count equals the tables holding it."""
        self.pool.check_integrity()
        holders = [0] * len(self.pool.blocks)
        for request_id, req in self._requests.items():
            assert len(req.blocks) == -(-req.num_tokens // self.block_size), (
                f"request {request_id!r}: {len(req.blocks)} blocks for {req.num_tokens} tokens")
            assert len({b.block_id for b in req.blocks}) == len(req.blocks), (
                f"request {request_id!r} holds a block twice")
            assert all(b.block_hash is not None for b in req.blocks[:req.num_cached]), (
                f"request {request_id!r}: a block before num_cached has no hash")
            for block in req.blocks:
                holders[block.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref {block.ref_cnt}, held by {holders[block.block_id]}")

    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}: call allocate_slots first "
                             "(or it was already freed)")
        return req

    def _check_position(self, request_id: str, req: _Request, position: int) -> None:
        if not 0 <= position < len(req.blocks) * self.block_size:
            raise ValueError(f"request {request_id!r} position {position} is outside its "
                             f"{len(req.blocks)} blocks: allocate_slots for it first")

    def _slot(self, req: _Request, position: int) -> int:
        block = req.blocks[position // self.block_size]
        return block.block_id * self.block_size + position % self.block_size

    def _shared_block(self, req: _Request, position: int) -> KVCacheBlock | None:
        """The fork-shared block holding ``position``, if any. Only unhashed blocks count: a
        hashed block's content is final, and other holders of it are prefix hits."""
        index = position // self.block_size
        if index >= len(req.blocks):
            return None
        block = req.blocks[index]
        return block if block.ref_cnt > 1 and block.block_hash is None else None

    def _make_private(self, req: _Request, position: int) -> BlockCopy:
        index = position // self.block_size
        src = req.blocks[index]
        new = self.pool.get_new_blocks(1)
        assert new is not None, "caller checked a block is free"
        req.blocks[index] = new[0]
        self.pool.free_blocks([src])
        assert src.ref_cnt > 0, "a fork-shared block keeps its other holders"
        return BlockCopy(src.block_id, new[0].block_id)

    def _cache(self, request_id: str, req: _Request, block_hashes: Sequence[BlockHash],
               num_tokens: int) -> list[CachedBlock]:
        """Cache blocks ``num_cached .. end`` that are full and have a hash; one event per run."""
        end = min(num_tokens // self.block_size, len(block_hashes))
        todo = []
        for index in range(req.num_cached, end):
            block_hash = req.blocks[index].block_hash
            # Already hashed: a fork sibling holding the same block cached it first.
            assert block_hash in (None, block_hashes[index]), "one block, two hashes"
            if block_hash is None:
                todo.append(index)
        for _, group in groupby(enumerate(todo), key=lambda pair: pair[1] - pair[0]):
            run = [index for _, index in group]
            parent = block_hashes[run[0] - 1] if run[0] else None
            self.pool.cache_full_blocks([req.blocks[i] for i in run],
                                        [block_hashes[i] for i in run], parent)
        req.num_cached = max(req.num_cached, end)
        return [CachedBlock(request_id, i, req.blocks[i].block_id, block_hashes[i]) for i in todo]
