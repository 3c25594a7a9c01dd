"""What each engine holds in its GPU pool, as it reports it (``ReportHotBlocks``): the HBM tier
of the node's view. Bounded per engine; the tier listener hears every change as ``"hbm"``."""

from __future__ import annotations

from collections.abc import Iterable

from tierd.daemon.listeners import TierListener
from tierd.types import BlockHash, Namespace, NamespacedKey, make_key


class HbmIndex:
    """Per engine, the block hashes it reports in its GPU pool (an insertion-ordered set, at most
    ``cap`` per engine: past it the oldest reported are forgotten)."""

    def __init__(self, cap: int, listener: TierListener | None = None) -> None:
        self.cap = cap
        self._held: dict[str, dict[BlockHash, None]] = {}
        self._listener = listener
        self._namespaces: dict[str, Namespace] = {}     # engine -> namespace, for the listener

    def held(self, engine_id: str) -> dict[BlockHash, None]:
        """The engine's set (read only; empty if it never reported)."""
        return self._held.get(engine_id, {})

    def report(self, engine_id: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash],
               cleared: bool, namespace: Namespace | None = None) -> None:
        """Apply a batch: ``cleared`` first, then ``stored``, then ``removed``. The listener
        hears exactly what changed in this engine's set (``namespace`` scopes the keys)."""
        held = self._held.setdefault(engine_id, {})
        listener = self._listener if namespace is not None else None
        added: list[BlockHash] = []
        gone: list[BlockHash] = []
        if namespace is not None:
            self._namespaces[engine_id] = namespace
        if cleared:
            if listener is not None:
                self._tell(engine_id, list(held), removed=True)
            held.clear()
        for block_hash in stored:
            if held.pop(block_hash, 0) is not None:
                added.append(block_hash)
            held[block_hash] = None
        for block_hash in removed:
            if held.pop(block_hash, 0) is None:
                gone.append(block_hash)
        for _ in range(len(held) - self.cap):
            oldest = next(iter(held))
            del held[oldest]
            gone.append(oldest)
        if listener is not None:
            self._tell(engine_id, added, removed=False)
            self._tell(engine_id, gone, removed=True)

    def drop(self, engine_id: str) -> None:
        held = self._held.pop(engine_id, None)
        if held:
            self._tell(engine_id, list(held), removed=True)
        self._namespaces.pop(engine_id, None)

    def _tell(self, engine_id: str, hashes: list[BlockHash], *, removed: bool) -> None:
        namespace = self._namespaces.get(engine_id)
        if self._listener is None or namespace is None or not hashes:
            return
        keys = [make_key(namespace, h) for h in hashes]
        if removed:
            self._listener.removed(keys, "hbm")
        else:
            self._listener.stored(keys, "hbm")

    def counts(self) -> dict[str, int]:
        return {engine: len(held) for engine, held in self._held.items()}

    def told_keys(self) -> list[NamespacedKey]:
        """Every key the listener holds as reported (one per engine that reports it)."""
        return [make_key(self._namespaces[engine], h) for engine, held in self._held.items()
                if engine in self._namespaces for h in held]

    def check_integrity(self) -> None:
        assert all(len(h) <= self.cap for h in self._held.values()), "HBM set over its cap"
