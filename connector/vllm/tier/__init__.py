"""``TierdTier``, tierd as a secondary tier of vLLM's native tiered offloading (``module_path``
"tierd.connector.vllm.tier", docs/vllm.md): the manager vLLM calls (``tier``), its copy and
commit threads (``jobs``), the lookup bookkeeping (``lookups``) and the chunk layout (``layout``).
``TierdTier`` is imported on first use, so ``jobs``, ``lookups`` and ``layout`` load without vLLM.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TierdTier":
        from .tier import TierdTier
        return TierdTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
