"""The node store's quota checks on leases: how much of a request a tenant may still hold, and
the ledger's side of every lease that begins or ends.

``tierd.daemon.quotas`` says what counts; this module applies it where the node store grants
and ends leases: an ``Acquire`` is cut to the blocks its tenant may still pin, a ``Reserve`` to
the slots it may still hold, and a request that gets nothing is RESOURCE_EXHAUSTED naming
``tenant_quotas``. Without quotas every limit is None and only the counting remains.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from tierd.daemon.errors import ResourceExhausted
from tierd.daemon.leases import Lease, ReadLease, WriteLease
from tierd.daemon.node_types import EngineInfo, Reservation
from tierd.daemon.quotas import HoldKind, QuotaLedger, QuotaTier
from tierd.types import Namespace, NamespacedKey
from tierd.wire.clip import clip
from tierd.wire.layout import NAMESPACE_LEN

if TYPE_CHECKING:
    from tierd.daemon.lru import DramBlock, LruIndex

B = TypeVar("B")


class QuotaGate:
    """The quota checks of one node store over its ``ledger`` (``dram``: the store's DRAM index,
    where leases' pinned blocks are). Not thread-safe: one event loop."""

    def __init__(self, ledger: QuotaLedger, dram: LruIndex[DramBlock], lease_seconds: float,
                 blank_fraction: float) -> None:
        self._ledger, self._dram = ledger, dram
        self._lease_seconds, self._blank_fraction = lease_seconds, blank_fraction

    def pin_limit(self, info: EngineInfo, keys: list[NamespacedKey], blocks: list[B],
                  first_held: Callable[[], bool]) -> tuple[list[NamespacedKey], list[B]]:
        """An acquire's chain (``keys``; ``blocks``: the DRAM run leading it) cut to as many
        blocks as the tenant may still pin; ResourceExhausted if none while the first block is
        held (``first_held``: in DRAM, on SSD or being read)."""
        room = self._ledger.room(info.tenant, info.geometry.slot_bytes)
        if room is None or room >= len(keys):
            return keys, blocks
        if room == 0 and (blocks or first_held()):
            raise self._refusal(info, blank=False)
        if len(blocks) > room:
            self._ledger.note_limited(info.tenant)
        return keys[:room], blocks[:room]

    def hold_limit(self, info: EngineInfo, count: int, kind: HoldKind) -> int | None:
        """How many slots a Reserve of ``count`` (``kind``: "reserved" or "blank") may take
        within the tenant's quota (None: all); ResourceExhausted if none (call after expiring
        overdue leases: they may free room)."""
        room = self._ledger.room(info.tenant, info.geometry.slot_bytes, kind == "blank")
        if room is None or room >= count:
            return None
        if room == 0:
            raise self._refusal(info, blank=kind == "blank")
        return room

    def reserved(self, info: EngineInfo, reservation: Reservation, kind: HoldKind,
                 limit: int | None, *, held: bool = False) -> Reservation:
        """Count a new reservation's slots against its tenant (``limit``: the cap on them from
        ``hold_limit``, noted if it bound; ``held``: counted already, by ``hold``)."""
        slots = len(reservation.slot_ids) - reservation.slot_ids.count(None)
        if limit is not None and slots == limit:
            self._ledger.note_limited(info.tenant)
        if not held:
            self.hold(info, kind, slots)
        return reservation

    def hold(self, info: EngineInfo, kind: HoldKind, slots: int) -> None:
        """Count ``slots`` a reservation of ``info``'s just took against its tenant."""
        if slots:
            self._ledger.hold(info.tenant, kind, slots * info.geometry.slot_bytes)

    def read_began(self, lease: ReadLease) -> None:
        """A read lease began (its blocks pinned): they count against its tenant."""
        self._ledger.hold(self._tenant(lease), "pinned", self._pinned(lease))

    def read_ended(self, lease: ReadLease) -> None:
        """A read lease ended (its blocks not yet gone): its pins no longer count."""
        self._ledger.hold(self._tenant(lease), "pinned", -self._pinned(lease))

    def write_ended(self, lease: WriteLease) -> None:
        """A write lease ended: its slots no longer count against its tenant."""
        slots = len(lease.slots) - lease.slots.count(None)
        if slots:
            self._ledger.hold(self._tenant(lease), "blank" if lease.blank else "reserved",
                              -slots * lease.slot_bytes)

    def check_integrity(self, live: Iterable[Lease],
                        held_keys: Mapping[QuotaTier, Sequence[NamespacedKey]]) -> None:
        """``QuotaLedger.check_integrity`` against the indexes' keys and what the ``live``
        leases hold."""
        holds: Counter[tuple[str, HoldKind]] = Counter()
        for lease in live:
            if isinstance(lease, ReadLease):
                holds[(self._tenant(lease), "pinned")] += self._pinned(lease)
            elif slots := sum(s is not None for s in lease.slots):
                kind: HoldKind = "blank" if lease.blank else "reserved"
                holds[(self._tenant(lease), kind)] += slots * lease.slot_bytes
        self._ledger.check_integrity(held_keys, holds)

    def _pinned(self, lease: ReadLease) -> int:
        """Bytes a read lease pins (one namespace: one block size)."""
        block = self._dram.get(lease.keys[0])
        assert block is not None, "a read lease of a block not in DRAM"
        return len(lease.keys) * block.slot_bytes

    def _tenant(self, lease: Lease) -> str:
        namespace = (lease.namespace if isinstance(lease, WriteLease)
                     else Namespace(lease.keys[0][:NAMESPACE_LEN]))
        tenant = self._ledger.tenant_of(namespace)
        assert tenant is not None, "a lease in a namespace no engine registered"
        return tenant

    def _refusal(self, info: EngineInfo, blank: bool) -> ResourceExhausted:
        ledger = self._ledger
        ledger.note_limited(info.tenant)
        quota = ledger.quota(info.tenant).dram
        what = (f"blank slots, blank_fraction ({self._blank_fraction:g}) of its DRAM quota of "
                f"{quota} bytes" if blank and ledger.room(info.tenant, info.geometry.slot_bytes)
                else f"pins and reservations, all of its DRAM quota of {quota} bytes")
        return ResourceExhausted(
            f"tenant {clip(info.tenant)} holds {ledger.held(info.tenant)} bytes: its {what} "
            f"(tenant_quotas) is taken: release leases, or wait for them to end (at most "
            f"{self._lease_seconds:g} s)")
