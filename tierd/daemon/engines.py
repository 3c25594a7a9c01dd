"""The registered engines: who each is, when it was last heard from, and the caps on them.

An engine registers once and then names its id in every call; each call is its heartbeat. One
silent for ``idle_seconds`` (a SIGKILLed engine never unregisters) has lapsed: the node store
unregisters it, ending its leases and dropping its HBM report, and its next call is NOT_FOUND
(the connectors re-register on NOT_FOUND). Registrations are capped per tenant
(``max_per_tenant``) and names in size (``max_name_bytes``), so no caller can grow the table or
the log without bound.

Engines sit in an ordered dict in the order they were last heard from, so a touch is one
``move_to_end`` and finding the lapsed ones pops from the front, O(lapsed).
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict

from tierd.daemon.errors import ResourceExhausted, UnknownEngine
from tierd.daemon.node_types import EngineCaps, EngineInfo
from tierd.wire.clip import clip


class EngineTable:
    """Engine id -> ``EngineInfo``, least recently heard from first. Not thread-safe."""

    def __init__(self, caps: EngineCaps) -> None:
        caps.validate()
        self.caps = caps
        self._engines: OrderedDict[str, EngineInfo] = OrderedDict()
        self._seen: dict[str, float] = {}
        self._per_tenant: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._engines)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def new_id(self, tenant: str, name: str) -> str:
        """A fresh engine id for ``tenant``'s engine ``name``. ValueError if the name is over
        ``max_name_bytes``; ResourceExhausted if the tenant is at ``max_engines_per_tenant``."""
        size = len(name.encode())
        if size > self.caps.max_name_bytes:
            raise ValueError(f"engine_name is {size} bytes; at most {self.caps.max_name_bytes} "
                             "(max_name_bytes): give a shorter name")
        if self._per_tenant[tenant] >= self.caps.max_per_tenant:
            raise ResourceExhausted(
                f"tenant {clip(tenant)} has {self._per_tenant[tenant]} engines registered, the "
                f"cap (max_engines_per_tenant = {self.caps.max_per_tenant}): unregister engines "
                "that are gone, or raise TIERD_MAX_ENGINES_PER_TENANT")
        while True:
            engine_id = f"{name}-{secrets.token_hex(4)}" if name else secrets.token_hex(8)
            if engine_id not in self._engines:
                return engine_id

    def add(self, info: EngineInfo, now: float) -> None:
        """Register ``info`` (its id from ``new_id``), heard from ``now``."""
        assert info.engine_id not in self._engines, f"engine {info.engine_id} registered twice"
        self._engines[info.engine_id] = info
        self._seen[info.engine_id] = now
        self._per_tenant[info.tenant] += 1

    def get(self, engine_id: str, now: float) -> EngineInfo:
        """The engine, now heard from; NotFound if unknown (or lapsed)."""
        info = self._engines.get(engine_id)
        if info is None:
            raise UnknownEngine(engine_id)
        self._seen[engine_id] = now
        self._engines.move_to_end(engine_id)
        return info

    def remove(self, engine_id: str) -> EngineInfo:
        """Forget a registered engine (KeyError if unknown: check with ``get`` first)."""
        info = self._engines.pop(engine_id)
        del self._seen[engine_id]
        self._per_tenant[info.tenant] -= 1
        if not self._per_tenant[info.tenant]:
            del self._per_tenant[info.tenant]
        return info

    def lapsed(self, now: float) -> list[str]:
        """Ids of the engines not heard from for ``idle_seconds`` (still registered: the caller
        unregisters them), least recently heard from first."""
        out: list[str] = []
        for engine_id in self._engines:
            if self._seen[engine_id] + self.caps.idle_seconds > now:
                break
            out.append(engine_id)
        return out

    def infos(self) -> list[EngineInfo]:
        """Every registered engine, least recently heard from first."""
        return list(self._engines.values())

    def of_tenant(self, tenant: str) -> list[EngineInfo]:
        """Engines of ``tenant`` (any order)."""
        return [info for info in self._engines.values() if info.tenant == tenant]

    def check_integrity(self) -> None:
        """Assert the heard-from times, their order and the per-tenant counts agree."""
        assert set(self._seen) == set(self._engines), "heard-from times of unknown engines"
        times = [self._seen[e] for e in self._engines]
        assert times == sorted(times), "engines out of heard-from order"
        counts = Counter(info.tenant for info in self._engines.values())
        assert counts == self._per_tenant, "per-tenant engine counts disagree"
        assert all(n <= self.caps.max_per_tenant for n in counts.values()), "tenant over its cap"
