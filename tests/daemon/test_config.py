"""`tierd serve`'s configuration: defaults < TOML file < TIERD_* env < flags, and the checks."""

from __future__ import annotations

import argparse
import os

import pytest

from tierd.commands import serve
from tierd.daemon.auth import Authenticator, TokenTable, bearer_token
from tierd.daemon.config import keys, load_config, parse_bytes
from tierd.daemon.errors import Unauthenticated


def test_laptop_defaults(tmp_path: str) -> None:
    """With no file, env or flag: DRAM 1 GiB, SSD under the cache dir bounded at 8 GiB, Unix
    socket only, leases 30 s."""
    config = load_config(env={"XDG_CACHE_HOME": "/home/u/.cache"})
    assert config.dram_bytes == 1 << 30 and config.ssd_bytes == 8 << 30
    assert config.ssd_dir == "/home/u/.cache/tierd/ssd"
    assert config.socket_path == "/home/u/.cache/tierd/tierd.sock"
    assert (config.tcp_port, config.metrics_port, config.lease_seconds) == (None, None, 30.0)


def test_flags_win_over_env_over_file(tmp_path: str) -> None:
    """dram_bytes comes from the flag, ssd_bytes from env, lease_seconds from the file."""
    path = os.path.join(tmp_path, "tierd.toml")
    with open(path, "w") as f:
        f.write('dram_bytes = "256MiB"\nssd_bytes = "1GiB"\nlease_seconds = 5\n')
    env = {"TIERD_SSD_BYTES": "2GiB", "TIERD_DRAM_BYTES": "512MiB", "TIERD_CONNECTOR_MODE": "x"}
    config = load_config(path, env=env, overrides={"dram_bytes": "128MiB", "ssd_dir": None})
    assert (config.dram_bytes, config.ssd_bytes, config.lease_seconds) == (128 << 20, 2 << 30, 5.0)


def test_serve_flags_reach_the_config() -> None:
    """`tierd serve --dram-bytes 2GiB --no-prefault --tcp-port 0 --token-file t` parses into the
    config; unset flags stay at their defaults."""
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    args = parser.parse_args(["--dram-bytes", "2GiB", "--no-prefault", "--tcp-port", "0",
                              "--token-file", "t"])
    config = load_config(None, env={}, overrides={k: getattr(args, k) for k in keys()})
    assert (config.dram_bytes, config.prefault, config.tcp_port, config.token_file) == (
        2 << 30, False, 0, "t")
    assert config.allow_remote is False
    assert all(action.help for action in parser._actions)


def test_bad_values_name_the_fix(tmp_path: str) -> None:
    """Non-loopback TCP without --allow-remote, TCP without tokens, an unknown TOML key, a bad
    size, inverted watermarks, an engine idle time shorter than a lease and a presence filter
    size that is not a power of two each raise ValueError naming the key."""
    cases: list[tuple[dict[str, object], str]] = [
        ({"tcp_port": 7000, "tcp_host": "0.0.0.0", "token_file": "t"}, "--allow-remote"),
        ({"tcp_port": 7000}, "token_file"),
        ({"dram_bytes": "lots"}, "dram_bytes"),
        ({"dram_low_watermark": 0.9, "dram_high_watermark": 0.5}, "dram_low_watermark"),
        ({"engine_idle_seconds": 20.0}, r"engine_idle_seconds \(20.0\) must be >= lease_seconds"),
        ({"presence_cells": 1000}, "presence_cells=1000 .*or 0 for no filter")]
    for overrides, fix in cases:
        with pytest.raises(ValueError, match=fix):
            load_config(None, env={}, overrides=overrides)
    assert load_config(None, env={}, overrides={"tcp_port": 7000, "tcp_host": "0.0.0.0",
                                                "token_file": "t", "allow_remote": True})
    path = os.path.join(tmp_path, "bad.toml")
    with open(path, "w") as f:
        f.write("dram_gigs = 3\n")
    with pytest.raises(ValueError, match="dram_gigs"):
        load_config(path, env={})


def test_parse_bytes() -> None:
    """Units are binary with an i, decimal without."""
    assert [parse_bytes(v) for v in ("4096", "64KiB", "1.5GB", "8GiB", 7)] == [
        4096, 65536, 1_500_000_000, 8 << 30, 7]


def test_tenant_resolution(tmp_path: str) -> None:
    """Unix without token: default tenant; TCP without token, an unknown token or a non-bearer
    header: Unauthenticated; a known token: its tenant on either transport."""
    path = os.path.join(tmp_path, "tokens.toml")
    with open(path, "w") as f:
        f.write('"tok-a" = "team-a"\n')
    auth = Authenticator(TokenTable.load(path), "default")
    bearer = [("authorization", "Bearer tok-a")]
    assert auth.tenant("unix:/run/tierd.sock", []) == "default"
    assert auth.tenant("ipv4:127.0.0.1:5000", bearer) == "team-a"
    assert auth.tenant("unix:", bearer) == "team-a"
    for peer, md in (("ipv4:127.0.0.1:5000", []), ("unix:", [("authorization", "Bearer nope")]),
                     ("ipv6:[::1]:5000", [("authorization", "tok-a")])):
        with pytest.raises(Unauthenticated):
            auth.tenant(peer, md)
    assert bearer_token([("x-other", "1")]) is None


def test_node_config_takes_every_shared_key() -> None:
    """Each NodeConfig key that `tierd serve` has reaches the node store with its value, the
    engine caps too; the node store's own checks run at load (inverted watermarks)."""
    config = load_config(None, env={}, overrides={
        "lease_seconds": 7.0, "dram_high_watermark": 0.8, "dram_low_watermark": 0.6,
        "ssd_min_hits": 2, "max_blocks_per_request": 99, "write_behind_seconds": 0.5,
        "stop_flush_seconds": 3.0, "engine_idle_seconds": 11.0, "max_engines_per_tenant": 5,
        "max_name_bytes": 64})
    node = config.node_config()
    assert (node.lease_seconds, node.dram_high_watermark, node.dram_low_watermark,
            node.ssd_min_hits, node.max_blocks_per_request, node.write_behind_seconds,
            node.stop_flush_seconds) == (7.0, 0.8, 0.6, 2, 99, 0.5, 3.0)
    assert (node.engines.idle_seconds, node.engines.max_per_tenant,
            node.engines.max_name_bytes) == (11.0, 5, 64)
    assert node.event_log_events == 0
    with pytest.raises(ValueError, match="ssd_min_hits"):
        load_config(None, env={}, overrides={"ssd_min_hits": -1})


def test_table_bounds_come_from_the_environment() -> None:
    """The bounds of the daemon's tables are TIERD_* variables (byte sizes with units) that
    reach the node store; a lease-block cap below one full request is refused naming both."""
    config = load_config(None, env={
        "TIERD_MAX_LEASES_PER_ENGINE": "8", "TIERD_MAX_LEASES": "64",
        "TIERD_MAX_LEASE_KEYS": "8192", "TIERD_MIN_BLOCK_BYTES": "4KiB",
        "TIERD_BLOCK_OVERHEAD_BYTES": "1KiB", "TIERD_MAX_SIZE_CLASSES": "3"})
    node = config.node_config()
    assert (node.max_leases_per_engine, node.max_leases, node.max_lease_keys,
            node.min_block_bytes, node.max_size_classes) == (8, 64, 8192, 4096, 3)
    assert config.block_overhead_bytes == 1024
    with pytest.raises(ValueError, match="max_lease_keys .* max_blocks_per_request"):
        load_config(None, env={"TIERD_MAX_LEASE_KEYS": "100"})
    with pytest.raises(ValueError, match="block_overhead_bytes"):
        load_config(None, env={"TIERD_BLOCK_OVERHEAD_BYTES": "-1"})
