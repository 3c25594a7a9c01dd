"""The presence filter: which blocks this node may hold, readable by engines with no round trip.

A shared-memory file beside the arena (``<arena name>-presence``) of ``cells`` one-byte
counters. A block maps to two cells (``tierd.wire.presence.cells_of``: the low and the high half
of the xxh3-64 of its *filter key*, ``prefix || block hash``, each cut to the cell count), where
the prefix is a keyed blake2b of the block's namespace under a random secret of this filter
(made at each daemon start, never written anywhere). Each engine is told only its own
namespace's prefix (``RegisterEngine``'s ``namespace``), so an engine of another tenant, which
can map the same file, cannot compute which cells hold a given block of this tenant: the unkeyed
namespace (blake2b of the tenant name and layout) is public knowledge, the prefix is not. What it
can still see is that some cell changed. The daemon keeps, per cell, the copies of the keys that
map to it (a copy counts in both cells of its key), a DRAM copy as 1 and an SSD copy as
``SSD_WEIGHT`` (``tierd.wire.presence``), so a cell also tells whether one of them may be in
DRAM: the filter is a ``TierListener`` of the tier index, so it changes exactly when the index
does, on the event loop, before the call that caused the change returns. A counter that would
pass 254 stays at 255 (it can no longer count down, so it stays "maybe", in DRAM too).

An engine reads the cells of the first block it would ask the daemon for. A 0 in either means
the node holds no copy of that block, so an Acquire would pin nothing: the engine skips the round
trip and counts the lookup itself (sent with its next Reserve, so the node's hit ratio still
counts it). Anything else means "maybe" (a block the node does not hold reads so only where both
of its cells count other keys: with a share ``f`` of cells in use, about ``f * f`` of the time),
and the Acquire answers. Where every block of a hit reads "maybe in DRAM" (in both cells), the
vLLM connector answers vLLM at once and its worker pins the blocks as it loads them
(``tierd.connector.vllm.connector.scheduler``). A collision or a saturated counter only costs a
round trip or a recompute; a read racing a store (0 read just as the block lands) is a miss that
could have hit, i.e. a recompute. Neither can make an engine use wrong KV: every load still pins
and verifies its blocks (invariant 2). Tenants: see the prefix above; a count says nothing an
Acquire would not (and less: it is shared by every key of the cell).

Only without the remote tier: there, an Acquire that misses locally may fetch from the cluster,
so the daemon publishes no filter and engines always ask.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from tierd.daemon.arena import OwnedArena
from tierd.types import Namespace, NamespacedKey, Tier
from tierd.wire.arena import ShmArena
from tierd.wire.layout import NAMESPACE_LEN
from tierd.wire.presence import SATURATED, SSD_WEIGHT, cells_of, check_cells

if TYPE_CHECKING:
    from tierd.daemon.listeners import Payload

SUFFIX = "-presence"
"""Appended to the arena's file name to name the filter's file (same directory)."""

_WEIGHTS: dict[Tier, int] = {"dram": 1, "ssd": SSD_WEIGHT}  # HBM blocks are not acquirable here


_PREFIXES_KEPT = 4096  # namespaces whose prefix is cached (tenants x layouts: a handful)


class PresenceFilter:
    """Daemon side: the counters, kept by the tier index's listener calls."""

    def __init__(self, shm: OwnedArena) -> None:
        """Internal: use ``create``."""
        self.shm = shm
        self.cells = shm.size
        self._counts = shm.view(0, shm.size)
        self._held: Callable[[], Iterable[NamespacedKey]] = list
        self._secret = secrets.token_bytes(32)       # this run's: engines never see it
        self._prefixes: dict[bytes, bytes] = {}       # namespace -> its prefix (a cache)

    @classmethod
    def create(cls, arena: ShmArena, cells: int) -> PresenceFilter:
        """Create the zeroed file beside ``arena`` (ValueError if it exists or ``cells`` is
        not a power of two >= 1024)."""
        check_cells(cells)
        shm = OwnedArena.create(arena.name + SUFFIX, cells, directory=os.path.dirname(arena.path),
                                prefault=False)
        return cls(shm)

    def bind(self, held: Callable[[], Iterable[NamespacedKey]]) -> None:
        """``held()`` lists the key of every DRAM copy and every served SSD copy (one entry
        per copy; ``NodeStore.held_keys``): called only when a whole tier is cleared, to
        recount from scratch."""
        self._held = held

    @property
    def name(self) -> str:
        return self.shm.name

    def prefix(self, namespace: Namespace) -> bytes:
        """The filter-key prefix of ``namespace``'s blocks (blake2b-128 keyed with this
        filter's secret): what its engines are told, and only they."""
        found = self._prefixes.get(namespace)
        if found is None:
            if len(self._prefixes) >= _PREFIXES_KEPT:
                self._prefixes.clear()
            found = hashlib.blake2b(namespace, key=self._secret, digest_size=16).digest()
            self._prefixes[namespace] = found
        return found

    def filter_key(self, key: NamespacedKey) -> bytes:
        """``prefix(namespace) || block hash`` of a namespaced key."""
        return self.prefix(Namespace(key[:NAMESPACE_LEN])) + key[NAMESPACE_LEN:]

    def cells_of(self, key: NamespacedKey) -> tuple[int, int]:
        """The two counters of a namespaced key."""
        return cells_of(self.filter_key(key), self.cells)

    def may_hold(self, key: NamespacedKey) -> bool:
        return all(self._counts[cell] != 0 for cell in self.cells_of(key))

    # -- TierListener --------------------------------------------------------------------------

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        weight = _WEIGHTS.get(tier)
        if weight is None:
            return
        counts = self._counts
        for key in keys:
            for cell in self.cells_of(key):
                counts[cell] = min(counts[cell] + weight, SATURATED)

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        weight = _WEIGHTS.get(tier)
        if weight is None:
            return
        counts = self._counts
        for key in keys:
            for cell in self.cells_of(key):
                if weight <= counts[cell] != SATURATED:  # else it stays "maybe"
                    counts[cell] -= weight

    def cleared(self, tier: Tier) -> None:
        """A whole tier went (the SSD turned unhealthy): recount what is still held (each copy
        as a DRAM copy: a "maybe in DRAM" too many costs a recompute at most)."""
        if tier not in _WEIGHTS:
            return
        self._counts[:] = bytes(self.cells)
        self.stored(list(self._held()), "dram")

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        """Nothing to do: the index reports the copy's removal separately."""

    def close(self) -> None:
        """Unmap and remove the file (engines still attached keep their mapping)."""
        self._counts.release()
        self.shm.close()
        self.shm.unlink()
