"""The Grafana dashboard (docs/grafana-dashboard.json, shipped in the Helm chart too) against a
real Prometheus (Debian's package `prometheus`) scraping a real daemon under load: every panel's
query parses and returns data through Prometheus' HTTP API."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"


def _exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def test_chart_ships_the_documented_dashboard() -> None:
    """The chart's copy is byte for byte docs/grafana-dashboard.json, and every panel has a
    query."""
    assert (ROOT / "helm" / "tierd" / "dashboards" / "tierd.json").read_bytes() == \
        DASHBOARD.read_bytes()
    dashboard = json.loads(DASHBOARD.read_text())
    assert all(p.get("targets") for p in dashboard["panels"] if p["type"] != "row")


def _load(daemon: Any, kit: Any, stop: threading.Event) -> None:
    """An engine stand-in: 256 chains of 8 blocks (8 times the arena), each looked up, its
    held prefix acquired, the rest stored; recent chains come back more often (hits, reuse,
    evictions, demotions to SSD)."""
    rng = random.Random(3)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout, engine_name="load")
        arena = kit.attach(engine)
        client.report_hot_blocks(engine.engine_id, prefill_tokens_per_second=5000.0)
        n = 0
        while not stop.is_set():
            n += 1
            chain = kit.chain(8, seed=rng.randrange(max(1, n // 2), n + 1) % 256)
            held = len(client.lookup(engine.engine_id, chain))
            if held:
                got = client.acquire(engine.engine_id, chain[:held])
                client.release(engine.engine_id, got.lease_id)
            kit.store_blocks(client, engine, arena, chain[held:])
            time.sleep(0.002)
        arena.close()


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="needs Debian's prometheus: apt-get install prometheus")
def test_every_panel_query_returns_data(make_daemon: Any, kit: Any, workdir: str) -> None:
    """A daemon (1 MiB arena, 1 MiB SSD, maintenance every 0.5 s, metrics on) under load and a
    real Prometheus scraping it every second: each panel's query (dashboard variables set to
    every instance and a 30 s rate window) is accepted and returns at least one series."""
    daemon = make_daemon(metrics_port=0, dram_bytes=1 << 20, ssd_bytes=1 << 20,
                         maintain_seconds=0.5)
    port, metrics = _free_port(), daemon.daemon.metrics_port
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: tierd\n    static_configs:\n"
                f"      - targets: ['127.0.0.1:{metrics}']\n")
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(daemon, kit, stop), daemon=True)
    with open(os.path.join(workdir, "prometheus.log"), "wb") as log:
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir}/tsdb",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=log)
    api = f"http://127.0.0.1:{port}/api/v1/query?query="
    try:
        load.start()
        missing = _exprs()
        deadline = time.monotonic() + 90
        while missing and time.monotonic() < deadline:
            time.sleep(2)
            still = []
            for title, expr in missing:
                query = expr.replace("$instance", ".+").replace("$__rate_interval", "30s")
                try:
                    reply = _get(api + urllib.parse.quote(query))
                except OSError:  # Prometheus not up yet
                    still.append((title, expr))
                    continue
                assert reply["status"] == "success", (title, reply)
                if not reply["data"]["result"]:
                    still.append((title, expr))
            missing = still
        assert missing == [], Path(workdir, "prometheus.log").read_text()[-2000:]
    finally:
        stop.set()
        load.join(timeout=30)
        prometheus.terminate()
        prometheus.wait(timeout=30)
