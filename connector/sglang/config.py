"""The SGLang backend's settings: tierd's keys of ``--hicache-storage-backend-extra-config``.

SGLang hands a dynamic backend its whole extra config; the keys SGLang itself reads
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, the prefetch knobs) are
left to it, the rest must be tierd's. The daemon link's keys are the vLLM connector's
(``TierdVllmConfig``: one meaning, one validation); ``model_path`` is this backend's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tierd.connector.vllm.config import TierdVllmConfig

SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "tp_lcm_size", "file_storage_path"})
"""Keys SGLang reads from the same extra config (ignored here)."""

_LINK_KEYS = frozenset(f.name for f in fields(TierdVllmConfig)) - {"load", "save"}


@dataclass(frozen=True, slots=True)
class TierdSglangConfig:
    """tierd's settings for one SGLang engine."""

    link: TierdVllmConfig
    """Daemon socket/address/token, ``engine_name`` (default "sglang"), call deadline and retry
    pace, and ``model_id`` (the override of the derived model id)."""
    model_path: str | None = None
    """Checkpoint folder to derive the model id from, when SGLang's ``--model-path`` is not a
    folder on this host (a hub id whose snapshot lies elsewhere)."""
    interface_v1: bool = False
    """SGLang calls the zero-copy ``batch_*_v1`` methods (``"interface_v1": 1``, recommended)."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> TierdSglangConfig:
        """Parse the extra config; ``ValueError`` naming the fix for an unknown key or a bad
        value."""
        extra = dict(extra or {})
        ours = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
        unknown = sorted(set(ours) - _LINK_KEYS - {"model_path"})
        if unknown:
            raise ValueError(f"unknown --hicache-storage-backend-extra-config key(s) {unknown} "
                             f"for tierd; tierd's keys: {sorted(_LINK_KEYS | {'model_path'})}")
        model_path = ours.pop("model_path", None)
        if model_path is not None and not isinstance(model_path, str):
            raise ValueError(f"model_path must be a path, got {model_path!r}")
        link = TierdVllmConfig(**{"engine_name": "sglang", **ours})
        link.validate()
        return cls(link, model_path, bool(extra.get("interface_v1", 0)))
