"""``Verdicts``: with TP > 1, which steps' saves every rank may commit.

Each rank's worker holds the Commits of its saves until the scheduler's verdict covers their
step: every rank has reported that step (``reported``), and the requests whose saves sit on a
block some rank failed to load are named (``spoiled``) with the last step built on it, so no
rank stores what another rank's failure spoiled. Scheduler thread only; one rank: unused.
"""

from __future__ import annotations


class Verdicts:
    """The verdict state of a scheduler side with TP > 1 (see the module doc)."""

    def __init__(self) -> None:
        self._reported = 0                        # steps whose workers' report arrived
        self._bad_until: dict[str, int] = {}      # request -> last step whose saves are bad
        self._last_save_step = 0                  # last step that planned a save
        self._sent = 0                            # step the last verdict covered

    def reported(self, step: int) -> None:
        """Every rank's report of ``step`` arrived (vLLM merges the ranks' reports)."""
        self._reported = max(self._reported, step)

    def saved(self, step: int) -> None:
        """``step`` plans saves (or evictions)."""
        self._last_save_step = step

    def spoiled(self, req_id: str, step: int) -> None:
        """Every save of ``req_id`` built up to ``step`` sits on a failed load."""
        self._bad_until[req_id] = step

    def forget(self, req_id: str) -> None:
        self._bad_until.pop(req_id, None)

    def take(self) -> tuple[int, dict[str, int]]:
        """The step's verdict: (every step up to this one has all ranks' report, request ->
        last step whose saves of it sit on a block some rank failed to load)."""
        bad = dict(self._bad_until)
        self._bad_until = {r: u for r, u in self._bad_until.items() if u > self._reported}
        self._sent = self._reported
        return self._reported, bad

    @property
    def pending(self) -> bool:
        """A step planned saves whose verdict the workers have not received yet (vLLM must
        keep stepping, empty steps included, so the held Commits land)."""
        return self._sent < self._last_save_step
