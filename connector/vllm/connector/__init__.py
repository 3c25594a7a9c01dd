"""``TierdConnector``, tierd as a vLLM v1 KV connector (``kv_connector_module_path``
"tierd.connector.vllm.connector", docs/vllm.md): the ``KVConnectorBase_V1`` glue (``connector``),
its scheduler side (``scheduler``: what to load and save, pins) and worker side (``worker``,
``commits``, ``streaming``, ``sinks``, ``device_path``, ``cuda_copy``: the copies and commits),
vLLM's KV views (``kv_tensors``), per-step ``metadata``, ``stats`` and vLLM stand-ins (``base``).
"""

from ..config import TierdVllmConfig
from .connector import VLLM_VERSIONS_TESTED, TierdConnector, layout_from_vllm_config
from .metadata import TierdConnectorMetadata, TierdWorkerMetadata

__all__ = ["VLLM_VERSIONS_TESTED", "TierdConnector", "TierdConnectorMetadata",
           "TierdVllmConfig", "TierdWorkerMetadata", "layout_from_vllm_config"]
