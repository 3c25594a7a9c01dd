"""tierd as SGLang HiCache's L3 storage backend, ``TierdHiCacheStorage`` (``module_path``
"tierd.connector.sglang", docs/sglang.md): the ``HiCacheStorage`` glue and every daemon call
(``storage``), a host page's bytes and layout (``pages``, ``sinks``), the model id
(``identity``), the extra-config keys (``config``) and SGLang's base class or a stand-in (``base``).
"""

from .config import TierdSglangConfig
from .storage import SGLANG_VERSIONS_TESTED, TierdHiCacheStorage

__all__ = ["SGLANG_VERSIONS_TESTED", "TierdHiCacheStorage", "TierdSglangConfig"]
