"""The lease table: finished leases are remembered one lease time past their deadline, then
forgotten, so its memory follows the lease rate, not the uptime."""

from __future__ import annotations

import pytest

from tierd.daemon.errors import FailedPrecondition, NotFound
from tierd.daemon.leases import LeaseTable, ReadLease


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
