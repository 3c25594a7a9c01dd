"""The engine's hot (HBM) block pool: fixed block objects, an LRU free queue, the prefix-cache map.

Modelled on vLLM v1 (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``). A block is in one of
four states, and ``ref_cnt`` and ``block_hash`` are independent:

====== ========== ============================================= ==============
ref    hash       meaning                                       in free queue
====== ========== ============================================= ==============
> 0    set        in use and shareable (a full, cached block)   no
> 0    None       in use, being written (partial, or not cached) no
0      set        unused, content kept: still a prefix hit      yes (back)
0      None       empty (never used, or evicted)                yes (front)
====== ========== ============================================= ==============

Freeing never clears content. Eviction happens only when a hashed block is popped from the free
queue for reuse: its hash leaves the map then. Unhashed blocks are freed to the front of the queue
and hashed ones to the back, so the queue always reads ``[empty ...][evictable, oldest first ...]``
and an empty block is always reused before any cached one.

Everything here is metadata: no KV bytes are touched. Nothing blocks; nothing is thread-safe
(the scheduler owns the pool).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tierd.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog, KVEvent
from tierd.types import BlockHash

BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)
"""Block sizes (tokens per block) the pool accepts; 16 is the default, as in vLLM."""


def check_block_size(block_size: int) -> int:
    """Return ``block_size`` if supported, else raise ``ValueError`` naming the choices."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size must be a power of two in {', '.join(map(str, BLOCK_SIZES))} "
            f"(got {block_size}); pass one of those, 16 unless you have measured otherwise"
        )
    return block_size


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical block. Compared by identity; links are the free queue's."""

    block_id: int
    ref_cnt: int = 0
    """How many block tables hold this block. 0 iff the block is in the free queue."""
    block_hash: BlockHash | None = None
    """Hash of the full block's content, None while it is not cached. Set iff in the map."""
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    """Free-queue neighbours; both None iff the block is not in the queue."""
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Intrusive doubly-linked list of free blocks with head/tail sentinels.

    Head = next to be reused (least recently freed), tail = most recently freed. popleft, append,
    appendleft and remove (from the middle, on a prefix hit) are O(1) and allocate nothing;
    prepend_n is O(n). The two sentinels have ``block_id == -1`` and never leave this object.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head to tail. Do not mutate the queue while iterating."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None, "free queue is broken: a link is None before the tail"
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. The caller checks ``len`` first."""
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft on an empty free queue"
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Insert ``block`` at the tail (reused last)."""
        assert self._tail.prev_free is not None
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Insert ``block`` at the head (reused first)."""
        assert self._head.next_free is not None
        self._link(block, self._head, self._head.next_free)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Insert ``blocks`` at the head as one run in the given order: ``blocks[0]`` is reused
        first (vLLM's ``prepend_n``; not ``appendleft`` one by one, which would reverse them)."""
        for block in reversed(blocks):
            self.appendleft(block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, (
            f"block {block.block_id} is already in the free queue"
        )
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self.num_free_blocks += 1


class BlockPool:
    """``num_blocks`` blocks created once, the free queue, and the hash -> blocks map.

    The map allows several blocks per hash (two requests that computed the same block before
    either was cached; a fully cached prompt whose last block is recomputed). Events go to
    ``take_events()`` with ``tier="hbm"``: ``BlockStored`` for every caching call (consumers treat
    it as idempotent), one ``BlockRemoved`` for every evicted block, even when another block still
    holds its hash (as vLLM 0.33 does: an event consumer may drop a hash that is still a hit
    here, a missed hint, never wrong KV), and ``AllBlocksCleared`` on ``reset()``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1 (got {num_blocks}); size the pool "
                             "with `tierd plan` and pass its block count")
        self.block_size = check_block_size(block_size)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        """hash -> {block_id: block}; a hash is a key iff at least one block holds it."""
        self.num_evictions = 0
        self._events = EventLog()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out (empty plus evictable)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block holding ``block_hash`` (the first cached), or None on a miss. No effects."""
        blocks = self.cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock] | None:
        """Pop ``n`` blocks from the queue head with ``ref_cnt = 1``, or None (and no effect) if
        fewer are free. A popped hashed block is evicted: it leaves the map, loses its hash."""
        if n > len(self.free_queue):
            return None
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix hit, a fork). A block going from 0 to 1
        leaves the free queue, so it can no longer be evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; ``ordered_blocks`` is in eviction order, first
        evicted first (callers pass a request's blocks in reverse, so its deepest block goes
        first). Blocks reaching 0 keep their content and hash: the unhashed ones go to the queue
        front as one run in the given order, the hashed ones to the back in the given order, as
        vLLM 0.33's ``free_blocks`` does (``prepend_n`` then ``append_n``)."""
        unhashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed with ref_cnt 0"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    self.free_queue.append(block)
        self.free_queue.prepend_n(unhashed)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          parent_hash: BlockHash | None) -> None:
        """Record that ``blocks`` (held, full, not yet cached) now hold ``block_hashes``: they
        become prefix hits. ``parent_hash`` is the hash of the block before ``blocks[0]`` in its
        request (None for a request's first block); it chains the ``BlockStored`` event."""
        assert len(blocks) == len(block_hashes), "one hash per block"
        for block, block_hash in zip(blocks, block_hashes):
            assert block.ref_cnt > 0 and block.block_hash is None, (
                f"block {block.block_id} cached while free or already cached")
            block.block_hash = block_hash
            self.cached.setdefault(block_hash, {})[block.block_id] = block
        if blocks:
            self._events.append(BlockStored(tuple(block_hashes), parent_hash, "hbm",
                                            block_size=self.block_size))

    def reset(self) -> bool:
        """Forget every cached hash (e.g. after a weight update). Only when no block is in use:
        returns False and does nothing otherwise. Emits ``AllBlocksCleared``."""
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self._events.append(AllBlocksCleared("hbm"))
        return True

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first."""
        return self._events.take_events()

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        holders = self.cached[block.block_hash]
        del holders[block.block_id]
        if not holders:
            del self.cached[block.block_hash]
        self._events.append(BlockRemoved((block.block_hash,), "hbm"))  # per block, as vLLM
        block.block_hash = None
        self.num_evictions += 1

    def check_integrity(self) -> None:
        """Assert the queue's links, the four states and the map agree. O(num_blocks)."""
        queued: set[int] = set()
        prev, seen_hashed = self.free_queue._head, False
        for block in self.free_queue:
            assert block.prev_free is prev, f"block {block.block_id}: prev link is wrong"
            assert block.block_id not in queued, f"block {block.block_id} queued twice"
            assert block.ref_cnt == 0, f"block {block.block_id} queued with ref {block.ref_cnt}"
            assert block.block_hash is not None or not seen_hashed, (
                f"empty block {block.block_id} queued behind a cached one")
            seen_hashed |= block.block_hash is not None
            queued.add(block.block_id)
            prev = block
        assert self.free_queue._tail.prev_free is prev, "tail sentinel's prev link is wrong"
        assert len(queued) == len(self.free_queue), "num_free_blocks disagrees with the queue"
        for block in self.blocks:
            linked = block.prev_free is not None or block.next_free is not None
            assert linked == (block.block_id in queued), f"block {block.block_id}: stray links"
            assert (block.ref_cnt == 0) == (block.block_id in queued), (
                f"block {block.block_id}: ref {block.ref_cnt} but queued={linked}")
            if block.block_hash is not None:
                holders = self.cached.get(block.block_hash, {})
                assert holders.get(block.block_id) is block, (
                    f"block {block.block_id} has a hash but is not in the map under it")
        for block_hash, holders in self.cached.items():
            assert holders, "a hash maps to no block"
            for block_id, block in holders.items():
                assert block.block_id == block_id and block.block_hash == block_hash, (
                    f"map entry for block {block_id} disagrees with the block")
