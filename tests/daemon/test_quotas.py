"""Per-tenant quotas on the node store: over-quota tenants pay for their own stores, a hostile
tenant's pins and blank slots stop at its quota, and the ledger agrees with the indexes.

The rig's arena holds 8 blocks of 1 KiB (one size class), its SSD 4 records; the rig's own
engine is tenant "default" (the well-behaved one), a second engine is tenant "hostile"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from node_rig import BLOCK, LAYOUT, Rig, chain

from tierd.daemon.config import load_config
from tierd.daemon.errors import ResourceExhausted
from tierd.daemon.quotas import Share, TenantQuotas
from tierd.wire.replies import TenantUsage

KIB = 1024


def quotas(**tenants: dict[str, Any]) -> TenantQuotas:
    """``tenant_quotas`` from keyword arguments (``star`` is "*")."""
    return TenantQuotas.parse({("*" if k == "star" else k): v for k, v in tenants.items()})


def store(rig: Rig, hashes: list[Any], engine: Any, step: int) -> None:
    """Store ``hashes`` ``step`` at a time (a tenant reserves at most its quota at once)."""
    for i in range(0, len(hashes), step):
        res = rig.store(hashes[i:i + step], engine)
        assert None not in res.slot_ids


def held(rig: Rig, hashes: list[Any], engine: Any = None) -> list[bool]:
    """Whether each hash is in DRAM, for ``engine`` (default: the rig's)."""
    engine = engine or rig.engine
    return [engine.namespace + h in {bytes(k) for k, _ in rig.node._tiers.dram.oldest_first()}
            for h in hashes]


def test_tenant_quotas_parse_from_toml_env_and_flag(tmp_path: Any) -> None:
    """The TOML table, the inline table of TIERD_TENANT_QUOTAS and a flag all parse; "*" is the
    share of tenants not named; sizes take units, shares a percent."""
    path = tmp_path / "tierd.toml"
    path.write_text('[tenant_quotas]\nteam-a = { dram = "512MiB", ssd = "4GiB" }\n'
                    '"*" = { dram = "10%" }\n')
    from_file = load_config(str(path), env={}).tenant_quotas
    from_env = load_config(env={"TIERD_TENANT_QUOTAS": '{ team-a = { dram = "512MiB", ssd = '
                                '"4GiB" }, "*" = { dram = "10%" } }'}).tenant_quotas
    assert from_file == from_env
    assert from_file.spec_for("team-a").dram == Share(512 << 20)  # type: ignore[union-attr]
    assert from_file.spec_for("team-a").ssd == Share(4 << 30)  # type: ignore[union-attr]
    other = from_file.spec_for("team-z")
    assert other is not None and other.dram == Share(0.1, of_tier=True) and other.ssd is None
    assert not load_config(env={}).tenant_quotas            # none by default: plain LRU
    flag = load_config(env={}, overrides={"tenant_quotas": '{ b = { ssd = 1024 } }'})
    assert flag.tenant_quotas.spec_for("b").ssd == Share(1024)  # type: ignore[union-attr]
    assert flag.tenant_quotas.spec_for("a") is None


@pytest.mark.parametrize(("raw", "message"), [
    ('{ a = { dram = "lots" } }', "tenant_quotas.a.dram"),
    ('{ a = { dram = "150%" } }', "0% to 100%"),
    ('{ a = { ram = "1GiB" } }', "dram and/or ssd"),
    ('{ a = 5 }', "dram and/or ssd"),
    ('{ a = { dram = 0.5 } }', "share of the tier ('25%')"),
    ("team-a = 1GiB", "inline TOML table"),
])
def test_bad_tenant_quotas_name_the_fix(raw: str, message: str) -> None:
    """A bad entry is a ValueError naming the entry and how to write it."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(env={"TIERD_TENANT_QUOTAS": raw})


async def test_tenant_over_quota_evicts_its_own_blocks_first(make_rig: Callable[..., Rig]
                                                            ) -> None:
    """With the arena full, a hostile tenant over its quota storing more evicts its own least
    recently used blocks, not the well-behaved tenant's older ones (plain LRU's victims)."""
    rig = make_rig(tenant_quotas=quotas(default={"dram": 4 * BLOCK}, hostile={"dram": 2 * BLOCK}))
    hostile = rig.node.register_engine("hostile", LAYOUT, "h")
    well, bad = chain(3, "w"), chain(7, "h")
    rig.store(well)                                  # oldest in DRAM
    store(rig, bad[:5], hostile, 2)                  # fills the arena: 5 > its 2 blocks
    rig.store(bad[5:], hostile)                      # needs 2 slots
    assert held(rig, well) == [True] * 3
    assert held(rig, bad, hostile) == [False, False] + [True] * 5
    usage = {u.tenant: u for u in rig.node.tenants()}
    assert (usage["hostile"].dram_bytes, usage["hostile"].dram_quota) == (5 * BLOCK, 2 * BLOCK)
    assert (usage["default"].dram_bytes, usage["default"].dram_quota) == (3 * BLOCK, 4 * BLOCK)
    rig.node.check_integrity()


async def test_a_full_tier_sheds_over_quota_tenants_first(make_rig: Callable[..., Rig]) -> None:
    """A tenant within its quota storing into a full arena evicts the over-quota tenant's blocks
    (newer than its own) until that tenant is back at its quota, then plain LRU."""
    rig = make_rig(tenant_quotas=quotas(default={"dram": 6 * BLOCK}, hostile={"dram": 4 * BLOCK}))
    hostile = rig.node.register_engine("hostile", LAYOUT, "h")
    well, bad = chain(5, "w"), chain(6, "h")
    rig.store(well[:2])
    store(rig, bad, hostile, 2)                      # 6 > 4: over by 2
    rig.store(well[2:])                              # needs 3 slots
    assert held(rig, bad, hostile) == [False, False, True, True, True, True]
    assert held(rig, well) == [False, True, True, True, True]  # then its own LRU
    rig.node.check_integrity()


async def test_hostile_pins_and_blank_slots_stop_at_its_quota(make_rig: Callable[..., Rig]
                                                             ) -> None:
    """A hostile tenant abandoning leases and spamming blank slots holds at most its quota
    (past it: RESOURCE_EXHAUSTED naming tenant_quotas), blank slots at most blank_fraction of
    it; the well-behaved tenant still gets its whole share of slots and of the blank budget at
    once, and one lease later the hostile tenant holds nothing."""
    rig = make_rig(tenant_quotas=quotas(default={"dram": 4 * BLOCK}, hostile={"dram": 4 * BLOCK}),
                   blank_fraction=0.5, lease_seconds=30.0)
    hostile = rig.node.register_engine("hostile", LAYOUT, "h")
    bad = chain(8, "h")
    store(rig, bad, hostile, 4)                       # the whole arena, from slack
    first = await rig.node.acquire(hostile.engine_id, bad[:3])      # abandoned leases
    cut = await rig.node.acquire(hostile.engine_id, bad[3:])        # cut to its last block
    assert (len(first.slot_ids), len(cut.slot_ids)) == (3, 1)
    with pytest.raises(ResourceExhausted, match="tenant_quotas"):
        await rig.node.acquire(hostile.engine_id, bad[4:])
    with pytest.raises(ResourceExhausted, match="all of its DRAM quota of 4096 bytes"):
        rig.node.reserve_blank(hostile.engine_id, 100)
    rig.node.release(cut.lease_id, engine_id=hostile.engine_id)
    blank = rig.node.reserve_blank(hostile.engine_id, 100)          # what its quota has left
    assert sum(s is not None for s in blank.slot_ids) == 1
    mine = rig.node.reserve_blank(rig.engine.engine_id, 2)          # its share of the budget
    assert sum(s is not None for s in mine.slot_ids) == 2
    rig.node.abort(mine.lease_id)
    well = chain(4, "w")
    res = rig.store(well)                                           # its whole share
    assert res.slot_ids.count(None) == 0 and held(rig, well) == [True] * 4
    rows = {u.tenant: u for u in rig.node.tenants()}
    assert rows["hostile"].pinned_bytes == 3 * BLOCK
    assert rows["hostile"].limited >= 2
    rig.node.check_integrity()
    rig.clock.advance(30.0)                                         # one lease later
    assert rig.node.tenants("hostile") == [TenantUsage("hostile", rows["hostile"].dram_bytes
                                                       - rows["hostile"].blank_bytes, 4 * BLOCK,
                                                       0, None, 0, 0, 0, rows["hostile"].limited)]
    rig.node.check_integrity()


async def test_blank_budget_is_shared_by_quota(make_rig: Callable[..., Rig]) -> None:
    """Blank-slot spam of one tenant takes at most blank_fraction of its own quota, so the next
    tenant's blank Reserve still gets slots (without quotas the spammer takes the whole
    budget and the next tenant gets none)."""
    rig = make_rig(tenant_quotas=quotas(star={"dram": "50%"}), blank_fraction=0.5)
    hostile = rig.node.register_engine("hostile", LAYOUT, "h")
    spam = rig.node.reserve_blank(hostile.engine_id, 8)
    assert sum(s is not None for s in spam.slot_ids) == 2          # 0.5 x its 4 blocks
    mine = rig.node.reserve_blank(rig.engine.engine_id, 8)
    assert sum(s is not None for s in mine.slot_ids) == 2
    rig.node.check_integrity()
    rig.node.abort(spam.lease_id, engine_id=hostile.engine_id)
    rig.node.abort(mine.lease_id)


async def test_ssd_over_quota_tenant_drops_its_own_records_first(make_rig: Callable[..., Rig]
                                                                ) -> None:
    """With the SSD full, the write-behind of an over-quota tenant's blocks drops that tenant's
    own records, not the within-quota tenant's older ones (plain LRU's victims)."""
    rig = make_rig(tenant_quotas=quotas(default={"ssd": 2 * BLOCK}, hostile={"ssd": 2 * BLOCK}),
                   write_behind_seconds=1.0)
    hostile = rig.node.register_engine("hostile", LAYOUT, "h")
    well, bad = chain(2, "w"), chain(4, "h")
    rig.store(well)
    assert await rig.node.write_behind() == 2                    # the oldest records
    rig.store(bad[:2], hostile)
    assert await rig.node.write_behind() == 2                    # the SSD is full
    rig.store(bad[2:], hostile)
    assert await rig.node.write_behind() == 2                    # 4 > its 2 records
    on_ssd = {bytes(k) for k, _ in rig.node._tiers.disk.oldest_first()}
    assert on_ssd == {rig.engine.namespace + h for h in well} | {
        hostile.namespace + h for h in bad[2:]}
    rows = {u.tenant: u for u in rig.node.tenants()}
    assert (rows["hostile"].ssd_bytes, rows["default"].ssd_bytes) == (2 * BLOCK, 2 * BLOCK)
    rig.node.check_integrity()


async def test_usage_follows_blocks_through_every_path(make_rig: Callable[..., Rig]) -> None:
    """Commits, aborts, expiry, demotion, promotion and unregistering keep the ledger equal to
    the indexes and leases (check_integrity after each step); a tenant without a quota has no
    bound and shows None."""
    rig = make_rig(tenant_quotas=quotas(hostile={"dram": 2 * BLOCK, "ssd": KIB}),
                   blank_fraction=1.0)
    hostile = rig.node.register_engine("hostile", LAYOUT, "h")
    rig.store(chain(4, "w"))
    rig.node.check_integrity()
    res = rig.node.reserve(hostile.engine_id, chain(2, "h"))
    assert rig.node.tenants("hostile")[0].reserved_bytes == 2 * BLOCK
    rig.node.check_integrity()
    rig.node.abort(res.lease_id, engine_id=hostile.engine_id)
    store(rig, chain(3, "h"), hostile, 2)
    rig.clock.advance(31.0)
    await rig.node.maintain()
    rig.node.check_integrity()
    rig.node.reserve_blank(hostile.engine_id, 1)
    rig.clock.advance(31.0)
    rig.node.stats()                                              # expires it
    rig.node.check_integrity()
    rig.store(chain(8, "x"))                                      # demotes / evicts the rest
    rig.node.check_integrity()
    lease = await rig.node.acquire(rig.engine.engine_id, chain(4, "w"))
    rig.node.check_integrity()
    rig.node.release(lease.lease_id)
    rig.node.unregister_engine(hostile.engine_id)
    rig.node.check_integrity()
    row = rig.node.tenants("default")[0]
    assert (row.dram_quota, row.ssd_quota, row.pinned_bytes) == (None, None, 0)


async def test_promotion_for_an_over_quota_tenant_evicts_its_own_blocks(
        make_rig: Callable[..., Rig]) -> None:
    """A hostile tenant over its quota acquiring its blocks back from SSD into a full arena
    makes room out of its own DRAM blocks, not the well-behaved tenant's older ones."""
    rig = make_rig(tenant_quotas=quotas(default={"dram": 4 * BLOCK}, hostile={"dram": 2 * BLOCK}),
                   write_behind_seconds=1.0)
    hostile = rig.node.register_engine("hostile", LAYOUT, "h")
    well, bad = chain(2, "w"), chain(8, "h")
    rig.store(well)
    store(rig, bad[:2], hostile, 2)
    assert await rig.node.write_behind() == 4                    # every block has an SSD copy
    store(rig, bad[2:], hostile, 2)                              # demotes its own h0, h1
    assert held(rig, bad[:2], hostile) == [False, False] and held(rig, well) == [True, True]
    lease = await rig.node.acquire(hostile.engine_id, bad[:2])   # read back from SSD
    assert len(lease.slot_ids) == 2
    assert held(rig, well) == [True, True]
    assert held(rig, bad, hostile) == [True, True, False, False] + [True] * 4
    rig.node.check_integrity()
    rig.node.release(lease.lease_id, engine_id=hostile.engine_id)
