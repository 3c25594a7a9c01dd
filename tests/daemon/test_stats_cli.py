"""`tierd stats` against a real daemon: the table, --json, the hit ratio's reading, "pool too
small", and the message when no daemon runs."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import Any

import pytest
from rich.console import Console

from tierd.commands import stats as stats_cmd
from tierd.wire.replies import DaemonStats, TierUsage


def run_stats(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    stats_cmd.configure(parser)
    return stats_cmd.run(parser.parse_args(list(argv)))


def test_no_daemon_names_the_fix(workdir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """With nothing on the socket: exit 1 and a message saying to start `tierd serve` or pass
    --socket-path."""
    assert run_stats("--socket-path", os.path.join(workdir, "none.sock")) == 1
    err = capsys.readouterr().err
    assert "no daemon answers at unix:" in err and "`tierd serve`" in err and "--socket-path" in err


def test_json_and_table(daemon: Any, kit: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """After storing 3 blocks and looking up 4, --json shows 3 DRAM blocks, 64 queried / 48 hit
    tokens; the table shows every tier and the reading. A second model of the same shape that
    stored 1 block of the same chain has its own row: 3 blocks (12 KiB) and 1 block."""
    hashes = kit.chain(4)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout, engine_name="e0")
        arena = kit.attach(engine)
        kit.store_blocks(client, engine, arena, hashes[:3])
        client.report_hot_blocks(engine.engine_id, stored=hashes[:1])
        client.lookup(engine.engine_id, hashes)
        tuned = client.register_engine(replace(kit.layout, model_id="tuned@1"), engine_name="e1")
        assert client.lookup(tuned.engine_id, hashes) == []
        kit.store_blocks(client, tuned, arena, hashes[:1])
        arena.close()
    assert run_stats("--socket-path", daemon.config.socket_path, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    dram = next(t for t in data["tiers"] if t["tier"] == "dram")
    assert (dram["used_blocks"], dram["used_bytes"], dram["capacity_blocks"]) == (
        4, 16384, (16 << 20) // (4096 + 512))  # block_overhead_bytes counted per block
    assert (data["query_tokens"], data["hit_tokens"], data["hit_ratio"]) == (128, 48, 0.375)
    assert data["engines"][0]["hbm_blocks"] == 1 and data["pool_too_small"] is False
    assert [(m["model_id"], m["blocks"]["dram"], m["bytes"]["dram"], m["blocks"]["hbm"],
             m["query_tokens"], m["hit_tokens"], m["engines"]) for m in data["models"]] == [
        (kit.layout.model_id, 3, 12288, 1, 64, 48, 1), ("tuned@1", 1, 4096, 0, 64, 0, 1)]
    assert run_stats("--socket-path", daemon.config.socket_path) == 0
    out = capsys.readouterr().out
    for word in ("hbm", "dram", "ssd", "e0", "reading: hit ratio 0.38: ordinary",
                 "test-model", "tuned", "@1", "3 (12.0K)"):  # an id shows as label, @digest
        assert word in out


def _stats(gap: float | None, idle: float | None, ratio: float) -> DaemonStats:
    tier = TierUsage("dram", 10, 100, 40960, 409600, 0, 100, int(100 * ratio), 5, 0, 0)
    return DaemonStats(tiers=[tier], engines=[], models=[], query_tokens=100,
                       hit_tokens=int(100 * ratio), hit_ratio=ratio,
                       reading=f"hit ratio {ratio:.2f}: low", checksum_failures=0,
                       lease_expiries=0, ssd_healthy=True, reuse_gap_p90_seconds=gap,
                       idle_before_evict_p50_seconds=idle)


def test_pool_too_small_when_reuse_gap_p90_exceeds_idle_p50() -> None:
    """Reuse-gap P90 60 s > idle-before-evict P50 10 s prints "pool too small"; 5 s does not."""
    for gap, expected in ((60.0, True), (5.0, False)):
        console = Console(record=True, width=120)
        stats_cmd.render(_stats(gap, 10.0, 0.05), console)
        assert ("pool too small" in console.export_text()) is expected
    assert _stats(None, 10.0, 0.05).pool_too_small is False


def test_old_socket_flag_is_refused_naming_the_new_one(workdir: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--socket` (the earlier spelling) is a usage error naming `--socket-path`."""
    path = os.path.join(workdir, "none.sock")
    with pytest.raises(SystemExit) as exit:
        run_stats("--socket", path)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--socket is now --socket-path" in err and f"use --socket-path {path}" in err
