"""The model id of the model an SGLang engine serves (``tierd.model_identity``).

The weights are SGLang's ``--model-path`` (a local folder, or the hub snapshot SGLang
downloaded; the extra config's ``model_path`` names the folder when neither is on this host);
the settings are SGLang's ``--dtype`` (``auto``: the checkpoint's), ``--quantization`` and
``--json-model-override-args``. The extra config's ``model_id`` replaces the derived id.
"""

from __future__ import annotations

import json
from typing import Any

from tierd.connector.vllm.identity import _checkpoint_dir
from tierd.model_identity import (
    ModelIdentity,
    checkpoint_defaults,
    identity_from_checkpoint,
    kv_settings,
    override,
)


def model_identity_from_sglang(model_name: str | None, *, model_id: str | None = None,
                               model_path: str | None = None) -> ModelIdentity:
    """The identity of the model SGLang serves: ``model_id`` if given; else the checkpoint at
    ``model_path``, SGLang's published ``--model-path``, or ``model_name`` (what SGLang passes
    its storage backends). ``ValueError`` naming the fix if no checkpoint is found."""
    if model_id is not None:
        return override(model_id)
    args = _server_model_args()
    name = model_path or args.get("model_path") or model_name
    if not name:
        raise ValueError("SGLang named no model path: set \"model_path\" (the checkpoint "
                         "folder) or \"model_id\" in --hicache-storage-backend-extra-config")
    path = _checkpoint_dir(name, args.get("revision"), args.get("download_dir"))
    defaults = checkpoint_defaults(path)
    dtype = args.get("dtype")
    overrides = args.get("json_model_override_args") or None
    settings = kv_settings(dtype if isinstance(dtype, str) and dtype != "auto"
                           else str(defaults["dtype"]),
                           args.get("quantization", defaults["quantization"]),
                           json.loads(overrides) if isinstance(overrides, str) else overrides)
    return identity_from_checkpoint(path, settings, label=args.get("served_model_name") or name)


def _server_model_args() -> dict[str, Any]:
    """SGLang's published model settings (``get_model()``), or {} outside a running server."""
    names = ("model_path", "revision", "download_dir", "dtype", "quantization",
             "json_model_override_args", "served_model_name")
    try:
        from sglang.srt.runtime_context import get_model

        bag = get_model()
    except (ImportError, ValueError):  # not installed; nothing published (not in a server)
        return {}
    return {n: getattr(bag, n) for n in names if getattr(bag, n, None) is not None}
