"""The lease table: finished leases are remembered one lease time past their deadline, then
forgotten, so its memory follows the lease rate, not the uptime."""

from __future__ import annotations

import pytest

from tierd.daemon.errors import FailedPrecondition, NotFound, ResourceExhausted
from tierd.daemon.leases import LeaseTable, ReadLease
from tierd.types import NamespacedKey


def test_finished_leases_are_forgotten_a_lease_time_past_their_deadline() -> None:
    """1,000 leases (deadline 100) released at once: until 130 each says how it ended; at 130
    (deadline + 30 s) they are forgotten, unknown like an id that never existed."""
    table = LeaseTable(remember_seconds=30.0)
    ids = [f"{i:032x}" for i in range(1000)]
    for lease_id in ids:
        table.add(ReadLease(lease_id, "e", 100.0, []))
        table.finish(lease_id, "released")
    assert table.pop_expired(129.9) == []
    assert {table.ending(i) for i in ids} == {"released"}
    with pytest.raises(FailedPrecondition, match="already released"):
        table.get(ids[0])
    table.pop_expired(130.0)
    assert {table.ending(i) for i in ids} == {None}
    with pytest.raises(NotFound, match="unknown lease"):
        table.get(ids[0])


def test_an_expired_lease_is_remembered_as_expired() -> None:
    """A lease past its deadline is finished as expired and remembered as such for a lease
    time."""
    table = LeaseTable(remember_seconds=30.0)
    table.add(ReadLease("a" * 32, "e", 100.0, []))
    assert [lease.lease_id for lease in table.pop_expired(100.0)] == ["a" * 32]
    assert table.ending("a" * 32) == "expired"
    table.pop_expired(130.0)
    assert table.ending("a" * 32) is None


def test_caps_count_live_leases_and_their_blocks() -> None:
    """Caps of 2 leases per engine, 3 in all and 5 blocks: over_cap names the cap a new lease
    would pass (per engine first), finishing or expiring a lease frees its share, and no count
    lingers for an engine with no lease."""
    table = LeaseTable(per_engine=2, total=3, blocks=5)
    keys = [NamespacedKey(bytes([i]) * 48) for i in range(3)]
    table.add(ReadLease("a" * 32, "e", 100.0, keys[:2]))
    table.add(ReadLease("b" * 32, "e", 101.0, keys[:1]))
    assert "max_leases_per_engine = 2" in (table.over_cap("e", 1) or "")
    assert table.over_cap("f", 2) is None
    assert "max_lease_keys = 5" in (table.over_cap("f", 3) or "")
    table.add(ReadLease("c" * 32, "f", 102.0, keys[:2]))
    assert "max_leases = 3" in (table.over_cap("g", 0) or "")
    with pytest.raises(ResourceExhausted, match="TIERD_MAX_LEASES"):
        table.check_room("g", 0)
    table.check_integrity()
    table.finish("b" * 32, "released")
    assert table.blocks == 4 and table.over_cap("e", 1) is None
    table.pop_expired(200.0)
    assert (len(table), table.blocks, table.over_cap("e", 5)) == (0, 0, None)
    assert table.of_engine("e") == [] and table._per_engine == {}
    table.check_integrity()
