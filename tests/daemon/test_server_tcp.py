"""The TCP listener: every Tierd call over TCP needs the bearer token (tcp_token or the token
file), UNAUTHENTICATED otherwise; no TCP listener starts without a token."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tierd.daemon.config import TierdConfig
from tierd.wire.client import TierdClient


def test_tcp_call_needs_the_token(make_daemon: Any, kit: Any) -> None:
    """On 127.0.0.1:free port with tcp_token: no token and a wrong one are UNAUTHENTICATED; the
    token is the default tenant, who sees the engine registered over the socket."""
    running = make_daemon(tcp_port=0, tcp_token="s3cret")
    address = f"127.0.0.1:{running.daemon.tcp_port}"
    with running.client() as local:
        engine = local.register_engine(kit.layout, "local")
    for token, details in ((None, "a bearer token is required over TCP"),
                           ("wrong", "unknown bearer token")):
        with TierdClient(address=address, token=token, timeout=10.0) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.stats()
            assert (err.value.code(), details in err.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, True)
    with TierdClient(address=address, token="s3cret", timeout=10.0) as client:
        assert [e.engine_id for e in client.stats().engines] == [engine.engine_id]


def test_tcp_without_a_token_is_refused() -> None:
    """A TCP listener with neither tcp_token nor token_file is a config error naming both."""
    with pytest.raises(ValueError, match=r"TCP needs bearer tokens: set tcp_token "
                                         r"\(TIERD_TCP_TOKEN\) or token_file"):
        TierdConfig(tcp_port=0).validate()


@pytest.mark.parametrize(("node_address", "tcp_host", "tcp_port", "published"), [
    ("10.0.0.5", "0.0.0.0", 50051, "10.0.0.5:50051"),
    ("10.0.0.5:7000", "0.0.0.0", 50051, "10.0.0.5:7000"),
    ("fd00::5", "::", 50051, "[fd00::5]:50051"),
    ("", "127.0.0.1", 50051, "127.0.0.1:50051"),
    ("", "127.0.0.1", None, "unix:/run/t.sock"),
])
def test_published_address(node_address: str, tcp_host: str, tcp_port: int | None,
                           published: str) -> None:
    """A bare node_address gets the bound TCP port; a full one is kept; else where it listens."""
    config = TierdConfig(node_address=node_address, tcp_host=tcp_host, socket_path="/run/t.sock")
    assert config.published_address(tcp_port) == published


def test_undialable_node_address_is_refused() -> None:
    """With a cluster: a bare node_address without TCP, or a wildcard tcp_host with no
    node_address, is refused naming the fix."""
    cluster = dict(redis_url="redis://127.0.0.1:1/0", tcp_token="t")
    with pytest.raises(ValueError, match="node_address '10.0.0.5' has no port and the daemon "
                                         "listens on no TCP port"):
        TierdConfig(node_address="10.0.0.5", **cluster).validate()
    with pytest.raises(ValueError, match="set node_address to this node's address"):
        TierdConfig(tcp_port=50051, tcp_host="0.0.0.0", allow_remote=True, **cluster).validate()
    TierdConfig(node_address="10.0.0.5", tcp_port=50051, tcp_host="0.0.0.0", allow_remote=True,
                **cluster).validate()
