"""The per-tier block entries and their index in recency order, least recently used first.

One ``LruIndex`` per tier (DRAM, SSD) maps ``NamespacedKey -> entry`` (slots dataclasses: hot
per-block metadata). ``TierIndex`` (``tierd.daemon.tier_index``) holds both and drops what the
eviction policy (``tierd.daemon.eviction``) names from them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from tierd.types import BlockHash, Namespace, NamespacedKey


@dataclass(slots=True)
class DramBlock:
    """A committed block in the shared-memory arena."""

    namespace: Namespace
    block_hash: BlockHash
    slot_bytes: int          # size class; == the layout's block_bytes
    slot_id: int             # allocator slot; owned by this entry until it leaves the index
    checksum: int            # block_checksum of the payload, given by the engine at commit
    created: float           # first commit on this node (kept across demotion/promotion)
    last_access: float       # commit or last acquire
    hits: int = 0            # acquires that returned this block
    pins: int = 0            # live read leases holding it; > 0: never evicted or moved
    demoting: bool = False   # an SSD write of its bytes is in flight; the slot must stay put
    promoted: bool = False   # read from SSD and not yet handed out (its next hit is an SSD hit)
    corrupt: bool = False    # found corrupt while in use: served to nobody, dropped once free


@dataclass(slots=True)
class SsdBlock:
    """A block with a record in the SSD store."""

    namespace: Namespace
    block_hash: BlockHash
    payload_len: int
    stored_bytes: int        # what the record counts against the SSD bound
    checksum: int
    created: float
    last_access: float
    hits: int = 0
    pins: int = 0            # in-flight promotions reading the record; > 0: never dropped


E = TypeVar("E", DramBlock, SsdBlock)


class LruIndex(Generic[E]):
    """Key -> entry, iterated least recently used first. O(1) add, touch, pop."""

    get: Callable[[NamespacedKey], E | None]
    """The entry, or None; does not change the order. The ordered dict's own ``get`` (no Python
    frame): hot paths call it once per block of a request."""

    def __init__(self) -> None:
        self._entries: OrderedDict[NamespacedKey, E] = OrderedDict()
        self.get = self._entries.get

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: NamespacedKey) -> bool:
        return key in self._entries

    def prefix(self, keys: Iterable[NamespacedKey]) -> list[E]:
        """The entries of the longest leading run of ``keys`` held, in order; no reordering."""
        get = self._entries.get
        run: list[E] = []
        for key in keys:
            entry = get(key)
            if entry is None:
                break
            run.append(entry)
        return run

    def add(self, key: NamespacedKey, entry: E) -> None:
        """Insert a new entry as the most recently used."""
        assert key not in self._entries, f"key {key.hex()} is already indexed in this tier"
        self._entries[key] = entry

    def touch(self, key: NamespacedKey) -> None:
        """Make ``key`` the most recently used."""
        self._entries.move_to_end(key)

    def touch_all(self, keys: Iterable[NamespacedKey]) -> None:
        """Make each of ``keys`` the most recently used, in order: the last ends up newest."""
        move = self._entries.move_to_end
        for key in keys:
            move(key)

    def pop(self, key: NamespacedKey) -> E:
        """Remove and return the entry (KeyError if absent: a caller bug)."""
        return self._entries.pop(key)

    def newest_first(self) -> Iterator[tuple[NamespacedKey, E]]:
        """Entries from most to least recently used (same caveat as ``oldest_first``)."""
        return reversed(self._entries.items())

    def oldest_first(self) -> Iterator[tuple[NamespacedKey, E]]:
        """Entries from least to most recently used. Do not mutate while iterating: collect
        victims first, then pop them."""
        return iter(self._entries.items())

    def clear(self) -> list[tuple[NamespacedKey, E]]:
        """Remove every entry; return them oldest first."""
        items = list(self._entries.items())
        self._entries.clear()
        return items
