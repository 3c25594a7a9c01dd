"""SGLang's ``HiCacheStorage`` base class where SGLang is installed, else a stand-in.

``tierd.connector.sglang`` must import where SGLang is not installed (the main suite, mypy) and
be a genuine ``HiCacheStorage`` subclass inside SGLang (its backend factory checks
``issubclass``). ``HAVE_SGLANG`` says which; type checkers see the stand-in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["HAVE_SGLANG", "HiCacheStorage"]


class StandinHiCacheStorage:
    """SGLang 0.5.23's ``HiCacheStorage``: what the backend inherits from it."""

    mem_pool_host: Any

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models' extra host pools (``batch_*_v2``)."""

    def on_host_pools_registered(self) -> None:
        """The host pools are all registered."""


if TYPE_CHECKING:
    HiCacheStorage = StandinHiCacheStorage
    HAVE_SGLANG = False
else:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

        HAVE_SGLANG = True
    except ImportError:
        HiCacheStorage = StandinHiCacheStorage
        HAVE_SGLANG = False
