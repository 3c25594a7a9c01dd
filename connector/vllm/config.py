"""The vLLM front ends' settings: the keys of ``kv_connector_extra_config`` (``TierdConnector``)
and of a ``TierdTier`` entry in ``secondary_tiers`` (the same keys, parsed by the same code)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tierd.connector.core.settings import ClientSettings
from tierd.model_identity import validate_model_id

_REMOVED = {
    "hash_algo": "vLLM 0.33 hashes every block itself (--prefix-caching-hash-algo)",
    "hash_seed": "vLLM 0.33 hashes every block itself (PYTHONHASHSEED seeds it)",
    "kv_cache_layout": "the layout is read from vLLM's KV tensors",
}
"""Keys of earlier tierd versions, and why they are gone (named in the error)."""

SAVE_POLICIES = ("write_through", "write_back")
"""The values of ``save_policy``."""


@dataclass(frozen=True, slots=True)
class TierdVllmConfig(ClientSettings):
    """The settings of ``TierdConnector`` (``kv_connector_extra_config``) and of ``TierdTier``
    (its ``secondary_tiers`` entry), same key names: the daemon client's (``ClientSettings``:
    ``socket_path``, ``address``, ``token``, ``engine_name``, ``timeout_seconds``,
    ``retry_seconds``, ``retry_max_seconds``) and these; keys marked "TierdTier only" are
    ignored by the connector."""

    engine_name: str = "vllm"
    """Shown by ``tierd stats``; the scheduler appends ``-scheduler``, workers ``-tp<rank>``."""
    load: bool = True
    """Load prefixes from tierd."""
    save: bool = True
    """Write newly computed full blocks to tierd."""
    save_policy: str = "write_through"
    """TierdConnector only: when a computed block is written to tierd. ``write_through``: as
    soon as it is computed, so other engines and a restarted one hit it at once.
    ``write_back`` (host KV; CUDA KV writes through): when vLLM gives the block's memory to
    other tokens, so nothing is copied while vLLM's own cache holds the working set; other
    engines see a prefix once this one has evicted it, and what only vLLM holds when the
    engine stops is not saved."""
    model_id: str | None = None
    """The model id blocks are shared under (``tierd.model_identity``). Unset, the connector
    derives it from the weights vLLM loads and its dtype, quantization and ``--hf-overrides``.
    Set it only to share one cache between checkpoints you know compute the same KV (copies
    of one checkpoint served under one name share anyway): **a wrong value serves one model's
    KV to another**."""

    lookup_wait_seconds: float = 0.005
    """TierdConnector only: how long vLLM's scheduler thread waits for a new request's lookup
    (one daemon round trip, usually about a millisecond) before answering "not yet", which
    starts the request one engine step later; a step waits at most 4 times this in all. 0:
    never waits (every lookup then costs a step)."""
    answer_from_filter: bool = True
    """TierdConnector only, host KV with one TP rank and vLLM's ``kv_load_failure_policy``
    "recompute": a new request whose blocks the daemon's presence filter reads as maybe in DRAM
    is answered at once, with no round trip on vLLM's scheduler thread; the worker pins and
    verifies those blocks as it loads them, and vLLM recomputes any it could not load. false:
    every such hit is pinned by a lookup first (``lookup_wait_seconds``)."""
    workers: int = 2
    """TierdTier only: threads that run its store and load jobs (copies and daemon calls)."""
    max_queued_stores: int = 32
    """TierdTier only: store jobs waiting for a thread beyond this many are dropped at once
    (counted in ``vllm:kv_offload_tierd_stores_dropped``), so a slow daemon never keeps vLLM's
    primary tier pinned."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *,
                          where: str = "kv_connector_extra_config",
                          front_end: str = "TierdConnector") -> TierdVllmConfig:
        """Parse ``kv_connector_extra_config`` (or, with ``where``/``front_end`` naming it, a
        ``secondary_tiers`` entry): ``ValueError`` naming the fix for an unknown or removed key
        or a bad value."""
        known = {f.name for f in fields(cls)}
        for key in sorted(set(extra) & set(_REMOVED)):
            raise ValueError(f"{where} key {key!r} was removed: {_REMOVED[key]}; drop it")
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown {where} key(s) {unknown} for {front_end}; known keys: "
                             f"{sorted(known)}")
        config = cls(**dict(extra))
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix for a value out of range."""
        self.validate_client()
        for name in ("load", "save", "answer_from_filter"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.save_policy not in SAVE_POLICIES:
            raise ValueError(f"save_policy must be one of {list(SAVE_POLICIES)}, got "
                             f"{self.save_policy!r}")
        for name in ("workers", "max_queued_stores"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        wait = self.lookup_wait_seconds
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 1:
            raise ValueError(f"lookup_wait_seconds must be a number of seconds in [0, 1], got "
                             f"{wait!r}")
        if self.model_id is not None:
            validate_model_id(self.model_id)
