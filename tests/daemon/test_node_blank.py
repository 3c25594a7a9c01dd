"""Blank reservations (``NodeStore.reserve_blank``): slots reserved ahead of the blocks they
will hold, named at the commit. Stored once, freed when unused, bounded like any reservation;
each test ends with ``check_integrity``."""

from __future__ import annotations

import pytest
from node_rig import BLOCK, MakeRig, Rig, chain, payload  # noqa: E402

from tierd.checksum import block_checksum
from tierd.daemon.errors import FailedPrecondition, ResourceExhausted
from tierd.daemon.node import Reservation
from tierd.events import BlockStored
from tierd.types import BlockHash


@pytest.fixture
def rig(make_rig: MakeRig) -> Rig:
    return make_rig(blank_fraction=1.0)  # the whole (8-slot) arena may be blank


def _write(rig: Rig, res: Reservation, names: list[BlockHash]) -> list[int | None]:
    """Copy each named block into its blank slot; the checksums for the commit (None: a slot
    left unwritten)."""
    sums: list[int | None] = [None] * len(res.slot_ids)
    for i, (name, slot) in enumerate(zip(names, res.slot_ids)):
        if slot is not None:
            rig.arena.view(rig.engine.geometry.offset(slot), BLOCK)[:] = payload(name)
            sums[i] = block_checksum(payload(name))
    return sums


async def test_blank_slots_are_invisible_until_named_and_spares_are_freed(rig: Rig) -> None:
    """Four blank slots: nothing is visible while reserved; a commit naming three stores them
    (bit-exact, one BlockStored run) and frees the fourth."""
    res = rig.node.reserve_blank(rig.engine.engine_id, 4)
    assert len(res.slot_ids) == 4 and None not in res.slot_ids
    assert res.already_stored == [False] * 4
    assert rig.node.stats().tiers["dram"].used_blocks == 4
    names = chain(3)
    sums = _write(rig, res, names)
    assert rig.tiers(names) == []
    rig.node.check_integrity()
    assert rig.node.commit(res.lease_id, sums, names=names) == 3
    assert rig.tiers(names) == ["dram"] * 3
    assert rig.node.take_events() == [BlockStored(tuple(names), None, "dram", 16)]
    assert rig.node.stats().tiers["dram"].used_blocks == 3
    lease = await rig.node.acquire(rig.engine.engine_id, names)
    assert lease.slot_ids == res.slot_ids[:3]
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in names]
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_a_name_already_held_or_being_written_is_stored_once(rig: Rig) -> None:
    """At the commit, a name in DRAM, one only on SSD, one another reservation is writing and
    a repeat within the commit each free their blank slot; the rest are stored, in runs whose
    parent is the name before them; the other reservation still commits its own."""
    held = chain(8, "held")
    rig.store(held)
    await rig.node.maintain()                                  # held[0], held[1] -> SSD only
    pending = chain(1, "pending")
    other = rig.node.reserve(rig.engine.engine_id, pending)
    new = chain(2, "new")
    names = [new[0], held[0], held[7], pending[0], new[1], new[1]]
    res = rig.node.reserve_blank(rig.engine.engine_id, len(names))
    assert None not in res.slot_ids                            # room made by evicting LRU
    assert rig.tiers(held[:1]) == ["ssd"] and rig.tiers(held[7:]) == ["dram"]
    rig.node.take_events()
    sums = _write(rig, res, names)
    assert rig.node.commit(res.lease_id, sums, names=names) == 2
    assert rig.node.take_events() == [BlockStored((new[0],), None, "dram", 16),
                                      BlockStored((new[1],), pending[0], "dram", 16)]
    assert rig.tiers(new) == ["dram", "dram"]
    assert rig.node.commit(other.lease_id, _write(rig, other, pending)) == 1
    lease = await rig.node.acquire(rig.engine.engine_id, [*new, *pending])
    assert rig.copy_out(lease.slot_ids) == [payload(h) for h in [*new, *pending]]
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_blank_reservations_end_like_any_other(rig: Rig) -> None:
    """Abort and expiry free blank slots; with every slot pinned there is no room (None);
    another engine cannot commit them."""
    res = rig.node.reserve_blank(rig.engine.engine_id, 3)
    rig.node.abort(res.lease_id)
    assert rig.node.stats().tiers["dram"].used_blocks == 0
    res = rig.node.reserve_blank(rig.engine.engine_id, 3)
    rig.clock.advance(30.0)
    with pytest.raises(FailedPrecondition, match="expired"):
        rig.node.commit(res.lease_id, [None] * 3, names=chain(3))
    assert rig.node.stats().tiers["dram"].used_blocks == 0
    pinned = chain(6)
    rig.store(pinned)
    lease = await rig.node.acquire(rig.engine.engine_id, pinned)
    res = rig.node.reserve_blank(rig.engine.engine_id, 4)
    assert [s is not None for s in res.slot_ids] == [True, True, False, False]
    rig.node.abort(res.lease_id)
    rig.node.release(lease.lease_id)
    rig.node.check_integrity()


async def test_blank_reservation_errors(rig: Rig) -> None:
    """Names on a named reservation, more names than slots, a written slot left unnamed, a
    count over max_blocks_per_request or below zero: each a precise error, and the reservation
    still commits afterwards."""
    named = rig.node.reserve(rig.engine.engine_id, chain(1))
    with pytest.raises(ValueError, match="blank slots only"):
        rig.node.commit(named.lease_id, [1], names=chain(1, "x"))
    rig.node.abort(named.lease_id)
    res = rig.node.reserve_blank(rig.engine.engine_id, 2)
    with pytest.raises(ValueError, match="3 block hashes for 2 blank slots"):
        rig.node.commit(res.lease_id, [None, None], names=chain(3))
    with pytest.raises(ValueError, match="blank slot #1 is written but has no block hash"):
        rig.node.written_spans(res.lease_id, [True, True], names=chain(1))
    with pytest.raises(ValueError, match="blank slot #1 is written but has no block hash"):
        rig.node.commit(res.lease_id, [1, 2], names=chain(1))
    names = chain(2)
    assert rig.node.commit(res.lease_id, _write(rig, res, names), names=names) == 2
    with pytest.raises(ResourceExhausted, match="at most 4096"):
        rig.node.reserve_blank(rig.engine.engine_id, 4097)
    with pytest.raises(ValueError, match=">= 0"):
        rig.node.reserve_blank(rig.engine.engine_id, -1)
    rig.node.check_integrity()


async def test_blank_slots_of_all_engines_stay_within_blank_fraction(make_rig: MakeRig) -> None:
    """With blank_fraction 0.25 (2 of 8 slots), two engines together get 2 blank slots, the
    rest None; a commit or an abort gives the room back; a fraction outside [0, 1] is refused."""
    rig = make_rig(blank_fraction=0.25)
    other = rig.node.register_engine("default", rig.engine.layout, "other")
    first = rig.node.reserve_blank(rig.engine.engine_id, 1)
    second = rig.node.reserve_blank(other.engine_id, 3)
    assert first.slot_ids[0] is not None
    assert [s is not None for s in second.slot_ids] == [True, False, False]
    assert rig.node.stats().tiers["dram"].used_blocks == 2
    rig.node.check_integrity()
    names = chain(1)
    assert rig.node.commit(first.lease_id, _write(rig, first, names), names=names) == 1
    rig.node.abort(second.lease_id)
    again = rig.node.reserve_blank(other.engine_id, 3)
    assert [s is not None for s in again.slot_ids] == [True, True, False]
    rig.node.abort(again.lease_id)
    rig.node.check_integrity()
    with pytest.raises(ValueError, match="blank_fraction"):
        make_rig(blank_fraction=1.5)
