"""`tierd bench sglang` on a small batch: two real daemons, SGLang's host pool and `file`
backend, every figure reported and every get checked byte for byte (the structure, not the
timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang", reason="needs real SGLang: run `make test-sglang`")

pytestmark = pytest.mark.sglang


def test_sglang_bench_reports_every_figure(tmp_path: object) -> None:
    """4 pages, one round after the checked warm-up: the JSON has every row; the warm-up's
    byte checks passed (the run did not abort)."""
    args = [sys.executable, "-m", "tierd.cli", "bench", "sglang", "--pages", "4", "--repeat",
            "1", "--dir", str(tmp_path), "--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode in (0, 1), done.stderr
    figures = json.loads(done.stdout[done.stdout.index("{"):])
    for key in ("memcpy_ms", "tierd_set_ms", "file_set_ms", "tierd_get_ms", "file_get_ms",
                "tierd_ssd_get_ms", "file_cold_get_ms", "ok"):
        assert key in figures, key
    assert figures["bytes"] == 4 * (2 << 20) and figures["sglang"] == "0.5.23"
