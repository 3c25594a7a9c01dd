"""Tenants come from the connection: two bearer tokens over TCP never see each other's blocks
or engines."""

from __future__ import annotations

import os
from typing import Any

import grpc
import pytest

from tierd.wire.client import TierdClient


def test_two_tenants_over_tcp_are_isolated(make_daemon: Any, kit: Any, workdir: str) -> None:
    """Team A's stored blocks are misses for team B (same hashes, same layout); B using A's engine
    id or lease ids gets NOT_FOUND; each sees only its own engines; no token over TCP is
    UNAUTHENTICATED."""
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as f:
        f.write('"token-a" = "team-a"\n"token-b" = "team-b"\n')
    daemon = make_daemon(tcp_port=0, token_file=tokens)
    address = f"127.0.0.1:{daemon.daemon.tcp_port}"
    hashes = kit.chain(4)
    with TierdClient(address=address, token="token-a") as a, \
            TierdClient(address=address, token="token-b") as b, \
            TierdClient(address=address) as anonymous, daemon.client() as local:
        engine_a = a.register_engine(kit.layout, engine_name="a0")
        arena = kit.attach(engine_a)
        assert kit.store_blocks(a, engine_a, arena, hashes) == 4
        assert a.lookup(engine_a.engine_id, hashes) == ["dram"] * 4

        engine_b = b.register_engine(kit.layout, engine_name="b0")
        assert b.lookup(engine_b.engine_id, hashes) == []
        assert b.acquire(engine_b.engine_id, hashes).num_blocks == 0
        engine_local = local.register_engine(kit.layout)
        assert local.lookup(engine_local.engine_id, hashes) == []

        for call in (lambda: b.lookup(engine_a.engine_id, hashes),
                     lambda: b.reserve(engine_a.engine_id, hashes),
                     lambda: b.report_hot_blocks(engine_a.engine_id, cleared=True),
                     lambda: b.unregister_engine(engine_a.engine_id)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # A lease id is bound to the engine that took it: naming it from another tenant's
        # engine is NOT_FOUND, and the lease is untouched for its owner.
        lease_a = a.acquire(engine_a.engine_id, hashes)
        reserved_a = a.reserve(engine_a.engine_id, kit.chain(2, seed=7))
        for call in (lambda: b.release(engine_b.engine_id, lease_a.lease_id),
                     lambda: b.commit(engine_b.engine_id, reserved_a.lease_id, [False, False]),
                     lambda: b.abort(engine_b.engine_id, reserved_a.lease_id)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        a.release(engine_a.engine_id, lease_a.lease_id)
        a.abort(engine_a.engine_id, reserved_a.lease_id)
        with pytest.raises(grpc.RpcError) as info:
            anonymous.stats()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        assert [e.engine_name for e in a.stats().engines] == ["a0"]
        assert [e.engine_name for e in b.stats().engines] == ["b0"]
        assert a.lookup(engine_a.engine_id, hashes) == ["dram"] * 4
        arena.close()
    daemon.check_integrity()
