"""QuotaEviction's order on a hand-built DRAM index: the storing tenant's own blocks when it is
over its quota, then over-quota tenants', then (only for a tenant within its quota) plain LRU."""

from __future__ import annotations

from tierd.daemon.lru import DramBlock, LruIndex
from tierd.daemon.quota_eviction import QuotaEviction
from tierd.daemon.quotas import QuotaLedger, TenantQuotas
from tierd.types import BlockHash, Namespace, NamespacedKey, make_key

BLOCK = 1024
WELL, HOSTILE, OTHER = (Namespace(bytes([n]) * 16) for n in (1, 2, 3))


def setup(blocks: list[tuple[Namespace, int, int]]) -> tuple[QuotaLedger, LruIndex[DramBlock]]:
    """A ledger (well 4 blocks, hostile 2, other 2) and an index of ``blocks`` (namespace, id,
    pins), oldest first, each told to the ledger."""
    ledger = QuotaLedger(TenantQuotas.parse({"well": {"dram": 4 * BLOCK},
                                             "hostile": {"dram": 2 * BLOCK},
                                             "other": {"dram": 2 * BLOCK}}),
                         8 * BLOCK, 0, 0.25)
    for namespace, tenant in ((WELL, "well"), (HOSTILE, "hostile"), (OTHER, "other")):
        ledger.register(namespace, tenant, BLOCK)
    dram: LruIndex[DramBlock] = LruIndex()
    for namespace, n, pins in blocks:
        key = key_of(namespace, n)
        dram.add(key, DramBlock(namespace, BlockHash(bytes([n]) * 32), BLOCK, n, 0, 0.0, 0.0,
                                pins=pins))
        ledger.stored([key], "dram")
    return ledger, dram


def key_of(namespace: Namespace, n: int) -> NamespacedKey:
    return make_key(namespace, BlockHash(bytes([n]) * 32))


def test_over_quota_tenant_never_evicts_a_tenant_within_its_share() -> None:
    """Hostile is over its quota with every block pinned: storing, it gets no victim at all,
    though the well-behaved tenant's blocks are older and unpinned."""
    ledger, dram = setup([(WELL, 0, 0), (WELL, 1, 0), (HOSTILE, 2, 1), (HOSTILE, 3, 1),
                          (HOSTILE, 4, 1)])
    policy = QuotaEviction(ledger)
    assert ledger.over("hostile", "dram") and not ledger.over("well", "dram")
    assert policy.dram_victims(dram, BLOCK, 2, HOSTILE) == []
    assert policy.dram_victim_other_class(dram, 2 * BLOCK, HOSTILE) is None
    assert policy.dram_victims(dram, BLOCK, 2, WELL) == [key_of(WELL, 0), key_of(WELL, 1)]


def test_order_own_then_over_quota_then_lru() -> None:
    """Over its quota, a tenant takes its own LRU blocks first, then another over-quota
    tenant's (only while that one stays over); within its quota (the new slots included), a
    tenant takes over-quota blocks first and then plain LRU."""
    ledger, dram = setup([(WELL, 0, 0), (OTHER, 1, 0), (OTHER, 2, 0), (OTHER, 3, 0),
                          (HOSTILE, 4, 0), (HOSTILE, 5, 0), (HOSTILE, 6, 0)])
    policy = QuotaEviction(ledger)
    own_first = [key_of(HOSTILE, 4), key_of(HOSTILE, 5), key_of(HOSTILE, 6), key_of(OTHER, 1)]
    assert policy.dram_victims(dram, BLOCK, 5, HOSTILE) == own_first   # other: 3 > 2, one goes
    assert policy.dram_victims(dram, BLOCK, 3, WELL) == [
        key_of(OTHER, 1), key_of(HOSTILE, 4), key_of(WELL, 0)]
    assert policy.dram_victims(dram, BLOCK, 4, WELL)[0] == key_of(WELL, 0)  # 5 > its 4 blocks
    assert [k for k, _ in policy.demotion_order(dram)][:2] == [key_of(OTHER, 1),
                                                               key_of(HOSTILE, 4)]


def test_without_anyone_over_quota_the_choice_is_plain_lru() -> None:
    """Nobody over a quota (the new slots included): the victims are LRU's, whoever stores."""
    ledger, dram = setup([(WELL, 0, 0), (HOSTILE, 1, 0), (OTHER, 2, 0)])
    policy = QuotaEviction(ledger)
    assert policy.dram_victims(dram, BLOCK, 1, HOSTILE) == [key_of(WELL, 0)]
    assert policy.dram_victims(dram, BLOCK, 2, WELL) == [key_of(WELL, 0), key_of(HOSTILE, 1)]
    assert [k for k, _ in policy.demotion_order(dram)] == [key_of(WELL, 0), key_of(HOSTILE, 1),
                                                          key_of(OTHER, 2)]
