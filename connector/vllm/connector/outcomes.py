"""``Outcomes``: what one worker tells vLLM and the scheduler about its loads, and which of its
saves it must drop so that nothing computed on a failed load is stored (invariant 2).

A failed block (a miss since the lookup, a checksum mismatch, a lease that ran out, the daemon
gone) is reported to vLLM (``take_errors``: ``get_block_ids_with_load_errors``) and to the
scheduler (``take_report``), and *poisons* its request: every save of that request, and every
save that sits on a failed block (``SaveSpec.depends_on``), is dropped until the scheduler names
the request in ``recomputing`` (vLLM has rolled it back and recomputes from the failed block).
Failed blocks are kept until the scheduler has seen them (``failures_seen``).

Engine thread only.
"""

from __future__ import annotations

from collections.abc import Iterable

from .metadata import SaveSpec, TierdConnectorMetadata, TierdWorkerMetadata
from .stats import Counters


class Outcomes:
    """Load outcomes and save poison of one worker; see the module doc."""

    def __init__(self, counters: Counters, slot_bytes: int, tp_size: int) -> None:
        self._counters, self._slot_bytes, self._tp_size = counters, slot_bytes, tp_size
        self._errors: set[int] = set()       # for vLLM, since the last take_errors
        self._report = TierdWorkerMetadata()  # for the scheduler, this step
        self._poisoned: set[str] = set()     # requests whose saves are dropped
        self._failed: set[int] = set()       # failed blocks until the scheduler has seen them
        self.step = 0                        # the step the bound metadata names

    def begin_step(self, meta: TierdConnectorMetadata) -> None:
        """Take the step's metadata: accept saves of requests vLLM is recomputing, forget
        failures the scheduler has seen."""
        self._poisoned.difference_update(meta.recomputing)
        self._failed.difference_update(meta.failures_seen)
        self.step = self._report.step = meta.step

    def loaded(self, req_id: str, block_ids: list[int], good: int, cancelled: bool = False
               ) -> None:
        """``req_id``'s load is done with ``good`` leading blocks in place: the rest fail
        (unless vLLM aborted the request)."""
        self._report.loaded[req_id] = 1
        self._counters.count("loaded_blocks", good)
        self._counters.count("loaded_bytes", good * self._slot_bytes)
        failed = block_ids[good:]
        if failed and not cancelled:
            self.fail(req_id, failed)

    def taken_back(self, req_id: str, block_ids: list[int]) -> None:
        """Blocks counted as loaded turned out invalid (their lease ran out before the copy
        was done): they fail after all."""
        self._counters.count("loaded_blocks", -len(block_ids))
        self._counters.count("loaded_bytes", -len(block_ids) * self._slot_bytes)
        self.fail(req_id, block_ids)

    def fail(self, req_id: str, block_ids: list[int]) -> None:
        """Report ``block_ids`` as load errors and poison ``req_id``'s saves."""
        self._errors.update(block_ids)
        self._report.failed.update(block_ids)
        self._failed.update(block_ids)
        self._poisoned.add(req_id)
        self._counters.count("failed_blocks", len(block_ids))

    def accepted(self, saves: Iterable[SaveSpec]) -> list[SaveSpec]:
        """The saves not computed on top of a failed load; poisons the requests of the rest
        (their blocks counted as dropped)."""
        kept: list[SaveSpec] = []
        for spec in saves:
            if spec.req_id not in self._poisoned and not self._failed.intersection(
                    spec.depends_on):
                kept.append(spec)
                continue
            self._poisoned.add(spec.req_id)
            self._counters.count("dropped_blocks", len(spec.block_ids))
        return kept

    def finished(self, req_ids: Iterable[str]) -> None:
        """Forget requests vLLM finished (their poison, if any)."""
        self._poisoned.difference_update(req_ids)

    def take_errors(self) -> set[int]:
        """vLLM block ids whose planned load failed since the last call (then forgotten)."""
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> TierdWorkerMetadata | None:
        """This step's ``TierdWorkerMetadata`` (None if there is nothing to report)."""
        report = self._report
        if self._tp_size == 1 and report.is_empty():
            return None  # the usual step: the blank report serves the next one
        self._report = TierdWorkerMetadata()
        if self._tp_size > 1 and report.step:  # the verdicts count steps every rank finished
            return report
        return None if report.is_empty() else report
