"""KV cache events, the shape vLLM and SGLang publish: a block was stored, removed, or all cleared.

Producers (the paged block pool, each daemon tier) append to an ``EventLog``; consumers drain it
with ``take_events()``. Each event names the tier it happened in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)
class EventLog:
    """An append-only buffer of events, drained in order. Bounded: past ``max_events`` the oldest
    are dropped and counted in ``dropped`` (a consumer that never drains must not grow memory)."""

    max_events: int = 100_000
    _events: list[KVEvent] = field(default_factory=list)
    dropped: int = 0

    def append(self, event: KVEvent) -> None:
        """Record one event. Never blocks."""
        self._events.append(event)
        overflow = len(self._events) - self.max_events
        if overflow > 0:
            del self._events[:overflow]
            self.dropped += overflow

    def take_events(self) -> list[KVEvent]:
        """Return every event recorded since the last call, oldest first, and forget them."""
        events, self._events = self._events, []
        return events
