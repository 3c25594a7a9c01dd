"""``FilterReads``: what the scheduler side learns from the daemon's presence filter with no
round trip (``tierd.wire.presence``, mapped by rank 0's session).

Two answers: a certain miss (the node holds no copy of the first block asked for, so none of the
chain after it), and, where enabled (``answer_from_filter``), how many leading blocks may be in the
daemon's DRAM, a hit the scheduler answers at once and the worker pins by a Probe as it loads it.
The filter may be wrong the other way (a collision with a block in DRAM, a block evicted since):
such a hit fails its load past the blocks the Probe pinned, and vLLM recomputes those. A collision
needs both of a block's cells taken by other keys (about the square of the share of cells in use:
one hit in a thousand or more with the default filter and a full DRAM tier) and costs one request a
recompute, so a failure now and then changes nothing; where ``FAILED_IN_WINDOW`` of the last
``WINDOW`` such loads failed (a daemon too slow to answer the worker's Probe, whose load then waits
``probed.PROBE_WAIT_SECONDS``, or a filter that no longer tells), ``dram_run`` answers 0 for
``BACKOFF_SECONDS``, so new hits are pinned by a lookup first.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from tierd.connector.core.link import DaemonLink
from tierd.types import BlockHash, Namespace, make_key

_log = logging.getLogger(__name__)

BACKOFF_SECONDS = 10.0
"""How long new hits are pinned by a lookup first once loads of hits answered from the filter
fail too often (module doc)."""

WINDOW = 20
"""Loads of hits answered from the filter whose outcomes are weighed (the latest)."""

FAILED_IN_WINDOW = 2
"""Failed loads among the last ``WINDOW`` that make the scheduler back off."""


class FilterReads:
    """The presence filter as the scheduler side reads it. Scheduler thread only."""

    def __init__(self, link: DaemonLink, *, dram_hits: bool, clock: Callable[[], float]) -> None:
        """``link``: rank 0's registration; ``dram_hits``: answer hits the filter reads as in
        DRAM (``dram_run``)."""
        self._link, self._dram_hits, self._clock = link, dram_hits, clock
        self._off_until = 0.0                   # hits answered from the filter resume then
        self._outcomes: deque[bool] = deque(maxlen=WINDOW)  # the latest loads: True if loaded

    def certain_miss(self, first: BlockHash) -> bool:
        """Whether the filter says the node holds no copy of ``first``."""
        session = self._link.session
        return session is not None and session.presence is not None and \
            not session.presence.may_hold(make_key(Namespace(session.engine.namespace), first))

    def dram_run(self, wanted: list[BlockHash]) -> int:
        """How many leading blocks of ``wanted`` the filter reads as maybe in the daemon's DRAM;
        0 where hits are not answered from the filter (disabled, no filter, backing off), or
        where the block after that run may be on SSD (a lookup hands that on as a streamed
        load)."""
        session = self._link.session
        if not self._dram_hits or self.backing_off or session is None or \
                session.presence is None:
            return 0
        namespace, presence = Namespace(session.engine.namespace), session.presence
        for i, block in enumerate(wanted):
            key = make_key(namespace, block)
            if not presence.may_be_in_dram(key):
                return 0 if presence.may_hold(key) else i
        return len(wanted)

    def loaded(self, whole: bool) -> None:
        """A hit answered from the filter was loaded (``whole``) or failed (part of) its load;
        back off (``BACKOFF_SECONDS``) once ``FAILED_IN_WINDOW`` of the last ``WINDOW``
        failed."""
        self._outcomes.append(whole)
        if whole or self._outcomes.count(False) < FAILED_IN_WINDOW:
            return
        _log.info("tierd: %d of the last %d hits answered from the presence filter failed their "
                  "loads; new hits are looked up first for %.0f s", self._outcomes.count(False),
                  len(self._outcomes), BACKOFF_SECONDS)
        self._off_until = self._clock() + BACKOFF_SECONDS
        self._outcomes.clear()

    @property
    def backing_off(self) -> bool:
        """Whether hits are pinned by a lookup first now."""
        return self._clock() < self._off_until
