"""The adapter's transfer counters as vLLM's ``KVConnectorStats``.

Each worker returns the counts of the steps since its last report from
``get_kv_connector_stats``; vLLM sums the workers' reports (``aggregate``), rebuilds them in its
logging process through ``TierdConnector.build_kv_connector_stats`` and logs ``reduce()`` once
per interval.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .base import KVConnectorStats

COUNTERS = ("loaded_blocks", "loaded_bytes", "failed_blocks", "saved_blocks", "saved_bytes",
            "skipped_blocks", "dropped_blocks", "lapsed_blocks", "reoffered_blocks")
"""loaded: written into vLLM's cache after its checksum verified; failed: planned loads handed
back to vLLM to recompute; saved: committed to the daemon; skipped: planned saves the daemon
already held or had no room for; dropped: planned saves lost (daemon down, a failed load
upstream of them, a layer missing, a failed call); lapsed: of the dropped, those whose write
lease had ended when their Commit arrived; reoffered: saves of a step that outlasted half of its
write lease, reserved and copied again (then saved, skipped or dropped like any other)."""


@dataclass
class TierdConnectorStats(KVConnectorStats):
    """Counters (``COUNTERS``) since the last report; missing keys count as 0."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, amount: int) -> None:
        assert name in COUNTERS, f"unknown counter {name}"
        self.data[name] += amount

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: Any) -> TierdConnectorStats:
        """Add another report's counts into this one (returns self)."""
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


class Counters:
    """A worker's counters twice: ``totals`` since start (logs, tests) and those since the last
    ``take`` (vLLM's ``get_kv_connector_stats``). Thread-safe (the committer thread counts the
    save it closes for an idle engine)."""

    def __init__(self) -> None:
        self.totals = TierdConnectorStats()
        self._since = TierdConnectorStats()
        self._counted = False  # something was counted since the last ``take``
        self._lock = threading.Lock()

    def count(self, name: str, amount: int) -> None:
        """Add ``amount`` (may be negative: a load taken back) to counter ``name``."""
        if amount:
            with self._lock:
                self._since.add(name, amount)
                self.totals.add(name, amount)
                self._counted = True

    def take(self) -> TierdConnectorStats | None:
        """The counts since the last call (None if all are 0)."""
        if not self._counted:
            return None  # the usual step (a count made meanwhile is the next call's)
        with self._lock:
            since, self._since, self._counted = self._since, TierdConnectorStats(), False
        return None if since.is_empty() else since
