"""`tierd bench tenants` on tiny arguments: two rounds of four real daemons and their clients end
to end; every arm, figure and verdict is reported, and under quotas the hostile tenant takes none
of the well-behaved one's blocks (the structure and the hits, not the timings)."""

from __future__ import annotations

import json
import subprocess
import sys

from tierd.bench.tenants import Turns, paired


def test_tenants_reports_every_arm_and_verdict() -> None:
    """Two rounds of 2 s on a 4 MiB arena of 16 KiB blocks: the JSON has the four arms, two
    rounds each, and four verdicts; the well-behaved tenant makes no error and, beside the
    hostile one under quotas, hits every block it stored; without quotas it loses blocks. The
    other tenant's client runs at nice 19."""
    args = [sys.executable, "-m", "tierd.cli", "bench", "tenants", "--seconds", "2",
            "--rounds", "2", "--dram-bytes", "4MiB", "--block-kib", "16", "--lease-seconds", "1"]
    done = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr
    figures = json.loads(done.stdout)
    assert {arm: len(rounds) for arm, rounds in figures["rounds"].items()} == {
        "alone": 2, "benign": 2, "hostile": 2, "no quotas": 2}
    assert [c[0] for c in figures["checks"]] == [
        "hit ratio, hostile / alone", "p99 Acquire, hostile / alone",
        "RSS growth MiB (hostile rounds)", "well-behaved errors"]
    for name, rounds in figures["rounds"].items():
        for arm in rounds:
            assert arm["well_loads"] > 0 and arm["well_errors"] == 0
            if name != "alone":  # the other client yields the CPU to the well-behaved one
                assert arm["other_nice"] == min(19, arm["well_nice"] + 19)
            assert arm["exit_codes"] == [0] * len(arm["exit_codes"])
    for arm in ("alone", "hostile"):
        assert [r["well_hit_ratio"] for r in figures["rounds"][arm]] == [1.0, 1.0]
    assert all(r["other_refused"] > 0 for r in figures["rounds"]["hostile"])
    assert figures["medians"]["no quotas"]["hit_ratio"] < 1.0


def test_figures_are_paired_by_round() -> None:
    """Each round's arm is divided by the alone arm of the same round, then the median taken:
    a slow round slows both arms and cancels."""
    runs = {"alone": [{"p99": 1.0}, {"p99": 10.0}, {"p99": 2.0}],
            "hostile": [{"p99": 1.05}, {"p99": 12.0}, {"p99": 2.0}]}
    assert paired(runs, "hostile", "p99") == 1.05


def test_arms_take_turns_round_robin() -> None:
    """Four arms, turns of 0.5 s from t=100: the third arm's first active second runs from 101
    to 101.5, its next from 103 (after the fourth, first and second arms' turns); with slice 0
    every arm runs all the time."""
    third = Turns(100.0, 0.5, 4, 2)
    assert [third.wall(a) for a in (0.0, 0.25, 0.5, 0.75)] == [101.0, 101.25, 103.0, 103.25]
    assert [third.mine(t) for t in (100.9, 101.1, 101.6, 103.2)] == [False, True, False, True]
    together = Turns(100.0, 0.0, 4, 2)
    assert together.wall(3.0) == 103.0 and together.mine(100.1)
