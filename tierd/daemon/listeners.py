"""Who is told of every change of what the node holds: the ``TierListener`` protocol (the cluster
link, the presence filter, the model table and the write-behind implement it) and
``TierListeners``, one listener that tells several.

Listeners get namespaced keys at the moment a change happens, on the event loop: the KV events
of ``tierd.events`` carry no namespace, so they cannot feed a cluster directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from tierd.types import NamespacedKey, Tier

Payload = Callable[[], "asyncio.Future[bytes | None]"]
"""How a ``TierListener`` takes an evicted block's bytes (see ``TierListener.evicted``)."""


class TierListener(Protocol):
    """Told of every change of what the node holds, synchronously, on the event loop, as it
    happens. Implementations must not block or do I/O (queue the work instead)."""

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        """These blocks gained a copy in ``tier`` (for "hbm": one more engine reports them)."""

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        """These blocks lost their copy in ``tier`` (for "hbm": one engine fewer)."""

    def cleared(self, tier: Tier) -> None:
        """Every block of ``tier`` is gone (the SSD went unhealthy)."""

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        """The block's last copy is leaving the node by eviction (not corruption). ``payload()``
        may be called only during this call, and only to keep the bytes: it copies them (DRAM)
        or starts reading them on an I/O thread (SSD; the event loop never waits for the disk)
        and returns a future of its ``nbytes`` bytes, None if they cannot be read."""


class TierListeners:
    """One ``TierListener`` that tells each of several others of every change, in order."""

    def __init__(self, listeners: Sequence[TierListener]) -> None:
        self._all = list(listeners)

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        for listener in self._all:
            listener.stored(keys, tier)

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        for listener in self._all:
            listener.removed(keys, tier)

    def cleared(self, tier: Tier) -> None:
        for listener in self._all:
            listener.cleared(tier)

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        for listener in self._all:
            listener.evicted(key, checksum, nbytes, payload)
