"""Per-tenant quotas: ``tenant_quotas`` (how much DRAM and SSD each tenant is guaranteed) and the
ledger that counts what each tenant uses and holds against it.

A tenant is the name the token file gives a token (or ``default_tenant``); quotas are keyed by
that name, never by the secret token. ``"*"`` is the share of every tenant not named. A share is
a byte size ("512MiB") or a part of the tier ("25%": of the arena, or of the SSD bound).

What counts against a tenant (``QuotaLedger``):

- **used**, per tier: the bytes of the blocks of its namespaces (DRAM: one slot each; SSD: each
  record at its block's size, neither header nor compression counted) plus, on DRAM, the slots
  its write leases reserve (named and blank). A tenant may use more than its quota while the
  tier has room no one else claims; past its quota its blocks are the first to go
  (``tierd.daemon.quota_eviction``).
- **held**, DRAM only: what no eviction can take: the blocks its read leases pin (each lease's
  blocks counted, a block pinned by two leases twice) and the slots its write leases reserve.
  Held bytes never pass the DRAM quota: a request is granted up to it (a shorter prefix, fewer
  slots) and refused with RESOURCE_EXHAUSTED when nothing fits; blank slots alone stay within
  ``blank_fraction`` of it. So with quotas that sum to at most the tier, every tenant within its
  share gets that share back by evicting over-quota blocks, at once; pins that passed the cap
  together (acquires reading from SSD at the same moment) end with their lease.

Blocks of a namespace whose tenant is unknown (an earlier daemon's records, never served) count
as over any quota, so they go first. The ledger is a ``TierListener`` of the tier index, told of
every block that comes and goes; the node store tells it of registrations and leases.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierd.types import Namespace, NamespacedKey, Tier
from tierd.wire.layout import NAMESPACE_LEN
from tierd.wire.replies import TenantUsage

if TYPE_CHECKING:
    from tierd.daemon.listeners import Payload

DEFAULT_KEY = "*"
"""The ``tenant_quotas`` key of the share of tenants not named."""

HoldKind = Literal["pinned", "reserved", "blank"]
HOLD_KINDS: tuple[HoldKind, ...] = ("pinned", "reserved", "blank")
QuotaTier = Literal["dram", "ssd"]
_TIERS: tuple[QuotaTier, ...] = ("dram", "ssd")


# -- the configuration --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Share:
    """A byte bound: ``amount`` bytes, or with ``of_tier`` that fraction of the tier."""

    amount: float
    of_tier: bool = False

    @classmethod
    def parse(cls, raw: object, where: str) -> Share:
        """``"512MiB"``, ``1073741824`` or ``"25%"``; ValueError naming ``where`` otherwise."""
        from tierd.daemon.config import parse_bytes

        if isinstance(raw, str) and raw.strip().endswith("%"):
            try:
                percent = float(raw.strip()[:-1])
            except ValueError:
                percent = -1.0
            if not 0.0 <= percent <= 100.0:
                raise ValueError(f"{where} = {raw!r}: a share is 0% to 100% of the tier")
            return cls(percent / 100.0, of_tier=True)
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"{where} = {raw!r}: write a byte size ('512MiB', 1073741824) or a "
                             "share of the tier ('25%')")
        try:
            size = parse_bytes(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if size < 0:
            raise ValueError(f"{where} = {raw!r}: a byte size must be >= 0")
        return cls(float(size))

    def bytes_of(self, tier_bytes: int) -> int:
        """The bound in bytes, for a tier of ``tier_bytes``."""
        return int(self.amount * tier_bytes) if self.of_tier else int(self.amount)

    def __str__(self) -> str:
        return f"{self.amount * 100:g}%" if self.of_tier else str(int(self.amount))


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """One tenant's shares (None: no bound on that tier)."""

    dram: Share | None = None
    ssd: Share | None = None


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    """The ``tenant_quotas`` config key: shares by tenant name, and ``default`` for the tenants
    not named (None: they have no bound). Empty: no quotas, plain LRU across tenants."""

    tenants: tuple[tuple[str, QuotaSpec], ...] = ()
    default: QuotaSpec | None = None

    def __bool__(self) -> bool:
        return bool(self.tenants) or self.default is not None

    def spec_for(self, tenant: str) -> QuotaSpec | None:
        """The shares of ``tenant``: its own entry, else the default."""
        return next((spec for name, spec in self.tenants if name == tenant), self.default)

    @classmethod
    def parse(cls, raw: object) -> TenantQuotas:
        """From a TOML table (the config file) or the text of an inline one (environment and
        flag: ``{ team-a = { dram = "512MiB", ssd = "4GiB" }, "*" = { dram = "10%" } }``).
        ValueError naming the entry to fix."""
        if isinstance(raw, TenantQuotas):
            return raw
        if isinstance(raw, str):
            if not raw.strip():
                return cls()
            try:
                raw = tomllib.loads("tenant_quotas = " + raw)["tenant_quotas"]
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"tenant_quotas is not an inline TOML table ({exc}): write "
                                 "{ team-a = { dram = \"512MiB\", ssd = \"4GiB\" } }") from None
        if not isinstance(raw, Mapping):
            raise ValueError("tenant_quotas must be a table of tenant = { dram = ..., ssd = ... }")
        tenants: list[tuple[str, QuotaSpec]] = []
        default = None
        for tenant, entry in raw.items():
            where = f"tenant_quotas.{tenant}"
            if not isinstance(tenant, str) or not tenant:
                raise ValueError("tenant_quotas: a tenant name must be a non-empty string")
            if not isinstance(entry, Mapping) or not entry or set(entry) - set(_TIERS):
                raise ValueError(f"{where} must be a table of dram and/or ssd shares, e.g. "
                                 "{ dram = \"512MiB\", ssd = \"25%\" }")
            spec = QuotaSpec(*(Share.parse(entry[t], f"{where}.{t}") if t in entry else None
                               for t in _TIERS))
            if tenant == DEFAULT_KEY:
                default = spec
            else:
                tenants.append((tenant, spec))
        return cls(tuple(sorted(tenants)), default)

    def describe(self) -> str:
        """One line for the start-up log."""
        def one(name: str, spec: QuotaSpec) -> str:
            return f"{name} (DRAM {spec.dram or '-'}, SSD {spec.ssd or '-'})"
        parts = [one(name, spec) for name, spec in self.tenants]
        if self.default is not None:
            parts.append(one("others", self.default))
        return ", ".join(parts) if parts else "none"


@dataclass(frozen=True, slots=True)
class Quota:
    """One tenant's bounds in bytes (None: no bound)."""

    dram: int | None
    ssd: int | None


@dataclass(slots=True)
class _Space:
    """One namespace: whose it is, its block size, its registered engines and blocks per tier."""

    tenant: str | None       # None: unknown (an earlier daemon's records)
    block_bytes: int
    engines: int = 0
    dram: int = 0
    ssd: int = 0


class QuotaLedger:
    """Per-tenant used and held bytes (see the module doc). Not thread-safe: one event loop
    (the metrics thread only reads copies).

    ``resolve(namespace)``: the (tenant, block bytes) of a namespace no engine registered yet
    (the model table's record of it), or None."""

    def __init__(self, quotas: TenantQuotas, dram_bytes: int, ssd_bytes: int,
                 blank_fraction: float,
                 resolve: Callable[[Namespace], tuple[str, int] | None] = lambda ns: None
                 ) -> None:
        self.quotas = quotas
        self.on = bool(quotas)
        self._tier_bytes = {"dram": dram_bytes, "ssd": ssd_bytes}
        self._blank_fraction, self._resolve = blank_fraction, resolve
        self._spaces: dict[Namespace, _Space] = {}
        self._used: dict[QuotaTier, Counter[str]] = {t: Counter() for t in _TIERS}  # blocks
        self._held: dict[HoldKind, Counter[str]] = {k: Counter() for k in HOLD_KINDS}
        self._quota: dict[str, Quota] = {}
        self.limited: Counter[str] = Counter()   # tenant -> requests cut by its quota

    # -- who and how much --------------------------------------------------------------------

    def quota(self, tenant: str) -> Quota:
        """``tenant``'s bounds in bytes."""
        found = self._quota.get(tenant)
        if found is None:
            spec = self.quotas.spec_for(tenant) or QuotaSpec()
            found = self._quota[tenant] = Quota(*(
                s.bytes_of(self._tier_bytes[t]) if s is not None else None
                for t, s in zip(_TIERS, (spec.dram, spec.ssd))))
        return found

    def tenant_of(self, namespace: Namespace) -> str | None:
        """The tenant of a namespace holding blocks or engines; None if unknown."""
        space = self._spaces.get(namespace)
        return space.tenant if space is not None else None

    def used(self, tenant: str, tier: QuotaTier) -> int:
        """Bytes ``tenant`` uses in ``tier`` (DRAM: reserved slots included)."""
        used = self._used[tier][tenant]
        if tier == "dram":
            used += self._held["reserved"][tenant] + self._held["blank"][tenant]
        return used

    def over(self, tenant: str | None, tier: QuotaTier, extra: int = 0) -> bool:
        """Whether ``tenant`` would use more than its quota of ``tier`` with ``extra`` bytes
        more (negative: fewer). Never without quotas; always for an unknown tenant."""
        if not self.on:
            return False
        if tenant is None:
            return True
        bound = getattr(self.quota(tenant), tier)
        return bound is not None and self.used(tenant, tier) + extra > bound

    def over_tenants(self, tier: QuotaTier) -> set[str | None]:
        """The tenants over their quota of ``tier`` (None: blocks of unknown tenants)."""
        if not self.on:
            return set()
        tenants = set(self._used[tier]) | set(self._held["reserved"]) | set(self._held["blank"])
        found: set[str | None] = {t for t in tenants if self.over(t, tier)}
        if any(s.tenant is None and getattr(s, tier) for s in self._spaces.values()):
            found.add(None)
        return found

    def block_bytes(self, namespace: Namespace) -> int:
        """Bytes of one block of ``namespace`` (0 if unknown)."""
        space = self._spaces.get(namespace)
        return space.block_bytes if space is not None else 0

    def held(self, tenant: str) -> int:
        """DRAM bytes ``tenant``'s leases hold: pinned blocks and reserved slots."""
        return sum(self._held[k][tenant] for k in HOLD_KINDS)

    def room(self, tenant: str, slot_bytes: int, blank: bool = False) -> int | None:
        """How many more slots of ``slot_bytes`` ``tenant`` may hold (pin or reserve; ``blank``:
        as blank slots) within its DRAM quota; None: no bound."""
        bound = self.quota(tenant).dram
        if bound is None:
            return None
        room = max(0, bound - self.held(tenant)) // slot_bytes
        if blank:
            blank_room = max(0, int(self._blank_fraction * bound) - self._held["blank"][tenant])
            room = min(room, blank_room // slot_bytes)
        return room

    # -- what the node store tells it ----------------------------------------------------------

    def register(self, namespace: Namespace, tenant: str, block_bytes: int) -> None:
        """An engine of ``tenant`` registered in ``namespace``: its blocks are the tenant's."""
        space = self._spaces.get(namespace)
        if space is None:
            space = self._spaces[namespace] = _Space(tenant, block_bytes)
        elif space.tenant is None:  # its blocks were found before anyone claimed them
            space.tenant, space.block_bytes = tenant, block_bytes
            for tier in _TIERS:
                self._used[tier][tenant] += getattr(space, tier) * block_bytes
        assert space.tenant == tenant, "a namespace is one tenant's (blake2b of its name)"
        space.engines += 1

    def unregister(self, namespace: Namespace) -> None:
        """One engine of ``namespace`` left (its leases already ended)."""
        space = self._spaces[namespace]
        space.engines -= 1
        self._forget_if_idle(namespace, space)

    def hold(self, tenant: str, kind: HoldKind, nbytes: int) -> None:
        """``tenant`` began (``nbytes`` > 0) or ended (< 0) holding bytes of ``kind``."""
        held = self._held[kind]
        held[tenant] += nbytes
        assert held[tenant] >= 0, f"{tenant}: more {kind} bytes ended than began"
        if not held[tenant]:
            del held[tenant]

    def note_limited(self, tenant: str) -> None:
        """A request of ``tenant`` was cut short or refused by its quota."""
        self.limited[tenant] += 1

    # -- TierListener ----------------------------------------------------------------------------

    def stored(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        if tier == "dram" or tier == "ssd":
            for namespace, n in _by_namespace(keys):
                self._count(namespace, tier, n)

    def removed(self, keys: Sequence[NamespacedKey], tier: Tier) -> None:
        if tier == "dram" or tier == "ssd":
            for namespace, n in _by_namespace(keys):
                self._count(namespace, tier, -n)

    def cleared(self, tier: Tier) -> None:
        if tier == "dram" or tier == "ssd":
            self._used[tier].clear()
            for namespace, space in list(self._spaces.items()):
                setattr(space, tier, 0)
                self._forget_if_idle(namespace, space)

    def evicted(self, key: NamespacedKey, checksum: int, nbytes: int, payload: Payload) -> None:
        pass

    def _count(self, namespace: Namespace, tier: QuotaTier, n: int) -> None:
        space = self._spaces.get(namespace)
        if space is None:
            known = self._resolve(namespace)
            space = self._spaces[namespace] = (_Space(*known) if known is not None
                                               else _Space(None, 0))
        setattr(space, tier, getattr(space, tier) + n)
        assert getattr(space, tier) >= 0, f"more {tier} blocks removed than stored"
        if space.tenant is not None:
            used = self._used[tier]
            used[space.tenant] += n * space.block_bytes
            if not used[space.tenant]:
                del used[space.tenant]
        if n < 0:
            self._forget_if_idle(namespace, space)

    def _forget_if_idle(self, namespace: Namespace, space: _Space) -> None:
        if not (space.engines or space.dram or space.ssd):
            del self._spaces[namespace]

    # -- reading ---------------------------------------------------------------------------------

    def usage(self, tenants: Iterable[str] | None = None) -> list[TenantUsage]:
        """The rows of ``tenants`` (None: every tenant that uses, holds or has a quota), by
        name."""
        if tenants is None:  # copies first: the metrics thread reads while the loop writes
            tenants = {s.tenant for s in list(self._spaces.values()) if s.tenant is not None}
            tenants |= {name for name, _ in self.quotas.tenants}
            tenants |= {t for held in self._held.values() for t in list(held)}
        rows = []
        for tenant in sorted(tenants):
            quota = self.quota(tenant)
            held = {k: self._held[k][tenant] for k in HOLD_KINDS}
            rows.append(TenantUsage(tenant, self.used(tenant, "dram"), quota.dram,
                                    self.used(tenant, "ssd"), quota.ssd, held["pinned"],
                                    held["reserved"] + held["blank"], held["blank"],
                                    self.limited[tenant]))
        return rows

    def check_integrity(self, held_keys: Mapping[QuotaTier, Iterable[NamespacedKey]],
                        holds: Mapping[tuple[str, HoldKind], int]) -> None:
        """Assert the counts equal the blocks of each tier in ``held_keys`` (the indexes' keys;
        SSD as the listeners were last told), the held bytes equal ``holds`` (what the live
        leases hold, by tenant and kind), and every namespace kept has an engine or a block."""
        for tier in _TIERS:
            want = Counter(Namespace(k[:NAMESPACE_LEN]) for k in held_keys[tier])
            have = {ns: getattr(s, tier) for ns, s in self._spaces.items() if getattr(s, tier)}
            assert have == dict(want), f"per-tenant {tier} block counts drifted from the index"
            used: Counter[str] = Counter()
            for s in self._spaces.values():
                if s.tenant is not None:
                    used[s.tenant] += getattr(s, tier) * s.block_bytes
            assert +used == +self._used[tier], f"per-tenant {tier} bytes disagree with blocks"
        have_holds = {(t, k): n for k in HOLD_KINDS for t, n in self._held[k].items() if n}
        assert have_holds == {tk: n for tk, n in holds.items() if n}, (
            "per-tenant pinned / reserved bytes disagree with the live leases")
        assert all(s.engines or s.dram or s.ssd for s in self._spaces.values()), (
            "a namespace with neither engine nor block is kept")


def _by_namespace(keys: Sequence[NamespacedKey]) -> Iterator[tuple[Namespace, int]]:
    """``keys`` counted by namespace (one event's keys are nearly always one namespace)."""
    if not keys:
        return iter(())
    first = keys[0][:NAMESPACE_LEN]
    if all(k[:NAMESPACE_LEN] == first for k in keys):
        return iter(((Namespace(first), len(keys)),))
    return iter(Counter(Namespace(k[:NAMESPACE_LEN]) for k in keys).items())


class QuotaCollector:
    """The ledger as Prometheus families, labelled by tenant name (never a token, never an
    engine id), read when scraped on the metrics server's thread."""

    def __init__(self, ledger: QuotaLedger) -> None:
        self._ledger = ledger

    def describe(self) -> list[Any]:
        return list(self.collect())

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows = self._ledger.usage()
        used = GaugeMetricFamily("tierd_tenant_used_bytes", "Bytes a tenant uses (DRAM: "
                                 "reserved slots included)", labels=["tenant", "tier"])
        quota = GaugeMetricFamily("tierd_tenant_quota_bytes", "A tenant's quota (tenant_quotas)",
                                  labels=["tenant", "tier"])
        held = GaugeMetricFamily("tierd_tenant_held_bytes", "DRAM bytes a tenant's leases hold",
                                 labels=["tenant", "kind"])
        limited = CounterMetricFamily("tierd_tenant_quota_limited", "Requests its quota cut "
                                      "short or refused", labels=["tenant"])
        for r in rows:
            for tier, n, bound in (("dram", r.dram_bytes, r.dram_quota),
                                   ("ssd", r.ssd_bytes, r.ssd_quota)):
                used.add_metric([r.tenant, tier], n)
                if bound is not None:
                    quota.add_metric([r.tenant, tier], bound)
            held.add_metric([r.tenant, "pinned"], r.pinned_bytes)
            held.add_metric([r.tenant, "reserved"], r.reserved_bytes - r.blank_bytes)
            held.add_metric([r.tenant, "blank"], r.blank_bytes)
            limited.add_metric([r.tenant], r.limited)
        yield from (used, quota, held, limited)
