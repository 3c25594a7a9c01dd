"""tierd's BlockPool against vLLM 0.33's own BlockPool on random traces: the same blocks handed
out, hit, freed and evicted, the same free-queue order, hashes and events (block ids shifted by
one: vLLM keeps block 0 as its null block)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test-vllm runs tests/vllm/ in its venv)")
pytestmark = pytest.mark.vllm

from vllm.distributed.kv_events import BlockRemoved as VllmRemoved  # noqa: E402
from vllm.distributed.kv_events import BlockStored as VllmStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core import block_pool as vllm_block_pool  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tierd.connector.reference.block_pool import BlockPool, KVCacheBlock  # noqa: E402
from tierd.events import BlockRemoved, BlockStored  # noqa: E402
from tierd.types import BlockHash  # noqa: E402

BS = 16
TRACES = 100
OPS_PER_TRACE = 150  # 15,000 operations in all


@dataclass
class Held:
    """One request's blocks in both pools (same logical table) and its vLLM request."""

    request: Request
    ours: list[KVCacheBlock]
    theirs: list[kcu.KVCacheBlock]
    num_cached: int = 0
    hashes: list[BlockHash] = field(default_factory=list)


@pytest.fixture(autouse=True)
def none_hash_state() -> Iterator[None]:
    """vLLM's NONE_HASH is a module global: set it for sha256_cbor, restore it afterwards."""
    saved = (getattr(kcu, "NONE_HASH", None), kcu._NONE_HASH_SEED)
    kcu.init_none_hash(sha256_cbor)
    yield
    kcu.NONE_HASH, kcu._NONE_HASH_SEED = saved  # type: ignore[assignment]


class Replay:
    """Drives both pools with the same operations and asserts they stay identical."""

    def __init__(self, rng: random.Random, num_blocks: int) -> None:
        self.rng = rng
        self.ours = BlockPool(num_blocks, BS)
        self.theirs = vllm_block_pool.BlockPool(num_blocks + 1, enable_caching=True,
                                                hash_block_size=BS, enable_kv_cache_events=True)
        self.held: dict[int, Held] = {}
        self.next_id = 0
        # A few shared prefixes, so requests hit each other and duplicate hashes appear.
        self.prefixes = [[rng.randrange(50_000) for _ in range(BS * rng.randrange(1, 6))]
                         for _ in range(4)]

    def prompt(self) -> list[int]:
        rng = self.rng
        head = rng.choice(self.prefixes)[: BS * rng.randrange(0, 6)] if rng.random() < 0.7 else []
        return head + [rng.randrange(50_000) for _ in range(rng.randrange(1, 4 * BS))]

    def admit(self) -> None:
        """A new request: longest cached prefix (never its last token), touch, allocate the
        rest; cache its full blocks now (most often) or leave them unhashed (a load pending)."""
        tokens = self.prompt()
        request = Request(f"r{self.next_id}", tokens, SamplingParams(max_tokens=1), None,
                          block_hasher=kcu.get_request_block_hasher(BS, sha256_cbor))
        hashes = [BlockHash(h) for h in request.block_hashes]
        hits_ours: list[KVCacheBlock] = []
        hits_theirs: list[kcu.KVCacheBlock] = []
        for block_hash in hashes[: (len(tokens) - 1) // BS]:
            mine = self.ours.get_cached_block(block_hash)
            found = self.theirs.get_cached_block(kcu.BlockHash(block_hash), [0])
            assert (mine is None) == (found is None)
            if mine is None or found is None:
                break
            assert found[0].block_id == mine.block_id + 1
            hits_ours.append(mine)
            hits_theirs.append(found[0])
        num_new = -(-len(tokens) // BS) - len(hits_ours)
        revived = sum(1 for b in hits_ours if b.ref_cnt == 0)
        if num_new + revived > self.ours.num_free_blocks:
            assert num_new + revived > self.theirs.get_num_free_blocks()
            return
        self.ours.touch(hits_ours)
        self.theirs.touch(hits_theirs)
        new_ours = self.ours.get_new_blocks(num_new)
        assert new_ours is not None
        new_theirs = self.theirs.get_new_blocks(num_new)
        held = Held(request, hits_ours + new_ours, hits_theirs + new_theirs,
                    len(hits_ours), hashes)
        self.held[self.next_id] = held
        self.next_id += 1
        if self.rng.random() < 0.75:
            self.cache(held)

    def cache(self, held: Held) -> None:
        """Cache every full block of ``held`` not cached yet, in both pools."""
        full = len(held.hashes)
        start = held.num_cached
        if start >= full:
            return
        parent = held.hashes[start - 1] if start else None
        self.ours.cache_full_blocks(held.ours[start:full], held.hashes[start:full], parent)
        self.theirs.cache_full_blocks(held.request, held.theirs, start, full, BS, 0)
        held.num_cached = full

    def free(self) -> None:
        """Free a random request, most often last block first (as the managers do), sometimes
        in table order or shuffled."""
        key = self.rng.choice(list(self.held))
        held = self.held.pop(key)
        order = list(range(len(held.ours)))
        how = self.rng.random()
        if how < 0.6:
            order.reverse()
        elif how < 0.8:
            self.rng.shuffle(order)
        self.ours.free_blocks([held.ours[i] for i in order])
        self.theirs.free_blocks([held.theirs[i] for i in order])

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.45 or not self.held:
            self.admit()
        elif roll < 0.6:
            self.cache(self.rng.choice(list(self.held.values())))  # a pending load completes
        else:
            self.free()
        self.compare()

    def compare(self) -> None:
        """Queue order, ref counts, hashes per block and the events are the same."""
        ours_queue = [b.block_id + 1 for b in self.ours.free_queue]
        theirs_queue = [b.block_id for b in self.theirs.free_block_queue.get_all_free_blocks()]
        assert ours_queue == theirs_queue
        for mine in self.ours.blocks:
            other = self.theirs.blocks[mine.block_id + 1]
            assert mine.ref_cnt == other.ref_cnt, mine.block_id
            hashed = None if other.block_hash is None else bytes(kcu.get_block_hash(
                other.block_hash))
            assert mine.block_hash == hashed, mine.block_id
        ours_events = []

        def external(block_hash: bytes) -> bytes | int:  # vLLM's events may carry ints
            return kcu.maybe_convert_block_hash(kcu.BlockHash(block_hash))

        for event in self.ours.take_events():
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                ours_events.append(("stored", [external(h) for h in event.block_hashes],
                                    None if parent is None else external(parent)))
            else:
                assert isinstance(event, BlockRemoved)
                ours_events.append(("removed", [external(h) for h in event.block_hashes], None))
        theirs_events = []
        for vevent in self.theirs.take_events():
            if isinstance(vevent, VllmStored):
                theirs_events.append(("stored", list(vevent.block_hashes),
                                      vevent.parent_block_hash))
            else:
                assert isinstance(vevent, VllmRemoved)
                theirs_events.append(("removed", list(vevent.block_hashes), None))
        assert ours_events == theirs_events
        self.ours.check_integrity()


@pytest.mark.parametrize("trace", range(TRACES))
def test_random_trace_matches_vllm_block_pool(trace: int) -> None:
    """150 random admits (with prefix hits), late caching (duplicate hashes) and frees in any
    order on a small pool: tierd's pool stays identical to vLLM 0.33's after every step."""
    rng = random.Random(trace)
    replay = Replay(rng, num_blocks=rng.randrange(8, 40))
    for _ in range(OPS_PER_TRACE):
        replay.step()
