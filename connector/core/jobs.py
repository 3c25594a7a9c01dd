"""``EngineJobs``: the job model of the engine side, the one shape every front end adapts.

An engine asks what tierd holds (``lookup``), loads what it was told (``prepare_load`` ->
``complete_load``), stores what it computed (``prepare_store`` -> ``complete_store``) and
drains what changed (``take_events``). No call waits for the daemon: the daemon calls run as
jobs on a ``core.runner.Runner``, so the engine's scheduler thread never makes a round trip.
How each front end maps onto it:

=============================  ====================================================================
``vllm.connector.scheduler``   ``lookup`` is ``SchedulerSide.num_new_matched_tokens`` (None until
                               its job is done); the loads and saves it plans are the workers'.
``vllm.connector.worker``      the planned loads and saves; Commits and streamed copies on runners.
``vllm.tier`` (``TierdTier``)  vLLM's ``lookup`` / ``submit_load`` / ``submit_store`` /
                               ``get_finished_jobs`` / ``take_events``; probes, loads, stores on
                               the runner.
``sglang``                     ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``; Commits and
                               Releases on the runner.
``reference.tierd_hooks``      ``lookup`` / ``load`` / ``save`` / ``step_end`` (the reference
                               engine's hooks are synchronous: its lookup is a Probe, and an
                               Acquire where the chain reaches SSD, on the engine thread);
                               Releases, gathered saves, reports, reconnects on the runner.
=============================  ====================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from tierd.events import KVEvent
from tierd.types import BlockHash


class EngineJobs(Protocol):
    """What a front end does with tierd, for one engine process. Calls come from one engine
    thread; none blocks on the daemon."""

    def lookup(self, request_id: str, hashes: Sequence[BlockHash]) -> int | None:
        """How many leading ``hashes`` tierd holds for ``request_id`` and has pinned for it;
        None: asked, not answered yet (ask again later; the first ask queues one job, a later
        one only reads its result). A positive answer pins those blocks in the daemon's DRAM
        until ``complete_load`` or the lease's end; 0 pins nothing. The daemon counts one
        lookup per request, however often it is asked."""
        ...

    def prepare_load(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Queue the copy of the pinned hit of ``request_id`` into ``block_ids`` (at most the
        blocks ``lookup`` answered). Never blocks; the engine must not touch ``block_ids`` until
        ``complete_load``."""
        ...

    def complete_load(self, request_id: str, ok: bool) -> None:
        """The load of ``request_id`` ended (``ok``: every block verified and in place, else
        the engine recomputes from the first bad one). Unpins its blocks (a job)."""
        ...

    def prepare_store(self, request_id: str, hashes: Sequence[BlockHash],
                      block_ids: Sequence[int]) -> bool:
        """Queue the store of ``block_ids`` under ``hashes``: reserve, copy, commit. False: the
        store queue is full and nothing is queued (the blocks stay the engine's only copy).
        The engine must not overwrite ``block_ids`` until ``complete_store``."""
        ...

    def complete_store(self, request_id: str, ok: bool) -> None:
        """The copy of ``request_id``'s store ended (``ok``: its blocks were copied; the Commit
        may still be in flight): the engine may reuse the blocks."""
        ...

    def take_events(self) -> Iterable[KVEvent]:
        """What changed since the last call, oldest first (stored and removed blocks)."""
        ...
