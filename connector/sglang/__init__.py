"""tierd as SGLang HiCache's L3 storage backend: ``TierdHiCacheStorage`` (docs/sglang.md).

Enable it with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "tierd", "module_path": "tierd.connector.sglang",
        "class_name": "TierdHiCacheStorage", "interface_v1": 1,
        "socket_path": "/run/tierd/tierd.sock"}'

One module per concern: ``storage`` (the ``HiCacheStorage`` glue and every daemon call),
``pages`` (a host page's bytes, its tierd ``Layout``, the copies), ``identity`` (the model id),
``config`` (the extra-config keys), ``base`` (SGLang's base class, or a stand-in without it).
"""

from .config import TierdSglangConfig
from .storage import SGLANG_VERSIONS_TESTED, TierdHiCacheStorage

__all__ = ["SGLANG_VERSIONS_TESTED", "TierdHiCacheStorage", "TierdSglangConfig"]
