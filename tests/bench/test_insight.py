"""`tierd bench insight`'s prediction part: a recorded trace replayed through stores of 0.25x to
8x a base size; the base store's what-if curve is within 5 points of each measured hit ratio."""

from __future__ import annotations

import asyncio
import os

from tierd.bench.insight import SCALES, _load, _prediction, _record


def test_prediction_within_five_points(tmp_path: str) -> None:
    """4,000 recorded lookups, base 512 blocks, the sample bounded to 1,024 blocks (rate about
    0.27): six points, each within 0.05 of the hit ratio measured at that size, growing with
    the size."""
    path = os.path.join(tmp_path, "trace.jsonl")
    _record(path, 4000)
    points, rate = asyncio.run(_prediction(_load(path), 512, 1024))
    assert [p["scale"] for p in points] == list(SCALES) and 0 < rate < 1
    assert all(abs(p["predicted"] - p["measured"]) <= 0.05 for p in points), points
    measured = [p["measured"] for p in points]
    assert measured == sorted(measured)
