"""The node store's cross-table check: every arena slot has one owner, and every pin one cause.

The tables each check themselves (``TierIndex``, ``LeaseTable``, ...); what only the node store
can check is how they agree: a slot belongs to exactly one of a DRAM block, a write lease or an
SSD promotion; each DRAM block's pin count equals the read leases (and acquires in progress) that
name it; each SSD record's pins equal the promotions reading it; reserved keys and blank bytes
match the live write leases; each size class's used slots match what owns them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from tierd.daemon.leases import ReadLease, WriteLease
from tierd.daemon.promotion import Promotion
from tierd.daemon.tier_index import TierIndex
from tierd.types import NamespacedKey, make_key


def check_slots_and_pins(tiers: TierIndex, leases: Iterable[ReadLease | WriteLease],
                         writing: Mapping[NamespacedKey, str],
                         inflight_pins: Mapping[NamespacedKey, int], blank_bytes: int,
                         promoting: Iterable[Promotion]) -> Counter[tuple[int, int]]:
    """Assert the agreements above (``writing``: reserved key -> lease id; ``inflight_pins``:
    pins of acquires not yet leased; ``blank_bytes``: the reservations' blank total). Returns
    the owners counted per ``(slot_bytes, slot_id)``."""
    live, promotions = list(leases), list(promoting)
    owned: Counter[tuple[int, int]] = Counter()
    for key, b in tiers.dram.oldest_first():
        assert key not in writing, f"{key.hex()} is both stored and reserved"
        owned[(b.slot_bytes, b.slot_id)] += 1
    pins: Counter[NamespacedKey] = Counter(inflight_pins)
    named: dict[NamespacedKey, str] = {}
    for lease in live:
        if isinstance(lease, ReadLease):
            pins.update(lease.keys)
            continue
        for block_hash, slot in zip(lease.hashes, lease.slots):
            if slot is not None:
                owned[(lease.slot_bytes, slot)] += 1
                if block_hash is not None:  # blank slots are named at commit
                    named[make_key(lease.namespace, block_hash)] = lease.lease_id
    assert named == writing, "reserved keys disagree with the live write leases"
    blank = sum(lease.slot_bytes * sum(s is not None for s in lease.slots)
                for lease in live if isinstance(lease, WriteLease) and lease.blank)
    assert blank == blank_bytes, "blank slots disagree with their leases"
    for p in promotions:
        owned[(p.slot_bytes, p.slot_id)] += 1
        assert p.source.pins > 0, f"promotion of {p.key.hex()} does not pin its source"
    assert all(n == 1 for n in owned.values()), "an arena slot has two owners"
    for c in tiers.classes:
        mine = sum(1 for size, _ in owned if size == c)
        assert mine == tiers.alloc.used_slots(c), (
            f"class {c}: allocator has {tiers.alloc.used_slots(c)} slots used, index {mine}")
    dram = {key: b.pins for key, b in tiers.dram.oldest_first()}
    for key, count in dram.items():
        assert count == pins.get(key, 0), (
            f"{key.hex()}: {count} pins but {pins.get(key, 0)} lease references")
    assert set(pins) <= set(dram), "a lease pins a ghost"
    ssd_pins = Counter(p.key for p in promotions)
    for key, e in tiers.disk.oldest_first():
        assert e.pins == ssd_pins.get(key, 0), f"{key.hex()}: SSD pins disagree"
    return owned
