"""KV cache events, the shape vLLM and SGLang publish: a block was stored, removed, or all cleared.

Producers (the paged block pool, each daemon tier) append to an ``EventLog``; consumers drain it
with ``take_events()``. Each event names the tier it happened in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tierd.types import BlockHash, Tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became hittable in ``tier``. ``parent_block_hash`` chains the first of them."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    tier: Tier
    block_size: int = 0
    token_ids: tuple[int, ...] = ()
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks stopped being hittable in ``tier`` (evicted, demoted away, dropped as corrupt)."""

    block_hashes: tuple[BlockHash, ...]
    tier: Tier


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of ``tier`` is gone (a reset, or a tier that went offline)."""

    tier: Tier


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """A ring of events, drained in order. Bounded: past ``max_events`` the oldest are dropped
    and counted in ``dropped`` (a consumer that never drains must not grow memory); each append
    is O(1) (a ``deque`` with ``maxlen``). ``max_events=0`` keeps nothing: for an owner whose
    events nobody takes (every append is then only counted in ``dropped``)."""

    __slots__ = ("max_events", "dropped", "_events")

    def __init__(self, max_events: int = 100_000) -> None:
        if max_events < 0:
            raise ValueError(f"max_events must be >= 0 (0 = keep none), got {max_events}")
        self.max_events = max_events
        self.dropped = 0
        self._events: deque[KVEvent] = deque(maxlen=max_events)

    def __len__(self) -> int:
        return len(self._events)

    def append(self, event: KVEvent) -> None:
        """Record one event (the oldest drops out of a full ring). Never blocks, O(1)."""
        if len(self._events) == self.max_events:
            self.dropped += 1
        self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        """Return every event recorded since the last call, oldest first, and forget them."""
        events = list(self._events)
        self._events.clear()
        return events
