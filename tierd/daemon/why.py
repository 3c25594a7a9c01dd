"""Why a prompt missed: where each block of its chain lives on this node and, at the first block
that does not, the likeliest cause (``tierd why``).

Read-only: nothing here pins, touches an LRU order or counts a lookup. Three causes are told
apart at the first miss:

- **evicted**: the ghost list (``tierd.daemon.ghosts``) remembers the block leaving: when, from
  which tier, under which pressure;
- **stored under another namespace**: the same tokens are held under another namespace of the
  same tenant, hashed with other settings (the caller sends the prompt's chain for each variant
  it can think of: another hash algorithm, seed, cache salt, block size, no LoRA) or computed
  under another layout or model (the tenant's registered engines give their layouts; the model
  table gives model id and block bytes of the others). The answer names what differs;
- **never stored**: neither (``namespace_blocks`` 0: nothing at all is stored under the
  namespace, so the engine stores nothing for this tenant and layout).

Tenant isolation: only the caller's tenant's namespaces are searched and named; another tenant's
blocks are never looked at, whatever hashes the caller sends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from tierd.daemon.engines import EngineTable
from tierd.daemon.ghosts import PRESSURES, Pressure
from tierd.daemon.hbm import HbmIndex
from tierd.daemon.models import ModelTable
from tierd.daemon.node_types import EngineInfo, NodeConfig
from tierd.daemon.tier_index import TierIndex
from tierd.types import BlockHash, Namespace, NamespacedKey, Placement, Tier, make_key, make_keys
from tierd.wire.layout import Layout, namespace_for

MAX_VARIANTS = 16
"""Most variant chains one question may carry."""


@dataclass(frozen=True, slots=True)
class Variant:
    """The prompt hashed with other settings: ``differs`` says which (in the caller's words,
    e.g. "hash algorithm xxhash_cbor"); ``block_size`` tokens per block of ``hashes``."""

    differs: str
    block_size: int
    hashes: Sequence[BlockHash]


@dataclass(frozen=True, slots=True)
class BlockWhere:
    """Where one block of the chain lives: the engines of the caller's tenant that report it in
    HBM, and whether DRAM and the (served) SSD tier hold it."""

    hbm_engines: tuple[str, ...]
    dram: bool
    ssd: bool

    @property
    def held(self) -> bool:
        return bool(self.hbm_engines) or self.dram or self.ssd


@dataclass(frozen=True, slots=True)
class Evicted:
    """The first missing block's departure, from the ghost list."""

    seconds_ago: float
    idle_seconds: float         # unused for this long when it left
    tier: Tier                  # the tier its last copy left from
    pressure: Pressure

    @property
    def cause(self) -> str:
        return PRESSURES[self.pressure]


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """The prompt's tokens held under another namespace of the same tenant: ``tokens`` of them
    from the start, under ``model_id``; ``differs``: each setting that differs from the
    question's (hashing settings as the variant names them, then layout fields)."""

    model_id: str
    differs: tuple[str, ...]
    tokens: int


@dataclass(frozen=True, slots=True)
class WhyAnswer:
    """``blocks``: one per block of the chain. ``first_miss``: index of the first block not
    held (``len(blocks)`` when all are). ``evicted`` and ``elsewhere`` explain that block.
    ``namespace_blocks``: blocks the question's namespace holds on the node, all tiers;
    ``engines``: the tenant's engines registered in it now."""

    blocks: list[BlockWhere]
    first_miss: int
    evicted: Evicted | None
    elsewhere: list[Elsewhere]
    namespace_blocks: int
    engines: int
    ssd_min_hits: int
    cluster: bool = False
    """Whether the daemon is a cluster node; then ``nodes`` are the cluster's holders of the
    chain (``Placement``s as Locate ranks them) unless ``cluster_stale``."""
    nodes: list[Placement] = field(default_factory=list)
    cluster_stale: bool = False


class Explainer:
    """Answers ``tierd why`` from the node's indexes (see the module doc). Never blocks."""

    def __init__(self, tiers: TierIndex, hbm: HbmIndex, engines: EngineTable,
                 models: ModelTable, clock: Callable[[], float], config: NodeConfig) -> None:
        self._tiers, self._hbm, self._engines, self._models = tiers, hbm, engines, models
        self._clock, self._ssd_min_hits = clock, config.ssd_min_hits
        self._max_blocks = config.max_blocks_per_request

    def explain(self, tenant: str, layout: Layout, hashes: Sequence[BlockHash],
                variants: Sequence[Variant] = ()) -> WhyAnswer:
        """Where ``hashes`` (``tenant``'s chain in ``layout``) live and why the first missing
        block misses. ValueError for a bad layout or hash, more than ``MAX_VARIANTS`` variants
        or a chain longer than ``max_blocks_per_request``."""
        namespace = namespace_for(tenant, layout)
        if len(variants) > MAX_VARIANTS:
            raise ValueError(f"{len(variants)} variant chains; at most {MAX_VARIANTS}")
        for chain in (hashes, *(v.hashes for v in variants)):
            if len(chain) > self._max_blocks:
                raise ValueError(f"a chain of {len(chain)} blocks; at most {self._max_blocks} "
                                 "(max_blocks_per_request): ask about a shorter prompt")
            make_keys(namespace, chain)  # ValueError for a hash of a wrong length
        engines = self._engines.of_tenant(tenant)
        own = [e for e in engines if e.namespace == namespace]
        keys = make_keys(namespace, hashes)
        blocks = [self._where(key, block_hash, own) for key, block_hash in zip(keys, hashes)]
        first_miss = next((i for i, b in enumerate(blocks) if not b.held), len(blocks))
        evicted: Evicted | None = None
        elsewhere: list[Elsewhere] = []
        if first_miss < len(blocks):
            ghost = self._tiers.ghosts.get(keys[first_miss])
            if ghost is not None:
                now = self._clock()
                evicted = Evicted(max(0.0, now - ghost.left_at),
                                  max(0.0, ghost.left_at - ghost.last_access), ghost.tier,
                                  ghost.pressure)
            elsewhere = self._elsewhere(tenant, namespace, layout, hashes, variants,
                                        first_miss * layout.block_size, engines)
        held = self._models.blocks_in(namespace)
        return WhyAnswer(blocks, first_miss, evicted, elsewhere, sum(held.values()), len(own),
                         self._ssd_min_hits)

    def _where(self, key: NamespacedKey, block_hash: BlockHash,
               engines: Sequence[EngineInfo]) -> BlockWhere:
        tiers = self._tiers
        return BlockWhere(tuple(e.engine_id for e in engines
                                if block_hash in self._hbm.held(e.engine_id)),
                          tiers.dram.get(key) is not None, tiers.ssd_up and key in tiers.disk)

    def _held_run(self, namespace: Namespace, hashes: Sequence[BlockHash],
                  engines: Sequence[EngineInfo]) -> int:
        """Consecutive blocks of ``hashes`` held under ``namespace``, from the first."""
        mine = [e for e in engines if e.namespace == namespace]
        run = 0
        for block_hash in hashes:
            if not self._where(make_key(namespace, block_hash), block_hash, mine).held:
                break
            run += 1
        return run

    def _elsewhere(self, tenant: str, namespace: Namespace, layout: Layout,
                   hashes: Sequence[BlockHash], variants: Sequence[Variant], missed_at: int,
                   engines: Sequence[EngineInfo]) -> list[Elsewhere]:
        """Every (namespace of ``tenant``, chain) pair holding more of the prompt's tokens than
        the question's own chain does (``missed_at`` tokens), most tokens first."""
        found: list[Elsewhere] = []
        for other, model_id, differs in self._namespaces(tenant, namespace, layout, engines):
            for chain, block_size, hashed in ((hashes, layout.block_size, ()),
                                              *((v.hashes, v.block_size, (v.differs,))
                                                for v in variants)):
                if other == namespace and not hashed:
                    continue  # the question itself
                tokens = self._held_run(other, chain, engines) * block_size
                if tokens > missed_at:
                    found.append(Elsewhere(model_id, tuple(dict.fromkeys((*hashed, *differs))),
                                           tokens))
        return sorted(found, key=lambda e: (-e.tokens, e.differs))

    def _namespaces(self, tenant: str, namespace: Namespace, layout: Layout,
                    engines: Sequence[EngineInfo]) -> list[tuple[Namespace, str, tuple[str, ...]]]:
        """``tenant``'s namespaces (the question's first), each with its model id and the
        layout fields in which it differs from ``layout``: a registered engine's layout says
        exactly; the model table knows only model id and block bytes."""
        out: dict[Namespace, tuple[str, tuple[str, ...]]] = {namespace: (layout.model_id, ())}
        for engine in engines:
            if engine.namespace not in out:
                out[engine.namespace] = (engine.layout.model_id,
                                         layout_differences(layout, engine.layout))
        for other, model in self._models.namespaces_of(tenant):
            if other in out:
                continue
            differs = []
            if model.model_id != layout.model_id:
                differs.append(f"model_id {model.model_id}")
            if model.block_bytes != layout.block_bytes:
                differs.append(f"block bytes {model.block_bytes}")
            out[other] = (model.model_id, tuple(differs) or ("a layout field",))
        return [(ns, model_id, differs) for ns, (model_id, differs) in out.items()]


def layout_differences(want: Layout, have: Layout) -> tuple[str, ...]:
    """Each field of ``have`` that differs from ``want``, as ``"name value"``."""
    return tuple(f"{f.name} {getattr(have, f.name)}" for f in fields(Layout)
                 if getattr(have, f.name) != getattr(want, f.name))
