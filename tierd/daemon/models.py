"""Occupancy and hits per model: what ``tierd stats`` shows for each model of a tenant.

A ``TierListener`` over the node's tiers: it counts each namespace's blocks per tier as they come
and go (so ``check_integrity`` can compare with the indexes), and the store adds each lookup's
queried and hit tokens. A namespace's model (tenant, model id, block bytes) is learned when an
engine registers in it and kept in ``models.json`` in the SSD directory (``model_file``), so SSD
blocks found after a restart are attributed before any engine is back. Blocks of a namespace not
in the table (an earlier tierd's, or one dropped from it) count in the tier totals only.

Bounded: the table holds at most ``max_models`` namespaces, more only while more than that have
an engine registered (those are never dropped; the engine table bounds them). Past the bound the
least recently registered namespaces without an engine go first, those holding no block before
those holding blocks. A namespace's counters live while it is in the table or holds blocks.

The file is read once, at ``open``, and rewritten whole (``statefile.StateWriter``: on a thread of
its own, latest content wins) when the table changes; only while the SSD directory's lock is held.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierd.daemon.model_file import ENTRY_BYTES, FILE_NAME, parse, render
from tierd.daemon.model_file import NamespaceModel as NamespaceModel
from tierd.daemon.ssd.statefile import StateWriter, read_state
from tierd.types import Namespace, NamespacedKey, Tier
from tierd.wire.layout import NAMESPACE_LEN
from tierd.wire.replies import ModelUsage

if TYPE_CHECKING:
    from tierd.daemon.listeners import Payload

_log = logging.getLogger(__name__)

_COUNTED: tuple[Tier, ...] = ("hbm", "dram", "ssd")


@dataclass(slots=True)
class _Counts:
    blocks: Counter[Tier] = field(default_factory=Counter)
    query_tokens: int = 0
    hit_tokens: int = 0


class ModelTable:
    """Per-namespace counters and the namespace -> model map. Not thread-safe: one event loop
    (only the file is written on a thread of its own)."""

    def __init__(self, max_models: int = 1024) -> None:
        if max_models < 1:
            raise ValueError(f"max_models must be >= 1, got {max_models}")
        self._max_models = max_models
        self._models: OrderedDict[Namespace, NamespaceModel] = OrderedDict()  # LRU by register
        self._engines: Counter[Namespace] = Counter()  # registered engines per namespace
        self._counts: dict[Namespace, _Counts] = {}
        self._writer: StateWriter | None = None

    def open(self, dir_fd: int | None, directory: str) -> None:
        """Read ``models.json`` from ``directory``, open as ``dir_fd`` (the SSD directory, its
        lock held: ``SsdStore.state_directory``; None: nothing is read or written), and keep it
        there from now on. A missing file is an empty table. So is one that is not a regular
        file of ours of at most ``ENTRY_BYTES * max_models`` bytes, or that ``parse`` refuses:
        one warning names the file and the fault, and the daemon starts anyway. Blocks for one
        small read; call once, before any engine registers."""
        assert not self._models and self._writer is None, "model table opened twice or late"
        if dir_fd is None:
            return
        path = os.path.join(directory, FILE_NAME)
        found = read_state(dir_fd, FILE_NAME, ENTRY_BYTES * self._max_models)
        if found.tightened is not None:
            _log.info("%s was mode %04o; made 0600", path, found.tightened)
        problem = found.problem
        if found.data is not None:
            try:
                self._models.update(parse(found.data, self._max_models))
            except ValueError as e:
                problem = str(e)
        if problem is not None:
            _log.warning("ignoring %s (%s): per-model stats start empty; the file is rewritten "
                         "at the next registration", path, problem)
        self._writer = StateWriter(dir_fd, FILE_NAME, path)

    def close(self) -> None:
        """Finish writing ``models.json`` (blocks for that write); nothing is written after.
        Call before the SSD store closes. Idempotent."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def registered(self, namespace: Namespace, model: NamespaceModel) -> None:
        """An engine registered in ``namespace``: its model stays in the table until the engine
        unregisters (``unregistered``). A new entry drops the oldest ones past ``max_models``
        and has ``models.json`` rewritten in the background; never blocks."""
        self._engines[namespace] += 1
        known = self._models.get(namespace)
        self._models[namespace] = model
        self._models.move_to_end(namespace)
        if known != model:
            self._prune()
            self._save()

    def unregistered(self, namespace: Namespace) -> None:
        """An engine of ``namespace`` unregistered (or lapsed)."""
        assert self._engines[namespace] > 0, "an engine unregistered twice"
        self._engines[namespace] -= 1
        if not self._engines[namespace]:
            del self._engines[namespace]
            if self._prune():
                self._save()

    def model_of(self, namespace: Namespace) -> NamespaceModel | None:
        """The model a namespace's engines registered (here or, from the file, before)."""
        return self._models.get(namespace)

    def namespaces_of(self, tenant: str) -> list[tuple[Namespace, NamespaceModel]]:
        """``tenant``'s namespaces in the table, least recently registered first."""
        return [(ns, m) for ns, m in self._models.items() if m.tenant == tenant]

    def lookups(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tenant, model id) -> (queried, hit) tokens of every namespace in the table, summed.
        Safe from another thread (reads copies) for a metrics scrape."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        counts = dict(self._counts)
        for namespace, model in list(self._models.items()):
            c = counts.get(namespace)
            key = (model.tenant, model.model_id)
            queried, hit = out.get(key, (0, 0))
            out[key] = (queried + (c.query_tokens if c else 0), hit + (c.hit_tokens if c else 0))
        return out

    def blocks_in(self, namespace: Namespace) -> dict[Tier, int]:
        """Blocks ``namespace`` holds per tier ("hbm": summed over the engines reporting)."""
        counts = self._counts.get(namespace)
        return dict(counts.blocks) if counts is not None else {}

    def queried(self, namespace: Namespace, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup of ``namespace``'s engine."""
        if namespace not in self._models:
            return  # not an engine's now: its counters would outlive every prune
        counts = self._counts.setdefault(namespace, _Counts())
        counts.query_tokens += query_tokens
        counts.hit_tokens += hit_tokens

    def usage_of(self, tenant: str, engine_namespaces: Iterable[Namespace]) -> list[ModelUsage]:
        """``tenant``'s models, most bytes first; ``engine_namespaces``: one per registered
        engine of the tenant."""
        engines = Counter(engine_namespaces)
        rows: dict[str, dict[str, Counter[str]]] = {}
        for namespace, model in self._models.items():
            if model.tenant != tenant:
                continue
            counts = self._counts.get(namespace, _Counts())
            row = rows.setdefault(model.model_id, {"blocks": Counter(), "bytes": Counter(),
                                                   "other": Counter()})
            for tier, n in counts.blocks.items():
                row["blocks"][tier] += n
                row["bytes"][tier] += n * model.block_bytes
            row["other"].update(query=counts.query_tokens, hit=counts.hit_tokens,
                                engines=engines[namespace])
        out = [ModelUsage(model_id, {t: row["blocks"][t] for t in _COUNTED},
                          {t: row["bytes"][t] for t in _COUNTED}, row["other"]["query"],
                          row["other"]["hit"], row["other"]["engines"])
               for model_id, row in rows.items()]
        return sorted(out, key=lambda u: (-sum(u.bytes.values()), u.model_id))

    # -- TierListener ---------------------------------------------------------------------------

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        self._add(keys, tier, 1)

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        self._add(keys, tier, -1)

    def cleared(self, tier: Tier) -> None:
        for namespace, counts in list(self._counts.items()):
            counts.blocks.pop(tier, None)
            if not counts.blocks and namespace not in self._models:
                del self._counts[namespace]

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        pass

    def check_integrity(self, held: dict[Tier, Iterable[NamespacedKey]]) -> None:
        """Assert the counters equal the blocks of each tier in ``held`` (the indexes' keys),
        and the bounds: at most ``max_models`` entries unless every one has an engine, every
        registered engine's entry present, no counters of a namespace outside the table without
        blocks."""
        for tier, keys in held.items():
            want = Counter(Namespace(k[:NAMESPACE_LEN]) for k in keys)
            have = {ns: c.blocks[tier] for ns, c in self._counts.items() if c.blocks[tier]}
            assert have == dict(want), f"per-model {tier} counts drifted from the index"
        assert len(self._models) <= self._max_models or all(
            self._engines[ns] for ns in self._models), "model table over max_models"
        assert all(n > 0 for n in self._engines.values()), "an engine count is not positive"
        assert all(ns in self._models for ns in self._engines), "a registered engine's model left"
        assert all(ns in self._models or c.blocks for ns, c in self._counts.items()), \
            "counters of a namespace neither in the table nor holding blocks"

    def _add(self, keys: Sequence[NamespacedKey], tier: Tier, sign: int) -> None:
        for namespace, n in Counter(Namespace(k[:NAMESPACE_LEN]) for k in keys).items():
            counts = self._counts.setdefault(namespace, _Counts())
            counts.blocks[tier] += sign * n
            assert counts.blocks[tier] >= 0, f"more {tier} blocks removed than stored"
            if not counts.blocks[tier]:
                del counts.blocks[tier]
                if not counts.blocks and namespace not in self._models:
                    del self._counts[namespace]  # an unknown namespace's last block left

    def _prune(self) -> bool:
        """Drop the oldest entries without an engine past ``max_models``, those without blocks
        first (their counters go too; a dropped namespace's blocks keep theirs). Whether any
        was dropped."""
        excess = len(self._models) - self._max_models
        if excess <= 0:
            return False
        free = [ns for ns in self._models if not self._engines[ns]]
        idle = [ns for ns in free if not self._has_blocks(ns)]
        held = [ns for ns in free if self._has_blocks(ns)]
        dropped = (idle + held)[:excess]
        for namespace in dropped:
            del self._models[namespace]
            if not self._has_blocks(namespace):
                self._counts.pop(namespace, None)
        return bool(dropped)

    def _has_blocks(self, namespace: Namespace) -> bool:
        counts = self._counts.get(namespace)
        return counts is not None and any(counts.blocks.values())

    def _save(self) -> None:
        """Have ``models.json`` rewritten from a snapshot of the table (on the writer's thread)."""
        if self._writer is not None:
            entries = list(self._models.items())
            self._writer.submit(lambda: render(entries))
