"""The per-tier index: entries kept least recently used first, reordered only by touches."""

from __future__ import annotations

import pytest

from tierd.daemon.lru import DramBlock, LruIndex
from tierd.types import BlockHash, Namespace, NamespacedKey

NS = Namespace(bytes(16))


def key(i: int) -> NamespacedKey:
    return NamespacedKey(NS + bytes([i]) * 32)


def block(i: int) -> DramBlock:
    return DramBlock(NS, BlockHash(bytes([i]) * 32), 1024, i, 0, 0.0, 0.0)


def order(index: LruIndex[DramBlock]) -> list[int]:
    return [b.slot_id for _, b in index.oldest_first()]


def test_touches_reorder_and_lookups_do_not() -> None:
    """Add 0..4; get and prefix leave the order; touch 1 then touch_all [3, 0]: 2, 4, 1, 3, 0;
    newest_first is its reverse; pop 4 and clear return what was held, oldest first."""
    index: LruIndex[DramBlock] = LruIndex()
    for i in range(5):
        index.add(key(i), block(i))
    assert index.get(key(2)) is not None and index.get(key(9)) is None
    assert [b.slot_id for b in index.prefix([key(0), key(1), key(9), key(2)])] == [0, 1]
    assert order(index) == [0, 1, 2, 3, 4]
    index.touch(key(1))
    index.touch_all([key(3), key(0)])
    assert order(index) == [2, 4, 1, 3, 0]
    assert [b.slot_id for _, b in index.newest_first()] == [0, 3, 1, 4, 2]
    assert index.pop(key(4)).slot_id == 4 and key(4) not in index and len(index) == 4
    assert [b.slot_id for _, b in index.clear()] == [2, 1, 3, 0] and len(index) == 0


def test_a_key_added_twice_is_a_bug() -> None:
    """Adding a key already held trips the index's assertion (one entry per key per tier)."""
    index: LruIndex[DramBlock] = LruIndex()
    index.add(key(0), block(0))
    with pytest.raises(AssertionError, match="already indexed"):
        index.add(key(0), block(0))
