"""Block transfers between a real shared-memory arena and a paged pool: exact bytes, checksum
verification, chunking, and the bounded staging ring."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tierd.checksum import block_checksum
from tierd.connector.core.arena_slots import ArenaSlots, allocate_staging, load_blocks
from tierd.connector.reference.staging import Span, StagingRing, gather_rows
from tierd.daemon.arena import OwnedArena
from tierd.wire.arena import ShmArena
from tierd.wire.geometry import SlotGeometry


@pytest.fixture
def arena(tmp_path: object) -> Iterator[ShmArena]:
    made = OwnedArena.create("tierd-transfer-test", 4096, directory=str(tmp_path), prefault=False)
    yield made
    made.unlink()


def _sums(rows: torch.Tensor) -> list[int]:
    """``block_checksum`` of each row (what the daemon computes at a Commit)."""
    return [block_checksum(r.numpy().tobytes()) for r in rows]


def _save(slots: ArenaSlots, slot_ids: list[int], rows: torch.Tensor) -> list[int]:
    """Write ``rows`` into ``slot_ids``, as an engine does before its Commit; their checksums."""
    slots.write(slot_ids, rows)
    return _sums(rows)


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, width), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("geometry", [SlotGeometry(1024, 256, 4), SlotGeometry(1000, 96, 10)],
                         ids=["slab-multiple", "slab-remainder"])
def test_write_then_read_slots_exact(arena: ShmArena, geometry: SlotGeometry) -> None:
    """Rows written to slots 5, 0, 9 land at SlotGeometry.offset and read back bit-exact."""
    slots = ArenaSlots(arena.as_tensor(), geometry)
    rows = _rows(3, geometry.slot_bytes, seed=1)
    slots.write([5, 0, 9], rows)
    for slot, row in zip([5, 0, 9], rows):
        off = geometry.offset(slot)
        assert bytes(arena.view(off, geometry.slot_bytes)) == row.numpy().tobytes()
    out = torch.empty(3, geometry.slot_bytes, dtype=torch.uint8)
    slots.read([9, 5, 0], out)
    assert torch.equal(out, rows[[2, 0, 1]])
    with pytest.raises(ValueError, match="slot ids must lie in"):
        slots.read([slots.num_slots], out[:1])


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_load_verifies_and_stops_at_first_mismatch(arena: ShmArena, direct: bool) -> None:
    """Five blocks, directly (one pass) or through a two-row staging buffer; block 3's slot is
    corrupted: blocks 0-2 are placed in pool rows 7, 2, 4, returns 3, rows outside the load stay
    untouched. Staged, rows 5 and 6 (the failed block and the one after) are untouched too; in
    one pass they may hold copied bytes: the caller recomputes them."""
    geometry = SlotGeometry(1024, 128, 8)
    slots = ArenaSlots(arena.as_tensor(), geometry)
    rows = _rows(5, 128, seed=2)
    checksums = _save(slots, [0, 1, 2, 3, 4], rows)
    arena.view(geometry.offset(3), 1)[0] ^= 0xFF
    pool = torch.zeros(8, 128, dtype=torch.uint8)
    got = load_blocks(slots, [0, 1, 2, 3, 4], checksums, pool, [7, 2, 4, 5, 6],
                      allocate_staging(2, 128), direct=direct)
    assert got == 3
    assert torch.equal(pool[[7, 2, 4]], rows[:3])
    assert int(pool[[0, 1, 3] if direct else [0, 1, 3, 5, 6]].sum()) == 0
    assert _sums(pool[[7, 2, 4]]) == checksums[:3]


def test_staging_ring_bounds_wraps_and_returns_in_order() -> None:
    """A 10-row ring: spans of 4, 4, then 3 does not fit (None); after the first span returns,
    3 wraps to rows 0-3; a span of 2 then does not fit before the oldest (None)."""
    ring = StagingRing(10, 8)
    a, b = ring.take(4), ring.take(4)
    assert (a, b, ring.take(3)) == (Span(0, 4), Span(4, 8), None)
    assert a is not None and b is not None
    ring.give_back(a)
    c = ring.take(3)
    assert c == Span(0, 3)
    assert ring.take(2) is None and ring.take(1) == Span(3, 4)
    ring.check_integrity()
    assert ring.used_rows == 8
    with pytest.raises(AssertionError, match="oldest first"):
        ring.give_back(c)
    ring.give_back(b)
    assert ring.take(11) is None
    ring.check_integrity()


def test_write_skips_rows_without_a_slot(arena: ShmArena) -> None:
    """Rows 0-3 to slots 4, None, 5, 9: slots 4, 5 and 9 hold rows 0, 2, 3 bit-exact, slot 6
    (between them) stays zero; a slot named twice is refused."""
    geometry = SlotGeometry(1024, 128, 8)
    slots = ArenaSlots(arena.as_tensor(), geometry)
    rows = _rows(4, 128, seed=3)
    slots.write([4, None, 5, 9], rows)
    for slot, row in ((4, 0), (5, 2), (9, 3)):
        assert bytes(arena.view(geometry.offset(slot), 128)) == rows[row].numpy().tobytes()
    assert bytes(arena.view(geometry.offset(6), 128)) == bytes(128)
    with pytest.raises(ValueError, match="distinct"):
        slots.write([4, 4, None, None], rows)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_load_paths_place_the_same_bytes(arena: ShmArena, direct: bool) -> None:
    """Slots 3, 4, 0, 1 (two arena runs) into pool rows 2, 3, 4, 6 (two pool runs), directly or
    through a one-row staging buffer: the same 4 rows land, rows 0, 1, 5, 7 stay zero."""
    geometry = SlotGeometry(1024, 128, 8)
    slots = ArenaSlots(arena.as_tensor(), geometry)
    rows = _rows(4, 128, seed=4)
    checksums = _save(slots, [3, 4, 0, 1], rows)
    pool = torch.zeros(8, 128, dtype=torch.uint8)
    got = load_blocks(slots, [3, 4, 0, 1], checksums, pool, [2, 3, 4, 6],
                      allocate_staging(1, 128), direct=direct)
    assert got == 4
    assert torch.equal(pool[[2, 3, 4, 6]], rows)
    assert int(pool[[0, 1, 5, 7]].sum()) == 0
    assert slots.verified([3, 4, 0, 1], [checksums[0], checksums[1], 0, checksums[3]]) == 2


@pytest.mark.parametrize("block_ids", [[3, 4, 5, 9, 10, 0], [14, 1, 12, 3, 10, 5, 8, 7, 6, 0]],
                         ids=["runs", "scattered"])
def test_gather_rows_copies_pool_rows_in_order(block_ids: list[int]) -> None:
    """Pool rows gathered into staging land in the order asked, whether copied run by run
    (3 runs) or in one indexed gather (10 runs of one row); a mis-shaped destination is refused."""
    pool = _rows(16, 96, seed=5)
    out = allocate_staging(len(block_ids), 96)
    gather_rows(pool, block_ids, out)
    assert torch.equal(out, pool[block_ids])
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(pool, block_ids, out[1:])
