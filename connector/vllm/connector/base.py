"""vLLM's connector base classes: the real ones where vLLM is installed, else stand-ins.

This package must import where vLLM is not installed (the main test suite, mypy),
yet be a genuine ``KVConnectorBase_V1`` subclass inside vLLM. So this module exports
``KVConnectorBase_V1``, ``KVConnectorMetadata``, ``KVConnectorWorkerMetadata``,
``KVConnectorStats`` and ``KVConnectorRole``:

* when vLLM imports, they *are* vLLM's classes (``tests/vllm/`` runs the adapter that way);
* otherwise they are the small stand-ins below, with vLLM 0.33's constructor signature, role
  enum values and method names, so the adapter imports and its logic runs in the main suite
  (``tests/connector/vllm/connector/``, beside the real tests, never instead of them).
  ``HAVE_VLLM`` says which.

Type checkers always see the stand-ins (vLLM is not installed where mypy runs).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

__all__ = ["HAVE_VLLM", "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole",
           "KVConnectorStats", "KVConnectorWorkerMetadata"]


class StandinKVConnectorRole(enum.Enum):
    """vLLM's ``KVConnectorRole``: which process the connector instance lives in."""

    SCHEDULER = 0
    WORKER = 1


class StandinKVConnectorMetadata(ABC):  # noqa: B024 - vLLM's is an ABC without abstract methods
    """vLLM's ``KVConnectorMetadata``: what the scheduler side hands the worker side per step."""


class StandinKVConnectorWorkerMetadata(ABC):
    """vLLM's ``KVConnectorWorkerMetadata``: what each worker reports back per step; vLLM
    merges the workers' reports with ``aggregate`` before the scheduler side sees them."""

    @abstractmethod
    def aggregate(self, other: Any) -> Any: ...


@dataclass
class StandinKVConnectorStats:
    """vLLM's ``KVConnectorStats``: a serialisable ``data`` dict that workers fill and vLLM
    merges (``aggregate``) and reduces for its logs."""

    data: dict[str, Any] = field(default_factory=dict)


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


def _import_vllm_base() -> tuple[Any, ...] | None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base, metrics
    except ImportError:
        return None
    return (base.KVConnectorBase_V1, base.KVConnectorMetadata, base.KVConnectorRole,
            base.KVConnectorWorkerMetadata, metrics.KVConnectorStats)


if TYPE_CHECKING:
    HAVE_VLLM = False
    KVConnectorBase_V1: TypeAlias = StandinKVConnectorBase
    KVConnectorMetadata: TypeAlias = StandinKVConnectorMetadata
    KVConnectorRole: TypeAlias = StandinKVConnectorRole
    KVConnectorWorkerMetadata: TypeAlias = StandinKVConnectorWorkerMetadata
    KVConnectorStats: TypeAlias = StandinKVConnectorStats
else:
    _real = _import_vllm_base()
    HAVE_VLLM = _real is not None
    if _real is None:
        KVConnectorBase_V1 = StandinKVConnectorBase
        KVConnectorMetadata = StandinKVConnectorMetadata
        KVConnectorRole = StandinKVConnectorRole
        KVConnectorWorkerMetadata = StandinKVConnectorWorkerMetadata
        KVConnectorStats = StandinKVConnectorStats
    else:
        (KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorWorkerMetadata,
         KVConnectorStats) = _real
