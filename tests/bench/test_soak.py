"""`tierd bench soak` on tiny arguments: it runs a real daemon and clients end to end and
reports every figure and verdict (the structure, not the timings)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_soak_reports_every_figure_and_verdict(tmp_path: object) -> None:
    """Two clients for 2 s on a 2 MiB arena (16 KiB blocks, 1 s leases): the JSON has every
    figure, work was done and verified, and nothing went wrong; the text form has the verdict
    lines."""
    args = [sys.executable, "-m", "tierd.cli", "bench", "soak", "--seconds", "2", "--clients",
            "2", "--dram-bytes", "2MiB", "--block-kib", "16", "--lease-seconds", "1",
            "--dir", str(tmp_path)]
    done = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=240)
    assert done.returncode in (0, 1), done.stderr
    figures = json.loads(done.stdout)
    for key in ("ops_per_s", "p50_ms", "p99_ms", "errors", "wrong_bytes", "leaked_pins",
                "rss_first_mib", "rss_last_mib", "rss_slope_mib_per_min", "rss_growth_mib",
                "rss_noise_mib", "fds_first", "fds_last", "fds_slope_per_min", "pass"):
        assert key in figures, key
    assert figures["working_set_bytes"] == 3 * (2 << 20)
    assert figures["rpcs"] > 0 and figures["verified_blocks"] + figures["stored_blocks"] > 0
    assert (figures["errors"], figures["wrong_bytes"], figures["leaked_pins"]) == (0, 0, 0)
    text = subprocess.run(args, capture_output=True, text=True, timeout=240).stdout
    for line in ("ops ", "wrong bytes", "leaked pins", "daemon RSS", "daemon fds",
                 "verdict      errors", "verdict      RSS growth / noise"):
        assert line in text, line
