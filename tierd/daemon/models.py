"""Occupancy and hits per model: what ``tierd stats`` shows for each model of a tenant.

A ``TierListener`` over the node's tiers: it counts each namespace's blocks per tier as they come
and go (so ``check_integrity`` can compare with the indexes), and the store adds each lookup's
queried and hit tokens. A namespace's model (tenant, model id, block bytes) is learned when an
engine registers in it and kept in ``models.json`` in the SSD directory, so SSD blocks found
after a restart are attributed before any engine is back. Blocks of a namespace no engine ever
registered with this daemon (an earlier tierd's, which can never be served) count in the tier
totals only.

Bounded: a namespace's counters live while it holds blocks; its model entry while it holds
blocks or was registered among the last ``max_idle`` idle ones.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tierd.daemon.layout import NAMESPACE_LEN
from tierd.types import Namespace, NamespacedKey, Tier

if TYPE_CHECKING:
    from tierd.daemon.listeners import Payload

_log = logging.getLogger(__name__)

FILE_NAME = "models.json"
_COUNTED: tuple[Tier, ...] = ("hbm", "dram", "ssd")


@dataclass(frozen=True, slots=True)
class NamespaceModel:
    """Whose blocks a namespace holds and how big each is."""

    tenant: str
    model_id: str
    block_bytes: int


@dataclass(frozen=True, slots=True)
class ModelUsage:
    """One model's share of the node (its tenant's namespaces of that model id, summed)."""

    model_id: str
    blocks: dict[Tier, int]
    """Blocks per tier ("hbm": summed over the engines that report them)."""
    bytes: dict[Tier, int]
    query_tokens: int
    hit_tokens: int
    engines: int
    """Engines of this model registered now."""


@dataclass(slots=True)
class _Counts:
    blocks: Counter[Tier] = field(default_factory=Counter)
    query_tokens: int = 0
    hit_tokens: int = 0


class ModelTable:
    """Per-namespace counters and the namespace -> model map. Not thread-safe: one event loop.

    ``directory``: where ``models.json`` lives (the SSD directory; None: nothing is kept)."""

    def __init__(self, directory: str | os.PathLike[str] | None, max_idle: int = 1024) -> None:
        self._path = Path(directory) / FILE_NAME if directory is not None else None
        self._max_idle = max_idle
        self._models: OrderedDict[Namespace, NamespaceModel] = OrderedDict()  # LRU by register
        self._counts: dict[Namespace, _Counts] = {}

    def load(self) -> None:
        """Read ``models.json`` (a missing or unreadable file is an empty table, logged)."""
        if self._path is None or not self._path.exists():
            return
        try:
            raw = json.loads(self._path.read_text())
            for hex_ns, m in raw.items():
                self._models[Namespace(bytes.fromhex(hex_ns))] = NamespaceModel(
                    str(m["tenant"]), str(m["model_id"]), int(m["block_bytes"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            _log.warning("ignoring %s (%s): per-model stats start empty", self._path, e)
            self._models.clear()

    def registered(self, namespace: Namespace, model: NamespaceModel) -> None:
        """An engine registered in ``namespace``; writes ``models.json`` if it is new (a small
        synchronous write: registrations are rare)."""
        known = self._models.get(namespace)
        self._models[namespace] = model
        self._models.move_to_end(namespace)
        if known != model:
            self._prune()
            self._save()

    def queried(self, namespace: Namespace, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup of ``namespace``'s engine."""
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
        for counts in self._counts.values():
            counts.blocks.pop(tier, None)

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        pass

    def check_integrity(self, held: dict[Tier, Iterable[NamespacedKey]]) -> None:
        """Assert the counters equal the blocks of each tier in ``held`` (the indexes' keys)."""
        for tier, keys in held.items():
            want = Counter(Namespace(k[:NAMESPACE_LEN]) for k in keys)
            have = {ns: c.blocks[tier] for ns, c in self._counts.items() if c.blocks[tier]}
            assert have == dict(want), f"per-model {tier} counts drifted from the index"
        assert len(self._models) <= self._max_idle + len(self._counts), "model table unbounded"

    def _add(self, keys: Sequence[NamespacedKey], tier: Tier, sign: int) -> None:
        for namespace, n in Counter(Namespace(k[:NAMESPACE_LEN]) for k in keys).items():
            counts = self._counts.setdefault(namespace, _Counts())
            counts.blocks[tier] += sign * n
            assert counts.blocks[tier] >= 0, f"more {tier} blocks removed than stored"
            if not counts.blocks[tier]:
                del counts.blocks[tier]
                if not counts.blocks and namespace not in self._models:
                    del self._counts[namespace]  # an unknown namespace's last block left

    def _prune(self) -> None:
        idle = [ns for ns in self._models if not self._has_blocks(ns)]
        for namespace in idle[:max(0, len(idle) - self._max_idle)]:
            del self._models[namespace]
            self._counts.pop(namespace, None)

    def _has_blocks(self, namespace: Namespace) -> bool:
        counts = self._counts.get(namespace)
        return counts is not None and any(counts.blocks.values())

    def _save(self) -> None:
        if self._path is None:
            return
        body = {ns.hex(): {"tenant": m.tenant, "model_id": m.model_id,
                           "block_bytes": m.block_bytes} for ns, m in self._models.items()}
        tmp = self._path.with_name(FILE_NAME + ".new")
        try:
            with open(tmp, "w") as f:
                json.dump(body, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        except OSError as e:  # an unwritable SSD directory: stats lose labels on restart only
            _log.warning("cannot write %s (%s): per-model stats restart empty", self._path, e)
