"""Per-request block tables: prefix hits, LRU eviction order, fork + copy-on-write, events."""

from __future__ import annotations

import hashlib
import random

import pytest

from tierd.connector.reference.kv_cache_manager import (
    BlockCopy,
    CachedBlock,
    KVCacheManager,
    WriteSlot,
)
from tierd.events import BlockRemoved, BlockStored
from tierd.types import BlockHash


def chain(tokens: list[int], block_size: int = 16) -> list[BlockHash]:
    """Stand-in for tierd.hashing: SHA-256 chained over each full block's token tuple."""
    hashes: list[BlockHash] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(tuple(tokens[start:start + block_size])).encode())\
            .digest()
        hashes.append(BlockHash(parent))
    return hashes


def admit(mgr: KVCacheManager, rid: str, tokens: list[int]) -> list[int] | None:
    """A new request: look up its prefix, allocate, return its block table (None: no space)."""
    hashes = chain(tokens, mgr.block_size)
    hit = mgr.get_computed_blocks(hashes, len(tokens))
    if mgr.allocate_slots(rid, len(tokens), hit, hashes) is None:
        return None
    return mgr.block_table(rid)


SYSTEM = list(range(1000, 1032))  # 32 tokens: two full blocks


def test_shared_system_prompt_hits_then_diverges() -> None:
    """Two prompts with one system prompt share its 2 blocks and get their own after it."""
    mgr = KVCacheManager(10)
    a, b = SYSTEM + list(range(20)), SYSTEM + list(range(100, 120))
    assert admit(mgr, "a", a) == [0, 1, 2, 3]
    hit = mgr.get_computed_blocks(chain(b), len(b))
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_tokens == 32
    new = mgr.allocate_slots("b", len(b), hit, chain(b))
    assert new is not None and [blk.block_id for blk in new] == [4, 5]
    assert mgr.block_table("b") == [0, 1, 4, 5]
    assert [mgr.pool.blocks[i].ref_cnt for i in range(6)] == [2, 2, 1, 1, 1, 1]
    assert (mgr.stats.queries, mgr.stats.hits) == (104, 32)
    mgr.check_integrity()


def test_freed_conversation_is_hit_later() -> None:
    """A finished chat's blocks stay hittable while unrelated work uses the empty blocks."""
    mgr = KVCacheManager(10)
    turn1 = SYSTEM + list(range(20))  # 52 tokens: 3 full blocks + 4 tokens
    assert admit(mgr, "t1", turn1) == [0, 1, 2, 3]
    mgr.free("t1")
    assert [b.block_id for b in mgr.pool.free_queue] == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert admit(mgr, "other", list(range(500, 540))) == [3, 4, 5]
    mgr.take_events()
    turn2 = turn1 + list(range(200, 230))  # 82 tokens
    assert admit(mgr, "t2", turn2) == [0, 1, 2, 6, 7, 8]
    assert mgr.stats.hits == 48 and mgr.pool.num_evictions == 0
    assert not any(isinstance(e, BlockRemoved) for e in mgr.take_events())
    mgr.check_integrity()


def test_eviction_order_lru_then_deepest_block_first() -> None:
    """The least recently freed request goes first, and its deepest block before its root."""
    mgr = KVCacheManager(8)
    x, y = list(range(32)), list(range(100, 132))
    assert admit(mgr, "x", x) == [0, 1]
    assert admit(mgr, "y", y) == [2, 3]
    mgr.free("x")
    mgr.free("y")
    assert [b.block_id for b in mgr.pool.free_queue] == [4, 5, 6, 7, 1, 0, 3, 2]
    mgr.take_events()
    assert admit(mgr, "z", list(range(300, 396))) == [4, 5, 6, 7, 1, 0]
    hx = chain(x)
    assert mgr.take_events()[:2] == [BlockRemoved((hx[1],), "hbm"), BlockRemoved((hx[0],), "hbm")]
    hit = mgr.get_computed_blocks(chain(y), 33)  # y is still whole
    assert [b.block_id for b in hit.blocks] == [2, 3]
    mgr.check_integrity()


def test_partial_last_block_goes_to_the_front_on_free() -> None:
    """An unhashed partial block is reused before any cached block of the same request."""
    mgr = KVCacheManager(3)
    assert admit(mgr, "a", list(range(40))) == [0, 1, 2]
    mgr.free("a")
    assert [b.block_id for b in mgr.pool.free_queue] == [2, 1, 0]
    assert admit(mgr, "b", list(range(900, 910))) == [2]
    assert mgr.pool.num_evictions == 0
    mgr.check_integrity()


def test_fork_shares_one_copy_and_cow_copies_only_the_partial_block() -> None:
    """n=4 from a 40-token prompt holds 3 blocks; each decode write copies just the last one."""
    mgr = KVCacheManager(10)
    prompt = list(range(40))
    assert admit(mgr, "s0", prompt) == [0, 1, 2]
    for child in ("s1", "s2", "s3"):
        mgr.fork("s0", child)
    assert [mgr.pool.blocks[i].ref_cnt for i in range(3)] == [4, 4, 4]
    assert mgr.pool.num_free_blocks == 7
    with pytest.raises(ValueError, match="prepare_write"):
        mgr.slot_mapping("s0", [40])
    assert mgr.slot_mapping("s0", [0, 17]) == [0, 17]  # full blocks stay shared and readable
    for rid in ("s0", "s1", "s2", "s3"):
        assert mgr.allocate_slots(rid, 41, block_hashes=chain(prompt)) == []
    assert mgr.take_copies() == [BlockCopy(2, 3), BlockCopy(2, 4), BlockCopy(2, 5)]
    assert [mgr.block_table(r) for r in ("s0", "s1", "s2", "s3")] == \
        [[0, 1, 3], [0, 1, 4], [0, 1, 5], [0, 1, 2]]
    assert [mgr.pool.blocks[i].ref_cnt for i in range(6)] == [4, 4, 1, 1, 1, 1]
    assert mgr.slot_mapping("s0", [40]) == [3 * 16 + 8]
    assert mgr.take_copies() == []
    mgr.check_integrity()


def test_prepare_write_reports_the_copy() -> None:
    """An explicit write into a shared partial block gets a private copy and its slot."""
    mgr = KVCacheManager(4)
    assert admit(mgr, "p", list(range(20))) == [0, 1]
    mgr.fork("p", "c")
    assert mgr.prepare_write("c", 19) == WriteSlot(2 * 16 + 3, BlockCopy(1, 2))
    assert mgr.prepare_write("c", 19) == WriteSlot(2 * 16 + 3, None)
    assert mgr.prepare_write("p", 19) == WriteSlot(1 * 16 + 3, None)  # p is alone now
    assert mgr.prepare_write("p", 5) == WriteSlot(5, None)  # full hashed block: never copied
    mgr.fork("p", "d")
    mgr.fork("p", "e")
    assert mgr.prepare_write("d", 18) == WriteSlot(3 * 16 + 2, BlockCopy(1, 3))
    assert mgr.prepare_write("e", 18) is None  # no free block left: nothing changed
    assert mgr.block_table("e") == [0, 1] and mgr.take_copies() == []
    mgr.check_integrity()


def test_last_token_is_always_computed() -> None:
    """A fully cached 32-token prompt hits 1 block, recomputes the 2nd (a duplicate hash)."""
    mgr = KVCacheManager(6)
    prompt = list(range(32))
    assert admit(mgr, "first", prompt) == [0, 1]
    mgr.free("first")
    hit = mgr.get_computed_blocks(chain(prompt), 32)
    assert [b.block_id for b in hit.blocks] == [0] and hit.num_tokens == 16
    assert mgr.allocate_slots("again", 32, hit, chain(prompt)) is not None
    assert mgr.block_table("again") == [0, 2]
    assert sorted(mgr.pool.cached[chain(prompt)[1]]) == [1, 2]
    longer = mgr.get_computed_blocks(chain(prompt), 33)
    assert [b.block_id for b in longer.blocks] == [0, 1]
    mgr.check_integrity()


def test_events_and_newly_cached_blocks_during_decode() -> None:
    """Blocks are cached (event + write-through list) the step they become full."""
    mgr = KVCacheManager(8)
    tokens = list(range(40))
    hashes = chain(tokens)
    assert admit(mgr, "r", tokens) == [0, 1, 2]
    assert mgr.take_events() == [BlockStored((hashes[0], hashes[1]), None, "hbm", block_size=16)]
    assert mgr.take_newly_cached() == [CachedBlock("r", 0, 0, hashes[0]),
                                       CachedBlock("r", 1, 1, hashes[1])]
    for n in range(41, 48):  # decode up to 47 tokens: block 2 still partial
        tokens.append(n)
        assert mgr.allocate_slots("r", n, block_hashes=chain(tokens)) == []
    assert mgr.take_events() == [] and mgr.take_newly_cached() == []
    tokens.append(48)
    assert mgr.allocate_slots("r", 48, block_hashes=chain(tokens)) == []
    hashes = chain(tokens)
    assert mgr.take_events() == [BlockStored((hashes[2],), hashes[1], "hbm", block_size=16)]
    assert mgr.take_newly_cached() == [CachedBlock("r", 2, 2, hashes[2])]
    new = mgr.allocate_slots("r", 49, block_hashes=hashes)
    assert new is not None and [b.block_id for b in new] == [3]
    assert mgr.slot_mapping("r", [47, 48]) == [2 * 16 + 15, 3 * 16]
    mgr.check_integrity()


def test_loaded_prefix_is_hittable_only_after_mark_cached() -> None:
    """Blocks allocated uncached for a lower-tier load become hits once marked, not before."""
    mgr = KVCacheManager(8)
    tokens = list(range(50))
    hashes = chain(tokens)
    assert mgr.allocate_slots("load", 50, None, hashes, cache=False) is not None
    assert mgr.take_events() == [] and mgr.take_newly_cached() == []
    assert mgr.get_computed_blocks(hashes, 50).blocks == ()
    marked = mgr.mark_cached("load", hashes, 32)
    assert marked == [CachedBlock("load", 0, 0, hashes[0]), CachedBlock("load", 1, 1, hashes[1])]
    assert mgr.take_events() == [BlockStored((hashes[0], hashes[1]), None, "hbm",
                                             block_size=16)]
    assert mgr.take_newly_cached() == []
    assert [b.block_id for b in mgr.get_computed_blocks(hashes, 50).blocks] == [0, 1]
    assert mgr.allocate_slots("load", 51, block_hashes=hashes + chain(tokens + [0])[3:]) == []
    assert mgr.take_newly_cached() == [CachedBlock("load", 2, 2, hashes[2])]
    mgr.check_integrity()


def test_failed_load_frees_its_uncached_blocks_deepest_first_at_the_front() -> None:
    """A request whose lower-tier load failed (allocated with cache=False) is freed: its four
    unhashed blocks go to the queue front deepest first, as vLLM's KVCacheManager puts them."""
    mgr = KVCacheManager(8)
    tokens = list(range(64))
    assert mgr.allocate_slots("load", 64, None, chain(tokens), cache=False) is not None
    mgr.free("load")
    assert [b.block_id for b in mgr.pool.free_queue] == [3, 2, 1, 0, 4, 5, 6, 7]
    assert admit(mgr, "next", list(range(500, 520))) == [3, 2]
    assert mgr.take_events() == [BlockStored((chain(list(range(500, 520)))[0],), None, "hbm",
                                             block_size=16)]
    mgr.check_integrity()


def test_out_of_blocks_returns_none_without_side_effects() -> None:
    """A request that does not fit changes nothing, not even its evictable prefix hits."""
    mgr = KVCacheManager(4)
    prompt = list(range(32))
    assert admit(mgr, "p", prompt) == [0, 1]
    mgr.free("p")
    mgr.take_events()
    big = prompt + list(range(100, 148))  # 80 tokens: 2 hits (revived) + 3 new > 4 blocks
    hit = mgr.get_computed_blocks(chain(big), len(big))
    assert len(hit.blocks) == 2
    assert mgr.allocate_slots("big", len(big), hit, chain(big)) is None
    assert mgr.pool.num_free_blocks == 4 and mgr.take_events() == []
    assert [b.block_id for b in mgr.pool.free_queue] == [2, 3, 1, 0]
    with pytest.raises(ValueError, match="unknown request"):
        mgr.block_table("big")
    assert admit(mgr, "q", list(range(64))) == [0, 1, 2, 3]
    assert mgr.allocate_slots("q", 65) is None and mgr.block_table("q") == [0, 1, 2, 3]
    mgr.check_integrity()


def test_bad_input_raises_with_the_fix() -> None:
    """Bad sizes, double free, unknown requests and misuse raise ValueError naming the fix."""
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, block_size=24)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0)
    mgr = KVCacheManager(4)
    assert admit(mgr, "a", list(range(20))) == [0, 1]
    mgr.free("a")
    with pytest.raises(ValueError, match="free each request once"):
        mgr.free("a")
    for call in (lambda: mgr.block_table("a"), lambda: mgr.slot_mapping("a", [0]),
                 lambda: mgr.fork("a", "b"), lambda: mgr.prepare_write("a", 0),
                 lambda: mgr.mark_cached("a", [], 0)):
        with pytest.raises(ValueError, match="call allocate_slots first"):
            call()
    assert admit(mgr, "a", list(range(20))) == [0, 1]
    with pytest.raises(ValueError, match="fork into a new id"):
        mgr.fork("a", "a")
    with pytest.raises(ValueError, match="allocate_slots for it first"):
        mgr.slot_mapping("a", [32])
    with pytest.raises(ValueError, match="cannot shrink"):
        mgr.allocate_slots("a", 10)
    hit = mgr.get_computed_blocks(chain(list(range(20))), 20)
    with pytest.raises(ValueError, match="first allocate_slots call"):
        mgr.allocate_slots("a", 30, hit)
    with pytest.raises(ValueError, match="allocate_slots first"):
        mgr.mark_cached("a", chain(list(range(48))), 48)
    mgr.check_integrity()


def test_reset_prefix_cache_waits_for_idle() -> None:
    """Reset is refused while a request holds blocks, then forgets every cached prefix."""
    mgr = KVCacheManager(4)
    admit(mgr, "a", list(range(33)))
    assert mgr.reset_prefix_cache() is False
    mgr.free("a")
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(chain(list(range(33))), 33).blocks == ()
    mgr.check_integrity()


def test_randomized_stress_keeps_tables_content_and_cache_consistent() -> None:
    """Seeded admit/decode/fork/free: integrity holds, every request reads back its own tokens,
    and every cached block (held or evictable) holds the tokens its hash names."""
    rng = random.Random(1234)
    bs = 8
    mgr = KVCacheManager(40, block_size=bs)
    kv: list[int | None] = [None] * (40 * bs)  # the simulated worker's KV: one token per slot
    live: dict[str, list[int]] = {}
    block_tokens: dict[BlockHash, list[int]] = {}
    copies = 0
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]

    def write(rid: str, tokens: list[int], start: int) -> None:
        nonlocal copies
        for copy in mgr.take_copies():
            copies += 1
            kv[copy.dst * bs:(copy.dst + 1) * bs] = kv[copy.src * bs:(copy.src + 1) * bs]
        positions = range(start, len(tokens))
        for pos, slot in zip(positions, mgr.slot_mapping(rid, positions)):
            kv[slot] = tokens[pos]
        for i, block_hash in enumerate(chain(tokens, bs)):
            block_tokens[block_hash] = tokens[i * bs:(i + 1) * bs]

    for step in range(1500):
        op = rng.random()
        if op < 0.3 or not live:
            rid = f"r{step}"
            tokens = prefixes[rng.randrange(3)][:rng.randrange(41)]
            tokens = tokens + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            hit = mgr.get_computed_blocks(chain(tokens, bs), len(tokens))
            if mgr.allocate_slots(rid, len(tokens), hit, chain(tokens, bs)) is not None:
                live[rid] = tokens
                write(rid, tokens, hit.num_tokens)
        elif op < 0.65:
            rid = rng.choice(sorted(live))
            tokens = live[rid] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            if mgr.allocate_slots(rid, len(tokens), block_hashes=chain(tokens, bs)) is not None:
                start, live[rid] = len(live[rid]), tokens
                write(rid, tokens, start)
        elif op < 0.8:
            parent = rng.choice(sorted(live))
            mgr.fork(parent, f"f{step}")
            live[f"f{step}"] = list(live[parent])
        else:
            rid = rng.choice(sorted(live))
            mgr.free(rid)
            del live[rid]
        mgr.check_integrity()
        assert mgr.take_copies() == []
        for rid, tokens in live.items():
            assert [kv[s] for s in _read_slots(mgr, rid, len(tokens))] == tokens, rid
        for block_hash, holders in mgr.pool.cached.items():
            for block_id in holders:
                assert kv[block_id * bs:(block_id + 1) * bs] == block_tokens[block_hash]
    assert copies > 20 and mgr.pool.num_evictions > 50 and mgr.stats.hits > 0


def _read_slots(mgr: KVCacheManager, rid: str, n: int) -> list[int]:
    """Slots of positions 0..n-1 for reading (shared blocks are fine to read)."""
    table = mgr.block_table(rid)
    return [table[p // mgr.block_size] * mgr.block_size + p % mgr.block_size for p in range(n)]
