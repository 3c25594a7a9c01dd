"""``write_back.DirtyBlocks``: which computed blocks a step's allocations evict (their saves,
per request that computed them), which stay (listed again under their own hash), and which
are forgotten because a load they sit on failed."""

from __future__ import annotations

from tierd.connector.vllm.connector.metadata import SaveSpec
from tierd.connector.vllm.connector.write_back import DirtyBlocks


def h(n: int) -> bytes:
    return bytes([n]) * 32


def test_a_block_given_to_other_tokens_is_evicted_once() -> None:
    dirty = DirtyBlocks()
    dirty.computed(SaveSpec("a", [5, 6, 7], [h(1), h(2), h(3)]))
    out: dict[str, SaveSpec] = {}
    # request "b" gets blocks 7 and 9 at positions 0-1 with other hashes: 7 is evicted
    dirty.reallocated([7, 9], 0, [h(8), h(9)], out)
    assert [(s.req_id, s.block_ids, s.block_hashes) for s in out.values()] == [
        ("a", [7], [h(3)])]
    assert len(dirty) == 2
    again: dict[str, SaveSpec] = {}
    dirty.reallocated([7], 0, [h(8)], again)
    assert again == {}


def test_a_block_listed_again_under_its_own_hash_stays_dirty() -> None:
    """A local prefix-cache hit (or a resumed request's own blocks) keeps the KV."""
    dirty = DirtyBlocks()
    dirty.computed(SaveSpec("a", [5, 6], [h(1), h(2)]))
    out: dict[str, SaveSpec] = {}
    dirty.reallocated([5, 6], 0, [h(1), h(2)], out)
    assert out == {} and len(dirty) == 2
    # at another position, or past the hashes known (a partial block): evicted
    dirty.reallocated([6], 3, [h(1), h(2)], out)
    dirty.reallocated([5], 0, [], out)
    assert out["a"].block_ids == [6, 5] and len(dirty) == 0


def test_evictions_group_by_request_and_name_only_unreported_loads() -> None:
    dirty = DirtyBlocks()
    dirty.computed(SaveSpec("a", [5, 6], [h(1), h(2)], depends_on=[2, 3]))
    dirty.computed(SaveSpec("b", [8], [h(4)], depends_on=[3]))
    out: dict[str, SaveSpec] = {}
    dirty.reallocated([5, 8, 6], 0, [h(9), h(9), h(9)], out)
    specs = dirty.unreported(out, loading={3})
    assert [(s.req_id, s.block_ids, s.depends_on) for s in specs] == [
        ("a", [5, 6], [3]), ("b", [8], [3])]


def test_blocks_planned_on_a_failed_load_are_forgotten() -> None:
    dirty = DirtyBlocks()
    dirty.computed(SaveSpec("a", [5], [h(1)], depends_on=[2]))
    dirty.computed(SaveSpec("b", [6], [h(2)], depends_on=[3]))
    dirty.computed(SaveSpec("c", [7], [h(3)]))
    dirty.failed({2})
    out: dict[str, SaveSpec] = {}
    dirty.reallocated([5, 6, 7], 0, [], out)
    assert sorted(b for s in out.values() for b in s.block_ids) == [6, 7]


def test_a_block_computed_again_replaces_its_entry() -> None:
    """A block recomputed in place (after a failed load) is saved with what it holds last."""
    dirty = DirtyBlocks()
    dirty.computed(SaveSpec("a", [5], [h(1)], depends_on=[2]))
    dirty.computed(SaveSpec("a", [5], [h(1)]))
    dirty.failed({2})
    out: dict[str, SaveSpec] = {}
    dirty.reallocated([5], 0, [h(7)], out)
    assert out["a"].depends_on == [] and out["a"].block_ids == [5]
