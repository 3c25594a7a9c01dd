"""`tierd bench tenants` on tiny arguments: four real daemons and their clients end to end; every
figure and verdict is reported, and under quotas the hostile tenant takes none of the
well-behaved one's blocks (the structure and the hits, not the timings)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tenants_reports_every_phase_and_verdict() -> None:
    """2 s per phase on a 4 MiB arena of 16 KiB blocks: the JSON has the four phases and four
    verdicts; the well-behaved tenant makes no error and, beside the hostile one under quotas,
    hits every block it stored; the text form has the verdict lines."""
    args = [sys.executable, "-m", "tierd.cli", "bench", "tenants", "--seconds", "2",
            "--dram-bytes", "4MiB", "--block-kib", "16", "--lease-seconds", "1"]
    done = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr
    figures = json.loads(done.stdout)
    assert set(figures["phases"]) == {"alone", "benign", "hostile", "no quotas"}
    assert [c[0] for c in figures["checks"]] == [
        "hit ratio, hostile / alone", "p99 Acquire, hostile / alone",
        "RSS growth MiB (hostile phase)", "well-behaved errors"]
    for phase in figures["phases"].values():
        assert phase["well_loads"] > 0 and phase["well_errors"] == 0
        assert phase["exit_codes"] == [0] * len(phase["exit_codes"])
    assert figures["phases"]["alone"]["well_hit_ratio"] == 1.0
    assert figures["phases"]["hostile"]["well_hit_ratio"] == 1.0
    assert figures["phases"]["hostile"]["other_refused"] > 0
