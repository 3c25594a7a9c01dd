"""The HBM block pool: free queue order, the four block states, eviction, events, integrity."""

from __future__ import annotations

import hashlib

import pytest

from tierd.connector.reference.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from tierd.events import AllBlocksCleared, BlockRemoved, BlockStored
from tierd.types import BlockHash


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_queue_operations_keep_order() -> None:
    """popleft, append, appendleft and remove-from-middle give the exact expected order."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 1, 3, 4, 0]
    assert len(queue) == 5
    assert blocks[2].prev_free is not None and blocks[2].prev_free.block_id == -1
    for block in list(queue):
        queue.remove(block)
    assert len(queue) == 0 and list(queue) == []
    assert all(b.prev_free is None and b.next_free is None for b in blocks)


def test_new_blocks_come_from_the_head_and_none_when_short() -> None:
    """Blocks are handed out 0,1,2... with ref 1; asking for more than are free changes nothing."""
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert got is not None and [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_new_blocks(2) is None
    assert queue_ids(pool) == [3] and pool.num_free_blocks == 1
    pool.check_integrity()


def test_free_sends_unhashed_to_front_hashed_to_back() -> None:
    """Freed blocks keep their hash; empty ones are reused before any cached one."""
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks[:2], [h("a"), h("b")], None)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [2, 3, 4, 5, 1, 0]
    assert blocks[0].block_hash == h("a") and pool.get_cached_block(h("a")) is blocks[0]
    pool.check_integrity()


def test_eviction_happens_only_when_a_hashed_block_is_popped() -> None:
    """Popping a cached block removes it from the map, clears its hash and emits BlockRemoved."""
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [h("a"), h("b")], None)
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [2, 1, 0]
    assert pool.take_events() == [BlockStored((h("a"), h("b")), None, "hbm", block_size=16)]
    got = pool.get_new_blocks(2)
    assert got is not None and [b.block_id for b in got] == [2, 1]
    assert got[1].block_hash is None and pool.get_cached_block(h("b")) is None
    assert pool.get_cached_block(h("a")) is blocks[0]
    assert pool.take_events() == [BlockRemoved((h("b"),), "hbm")]
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_touch_revives_an_evictable_block_from_the_middle() -> None:
    """A prefix hit on a freed cached block takes it out of the queue; it cannot be evicted."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [h("a"), h("b"), h("c")], None)
    pool.free_blocks(reversed(blocks))
    pool.touch([blocks[1]])
    assert queue_ids(pool) == [3, 2, 0] and blocks[1].ref_cnt == 1
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 2
    pool.check_integrity()


def test_duplicate_hashes_each_emit_block_removed() -> None:
    """Two blocks with one hash both sit in the map; each eviction emits BlockRemoved, the first
    while the other block still holds the hash (vLLM 0.33 does the same)."""
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    assert blocks is not None
    pool.cache_full_blocks([blocks[0]], [h("a")], None)
    pool.cache_full_blocks([blocks[1]], [h("a")], None)
    assert sorted(pool.cached[h("a")]) == [0, 1]
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.get_new_blocks(1) is not None
    assert pool.take_events() == [BlockRemoved((h("a"),), "hbm")]
    assert list(pool.cached[h("a")]) == [1] and pool.get_cached_block(h("a")) is blocks[1]
    assert pool.get_new_blocks(1) is not None
    assert pool.take_events() == [BlockRemoved((h("a"),), "hbm")] and pool.cached == {}
    assert pool.num_evictions == 2
    pool.check_integrity()


def test_eviction_events_follow_pop_order() -> None:
    """One get_new_blocks call evicting three cached blocks (two sharing a hash) emits one
    BlockRemoved per block, in the order the blocks left the queue."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    assert blocks is not None
    pool.cache_full_blocks(blocks[:2], [h("a"), h("b")], None)
    pool.cache_full_blocks([blocks[2]], [h("a")], None)
    pool.free_blocks([blocks[3], blocks[2], blocks[1], blocks[0]])
    assert queue_ids(pool) == [3, 2, 1, 0]
    pool.take_events()
    got = pool.get_new_blocks(4)
    assert got is not None and [b.block_id for b in got] == [3, 2, 1, 0]
    assert pool.take_events() == [BlockRemoved((x,), "hbm") for x in (h("a"), h("b"), h("a"))]
    pool.check_integrity()


def test_uncached_blocks_freed_together_keep_their_order_at_the_front() -> None:
    """Freeing several unhashed blocks at once puts them at the queue front in the order given
    (vLLM's one prepend_n), hashed ones at the back in the order given."""
    pool = BlockPool(7)
    blocks = pool.get_new_blocks(5)
    assert blocks is not None
    pool.cache_full_blocks([blocks[1], blocks[3]], [h("b"), h("d")], None)
    pool.free_blocks([blocks[4], blocks[3], blocks[2], blocks[1], blocks[0]])
    assert queue_ids(pool) == [4, 2, 0, 5, 6, 3, 1]
    got = pool.get_new_blocks(3)
    assert got is not None and [b.block_id for b in got] == [4, 2, 0]
    pool.free_blocks(got[1:])  # a second call goes in front of what is there
    assert queue_ids(pool) == [2, 0, 5, 6, 3, 1]
    pool.check_integrity()


def test_prepend_n_keeps_the_given_order() -> None:
    """prepend_n puts a run at the head in order, ahead of what was queued."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.prepend_n([blocks[4], blocks[2], blocks[3]])
    queue.prepend_n([])
    assert [b.block_id for b in queue] == [4, 2, 3, 0, 1] and len(queue) == 5


def test_cache_event_carries_the_parent_hash() -> None:
    """BlockStored names the hash of the block before the run, and the block size."""
    pool = BlockPool(4, block_size=32)
    blocks = pool.get_new_blocks(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [h("b"), h("c")], h("a"))
    assert pool.take_events() == [BlockStored((h("b"), h("c")), h("a"), "hbm", block_size=32)]


def test_reset_only_when_idle() -> None:
    """reset refuses while a block is held; when idle it forgets every hash and says so."""
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [h("a")], None)
    pool.take_events()
    assert pool.reset() is False and pool.get_cached_block(h("a")) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset() is True
    assert pool.cached == {} and blocks[0].block_hash is None
    assert pool.take_events() == [AllBlocksCleared("hbm")]
    pool.check_integrity()


@pytest.mark.parametrize("block_size", [0, 12, 256, 4, -16])
def test_unsupported_block_size_is_rejected(block_size: int) -> None:
    """Block sizes other than 8..128 powers of two raise, listing the choices."""
    with pytest.raises(ValueError, match="8, 16, 32, 64, 128"):
        BlockPool(4, block_size)


def test_supported_block_sizes() -> None:
    """Every documented block size builds a pool."""
    assert [BlockPool(1, bs).block_size for bs in (8, 16, 32, 64, 128)] == [8, 16, 32, 64, 128]


def test_zero_blocks_is_rejected() -> None:
    """A pool needs at least one block; the message says how to size it."""
    with pytest.raises(ValueError, match="tierd plan"):
        BlockPool(0)


def test_check_integrity_catches_a_broken_state() -> None:
    """A held block sitting in the queue, or a hash missing from the map, fails the check."""
    pool = BlockPool(3)
    pool.blocks[1].ref_cnt = 1
    with pytest.raises(AssertionError, match="block 1"):
        pool.check_integrity()
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    assert blocks is not None
    blocks[0].block_hash = h("x")
    with pytest.raises(AssertionError, match="not in the map"):
        pool.check_integrity()
