"""Which blocks leave a tier first under ``tenant_quotas``: ``QuotaEviction``.

The node's ``LruEviction`` with the tenants' quotas (``tierd.daemon.quotas.QuotaLedger``) put
first. Every choice is still least recently used first within a group, never a pinned or
demoting block; the groups, in order:

1. making room for a tenant over its quota (the new slot or record included): its own blocks;
2. blocks of tenants over their quota (each only while it stays over with the victims so far
   taken), unknown tenants' blocks among them;
3. any block, but only for a tenant within its quota (or for no tenant: the SSD's bound shrank,
   or the flusher demotes).

So a tenant over its quota makes room only out of its own blocks and those of other tenants over
theirs, never out of a tenant within its share; and a full tier sheds over-quota tenants first
(demotion included). Without any tenant over its quota the choice is plain LRU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from tierd.daemon.eviction import LruEviction
from tierd.daemon.quotas import QuotaLedger, QuotaTier
from tierd.types import Namespace, NamespacedKey

if TYPE_CHECKING:
    from tierd.daemon.lru import DramBlock, LruIndex, SsdBlock

E = TypeVar("E", "DramBlock", "SsdBlock")
K = TypeVar("K")
V = TypeVar("V")


class QuotaEviction(LruEviction):
    """``LruEviction`` with over-quota tenants first (see the module doc). Reads the ledger;
    changes nothing."""

    def __init__(self, ledger: QuotaLedger) -> None:
        self._ledger = ledger

    def dram_victims(self, dram: LruIndex[DramBlock], slot_bytes: int, count: int,
                     owner: Namespace | None = None) -> list[NamespacedKey]:
        return self._dram(dram, lambda b: b.slot_bytes == slot_bytes, count, owner,
                          count * slot_bytes)

    def dram_victim_other_class(self, dram: LruIndex[DramBlock], slot_bytes: int,
                                owner: Namespace | None = None) -> NamespacedKey | None:
        found = self._dram(dram, lambda b: b.slot_bytes != slot_bytes, 1, owner, slot_bytes)
        return found[0] if found else None

    def demotion_order(self, dram: LruIndex[DramBlock]) -> Iterator[tuple[NamespacedKey,
                                                                           DramBlock]]:
        """Over-quota tenants' blocks first (each while it stays over), then the rest, each
        group least recently used first."""
        if not self._ledger.over_tenants("dram"):
            return dram.oldest_first()
        first: list[tuple[NamespacedKey, DramBlock]] = []
        rest: list[tuple[NamespacedKey, DramBlock]] = []
        taken: Counter[str | None] = Counter()
        for key, block in dram.oldest_first():
            tenant = self._ledger.tenant_of(block.namespace)
            if self.evictable(block) and self._ledger.over(tenant, "dram", -taken[tenant]):
                taken[tenant] += block.slot_bytes
                first.append((key, block))
            else:
                rest.append((key, block))
        return iter(first + rest)

    def ssd_victims(self, disk: LruIndex[SsdBlock], need_bytes: int,
                    writers: Sequence[Namespace] = ()) -> list[NamespacedKey]:
        """Unpinned SSD records whose stored bytes add up to at least ``need_bytes`` (or all
        that may go), for records of ``writers``' namespaces (one per record to write)."""
        ledger = self._ledger
        extra: Counter[str | None] = Counter()
        for namespace in writers:
            extra[ledger.tenant_of(namespace)] += ledger.block_bytes(namespace)
        writers_over = {t for t, n in extra.items() if ledger.over(t, "ssd", n)}
        anyone = not writers or len(writers_over) < len(extra)
        if anyone and not ledger.over_tenants("ssd"):
            return super().ssd_victims(disk, need_bytes)
        groups = self._groups(disk.oldest_first(), "ssd", writers_over,
                              lambda e: e.pins == 0, lambda e: e.stored_bytes, anyone)
        victims: list[NamespacedKey] = []
        for key, entry in groups:
            if need_bytes <= 0:
                break
            victims.append(key)
            need_bytes -= entry.stored_bytes
        return victims

    def _dram(self, dram: LruIndex[DramBlock], fits: Callable[[DramBlock], bool], count: int,
              owner: Namespace | None, need_bytes: int) -> list[NamespacedKey]:
        ledger = self._ledger
        tenant = ledger.tenant_of(owner) if owner is not None else None
        owner_over = owner is not None and ledger.over(tenant, "dram", need_bytes)
        if not owner_over and not ledger.over_tenants("dram"):  # plain LRU
            return [k for k, _ in _first(dram.oldest_first(),
                                         lambda b: fits(b) and self.evictable(b), count)]
        owners = {tenant} if owner_over else set()
        groups = self._groups(dram.oldest_first(), "dram", owners,
                              lambda b: fits(b) and self.evictable(b), lambda b: b.slot_bytes,
                              not owner_over)
        return [k for k, _ in _first(groups, lambda b: True, count)]

    def _groups(
            self, entries: Iterator[tuple[NamespacedKey, E]], tier: QuotaTier,
            owners: set[str | None], may_go: Callable[[E], bool], size: Callable[[E], int],
            anyone: bool) -> Iterator[tuple[NamespacedKey, E]]:
        """The candidates of ``entries`` (LRU first) in the module doc's order: ``owners``'
        own blocks, then over-quota tenants' blocks, then (``anyone``) the rest. Lazy: the
        first group ends the walk early when it is all a caller takes."""
        ledger = self._ledger
        over: list[tuple[NamespacedKey, E]] = []
        rest: list[tuple[NamespacedKey, E]] = []
        taken: Counter[str | None] = Counter()
        tenants: dict[Namespace, str | None] = {}  # the ledger's answers, asked once per walk
        within: set[str | None] = set()  # within quota with none of theirs taken: stays so
        for key, entry in entries:
            namespace = entry.namespace
            try:
                tenant = tenants[namespace]
            except KeyError:
                tenant = tenants[namespace] = ledger.tenant_of(namespace)
            if tenant in within:  # a long run of such blocks costs two lookups each
                if anyone and may_go(entry):
                    rest.append((key, entry))
                continue
            if not may_go(entry):
                continue
            if tenant in owners:
                yield key, entry
            elif ledger.over(tenant, tier, -taken[tenant]):
                taken[tenant] += size(entry)
                over.append((key, entry))
            else:
                if not taken[tenant]:
                    within.add(tenant)
                if anyone:
                    rest.append((key, entry))
        yield from over
        yield from rest


def _first(entries: Iterator[tuple[K, V]], take: Callable[[V], bool],
           count: int) -> list[tuple[K, V]]:
    """The first ``count`` of ``entries`` that ``take`` accepts."""
    found: list[tuple[K, V]] = []
    for key, entry in entries:
        if len(found) == count:
            break
        if take(entry):
            found.append((key, entry))
    return found
