"""Tenant quotas through the gRPC edge: each tenant's Stats shows its own use against its quota,
the admin token every tenant's (and nothing else), pins past a quota are RESOURCE_EXHAUSTED
naming it, and the metrics are labelled by tenant name only."""

from __future__ import annotations

import argparse
import os
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from tierd.commands import stats as stats_cmd
from tierd.daemon.config import TierdConfig
from tierd.daemon.quotas import TenantQuotas
from tierd.daemon.server import Daemon
from tierd.wire.client import TierdClient

QUOTAS = TenantQuotas.parse({"team-a": {"dram": "64KiB", "ssd": "1MiB"}, "*": {"dram": "25%"}})


def write_tokens(workdir: str) -> str:
    path = os.path.join(workdir, "tokens.toml")
    with open(path, "w") as f:
        f.write('"token-a" = "team-a"\n"token-b" = "team-b"\n')
    return path


def test_stats_show_each_tenant_its_own_usage_and_the_admin_all(
        make_daemon: Any, kit: Any, workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Team A sees one tenant row, its own (2 blocks of 4 KiB against its 64 KiB and 1 MiB);
    team B its own (the default share: 25% of the 16 MiB arena, no SSD bound); the admin token
    sees both rows and neither engines nor models, and is UNAUTHENTICATED for anything else;
    `tierd stats` prints the tenant table; the metrics name tenants, never tokens or engine
    ids."""
    daemon = make_daemon(tcp_port=0, token_file=write_tokens(workdir), tenant_quotas=QUOTAS,
                         admin_token="admin-secret")
    address = f"127.0.0.1:{daemon.daemon.tcp_port}"
    with TierdClient(address=address, token="token-a") as a, \
            TierdClient(address=address, token="token-b") as b, \
            TierdClient(address=address, token="admin-secret") as admin:
        engine_a = a.register_engine(kit.layout, engine_name="a0")
        arena = kit.attach(engine_a)
        assert kit.store_blocks(a, engine_a, arena, kit.chain(2)) == 2
        engine_b = b.register_engine(kit.layout, engine_name="b0")
        lease = b.acquire(engine_b.engine_id, kit.chain(2))     # a miss: nothing pinned
        assert lease.num_blocks == 0

        (row_a,) = a.stats().tenants
        assert (row_a.tenant, row_a.dram_bytes, row_a.dram_quota, row_a.ssd_quota) == (
            "team-a", 2 * 4096, 64 << 10, 1 << 20)
        (row_b,) = b.stats().tenants
        assert (row_b.tenant, row_b.dram_bytes, row_b.dram_quota, row_b.ssd_quota) == (
            "team-b", 0, 4 << 20, None)
        seen = admin.stats()
        assert [t.tenant for t in seen.tenants] == ["team-a", "team-b"]
        assert (seen.engines, seen.models) == ([], [])
        with pytest.raises(grpc.RpcError) as info:
            admin.register_engine(kit.layout)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Stats only" in (info.value.details() or "")
        arena.close()

    parser = argparse.ArgumentParser()
    stats_cmd.configure(parser)
    args = parser.parse_args(["--address", address, "--token", "token-a"])
    assert stats_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert "tenants (used/quota)" in out and "team-a" in out and "team-b" not in out

    metrics = generate_latest(daemon.daemon.store.metrics.registry).decode()
    assert 'tierd_tenant_used_bytes{tenant="team-a",tier="dram"} 8192.0' in metrics
    assert 'tierd_tenant_quota_bytes{tenant="team-a",tier="dram"} 65536.0' in metrics
    tenant_lines = [line for line in metrics.splitlines() if line.startswith("tierd_tenant_")]
    assert not any("token" in line or engine_a.engine_id in line or engine_b.engine_id in line
                   or "admin" in line for line in tenant_lines)


def test_pins_past_the_quota_are_resource_exhausted(make_daemon: Any, kit: Any,
                                                    workdir: str) -> None:
    """Team A (64 KiB: 16 blocks) stores 16 blocks and abandons a lease on all of them: its next
    Acquire is RESOURCE_EXHAUSTED naming tenant_quotas, its blank Reserve too; the default
    tenant over the socket still stores its blocks."""
    daemon = make_daemon(tcp_port=0, token_file=write_tokens(workdir), tenant_quotas=QUOTAS)
    address = f"127.0.0.1:{daemon.daemon.tcp_port}"
    chain = kit.chain(16)
    with TierdClient(address=address, token="token-a") as a, daemon.client() as local:
        engine = a.register_engine(kit.layout)
        arena = kit.attach(engine)
        assert kit.store_blocks(a, engine, arena, chain) == 16
        assert a.acquire(engine.engine_id, chain).num_blocks == 16          # never released
        for call in (lambda: a.acquire(engine.engine_id, chain),
                     lambda: a.reserve_blank_async(engine.engine_id, 4).result()):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant_quotas" in (info.value.details() or "")
        mine = local.register_engine(kit.layout)
        assert kit.store_blocks(local, mine, arena, kit.chain(8, seed=5)) == 8
        (row,) = a.stats().tenants
        assert (row.pinned_bytes, row.limited) == (16 * 4096, 2)
        arena.close()


async def test_admin_token_must_differ_from_tenant_tokens(workdir: str) -> None:
    """An admin_token that is also a tenant's token stops the start with a ValueError."""
    config = TierdConfig(socket_path=os.path.join(workdir, "t.sock"), dram_bytes=1 << 20,
                         slab_bytes=64 << 10, prefault=False, ssd_dir="",
                         token_file=write_tokens(workdir), admin_token="token-a")
    with pytest.raises(ValueError, match="admin its own token"):
        await Daemon.start(config)
