"""`tierd bench vllm` on a tiny prefix: two real daemons, the connector's two halves, every
figure reported and the bytes of each load checked (the structure, not the timings)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_vllm_bench_reports_every_figure(tmp_path: object) -> None:
    """A 64-token Llama-3-8B prefix, one round after the checked warm-up: the JSON has every
    figure and ratio; the warm-up's byte checks passed (the run did not abort)."""
    args = [sys.executable, "-m", "tierd.cli", "bench", "vllm", "--tokens", "64", "--repeat",
            "1", "--dir", str(tmp_path), "--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr
    figures = json.loads(done.stdout)
    for key in ("memcpy_ms", "store_engine_ms", "store_ms", "dram_load_ms", "ssd_load_ms",
                "raw_read_ms", "dram_ratio", "store_ratio", "store_engine_ratio", "ssd_ratio",
                "ok"):
        assert key in figures, key
    assert figures["bytes"] == 4 * (2 << 20) and figures["tokens"] == 64
