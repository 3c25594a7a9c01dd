"""``FilterReads``: what the scheduler side learns from the daemon's presence filter with no
round trip (``tierd.wire.presence``, mapped by rank 0's session).

Two answers: a certain miss (the node holds no copy of the first block asked for, so none of
the chain after it), and, where enabled (``answer_from_filter``), how many leading blocks may
be in the daemon's DRAM, a hit the scheduler answers at once and the worker pins by a Probe as
it loads it. The filter may be wrong the other way (a collision, a block evicted since): such a
hit fails its load and vLLM recomputes it; after one, ``dram_run`` answers 0 for
``BACKOFF_SECONDS``, so new hits are pinned by a lookup first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tierd.connector.core.link import DaemonLink
from tierd.types import BlockHash, Namespace, make_key

_log = logging.getLogger(__name__)

BACKOFF_SECONDS = 10.0
"""After a load of a hit answered from the filter fails (its blocks were gone, or the worker's
Probe was not answered in time), new hits are pinned by a lookup first for this long."""


class FilterReads:
    """The presence filter as the scheduler side reads it. Scheduler thread only."""

    def __init__(self, link: DaemonLink, *, dram_hits: bool, clock: Callable[[], float]) -> None:
        """``link``: rank 0's registration; ``dram_hits``: answer hits the filter reads as in
        DRAM (``dram_run``)."""
        self._link, self._dram_hits, self._clock = link, dram_hits, clock
        self._off_until = 0.0                   # hits answered from the filter resume then

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
        if not self._dram_hits or self._clock() < self._off_until or session is None or \
                session.presence is None:
            return 0
        namespace, presence = Namespace(session.engine.namespace), session.presence
        for i, block in enumerate(wanted):
            key = make_key(namespace, block)
            if not presence.may_be_in_dram(key):
                return 0 if presence.may_hold(key) else i
        return len(wanted)

    def failed(self) -> None:
        """A hit answered from the filter failed its load: back off (``BACKOFF_SECONDS``)."""
        if self._clock() >= self._off_until:
            _log.info("tierd: a hit answered from the presence filter failed its load; new hits "
                      "are looked up first for %.0f s", BACKOFF_SECONDS)
        self._off_until = self._clock() + BACKOFF_SECONDS
