"""vLLM's connector base classes (the real ones, or stand-ins) and the adapter's step metadata.

``tierd.connector.vllm`` must import where vLLM is not installed (CI, these machines), yet be a
genuine ``KVConnectorBase_V1`` subclass inside vLLM. So this module exports
``KVConnectorBase_V1``, ``KVConnectorMetadata`` and ``KVConnectorRole``:

* when ``vllm.distributed.kv_transfer.kv_connector.v1.base`` imports, they *are* vLLM's classes;
* otherwise they are the small stand-ins below, with vLLM's constructor signature, role enum
  values and method names (scheduler side, worker side, metadata binding), so the adapter runs
  unchanged under a fake driver. ``HAVE_VLLM`` says which.

Type checkers always see the stand-ins (vLLM is not installed where mypy runs).

The metadata one scheduler step sends to every worker is ``TierdConnectorMetadata``: plain lists
of ints and bytes, so it pickles / msgspec-encodes across vLLM's process boundary.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

__all__ = ["HAVE_VLLM", "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole",
           "LoadSpec", "SaveSpec", "TierdConnectorMetadata"]


class StandinKVConnectorRole(enum.Enum):
    """vLLM's ``KVConnectorRole``: which process the connector instance lives in."""

    SCHEDULER = 0
    WORKER = 1


class StandinKVConnectorMetadata(ABC):  # noqa: B024 - vLLM's is an ABC without abstract methods
    """vLLM's ``KVConnectorMetadata``: what the scheduler side hands the worker side per step."""


class StandinKVConnectorBase(ABC):
    """The subset of vLLM's ``KVConnectorBase_V1`` the adapter relies on, same names and
    signatures: the constructor keeps ``vllm_config``, its ``kv_transfer_config`` and the role;
    ``bind_connector_metadata`` / ``clear_connector_metadata`` bracket each forward pass."""

    def __init__(self, vllm_config: Any, role: StandinKVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        if getattr(vllm_config, "kv_transfer_config", None) is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._connector_metadata: StandinKVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> StandinKVConnectorRole:
        return self._role

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side -------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: StandinKVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> StandinKVConnectorMetadata:
        assert self._connector_metadata is not None, "no metadata bound for this forward pass"
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        return None

    # -- scheduler side ----------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> StandinKVConnectorMetadata: ...

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def _import_vllm_base() -> tuple[Any, Any, Any] | None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError:
        return None
    return base.KVConnectorBase_V1, base.KVConnectorMetadata, base.KVConnectorRole


if TYPE_CHECKING:
    HAVE_VLLM = False
    KVConnectorBase_V1: TypeAlias = StandinKVConnectorBase
    KVConnectorMetadata: TypeAlias = StandinKVConnectorMetadata
    KVConnectorRole: TypeAlias = StandinKVConnectorRole
else:
    _real = _import_vllm_base()
    HAVE_VLLM = _real is not None
    if _real is None:
        KVConnectorBase_V1 = StandinKVConnectorBase
        KVConnectorMetadata = StandinKVConnectorMetadata
        KVConnectorRole = StandinKVConnectorRole
    else:
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole = _real


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks of one request to fill from tierd this step: ``block_hashes[i]`` goes into vLLM
    block ``block_ids[i]`` (freshly allocated, consecutive positions of the request's chain)."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Blocks of one request that this step's forward pass completes: after every layer has
    written them, ``block_ids[i]`` is stored in tierd under ``block_hashes[i]``."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass(frozen=True)
class TierdConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's work for the workers: loads happen in ``start_load_kv`` (before the
    forward pass), saves in ``save_kv_layer`` / ``wait_for_save`` (during and after it)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
