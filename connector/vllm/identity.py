"""The model id of the model a vLLM engine serves (``tierd.model_identity``), from its config.

The weights are those vLLM loads: the local folder it was given, or the hub snapshot it
downloaded (``--revision``, ``--download-dir``); the settings are vLLM's resolved dtype and
quantization and its ``--hf-overrides``. ``--load-format dummy`` (random weights, for tests and
benchmarks) is fingerprinted as "dummy weights of this config and seed". The scheduler and
every worker derive the id on their own (the same files, the same answer); the
``kv_connector_extra_config`` key ``model_id`` replaces it.

``TierdTier`` (a tier of vLLM's native offloading) is built from vLLM's ``OffloadingConfig``,
which carries the model's name and KV dtype, not the whole ``VllmConfig``:
``model_identity_for_tier`` uses vLLM's current config when one is set for this model (the same
id as the connector's), else the checkpoint at that name with its own dtype and quantization and
the KV dtype (``--hf-overrides`` or a ``--quantization`` given on the command line are then not
seen: set ``model_id`` when serving with them).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tierd.model_identity import (
    ModelIdentity,
    checkpoint_defaults,
    config_parts,
    identity_from_checkpoint,
    identity_from_parts,
    kv_settings,
    override,
)

_log = logging.getLogger(__name__)


def model_identity_from_vllm(vllm_config: Any, model_id: str | None = None) -> ModelIdentity:
    """The identity of ``vllm_config``'s model, or the ``model_id`` override. ``ValueError``
    naming the fix if vLLM's checkpoint cannot be found on this host."""
    if model_id is not None:
        return override(model_id)
    model = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    settings = kv_settings(str(model.dtype).removeprefix("torch."),
                           getattr(model, "quantization", None),
                           _overrides(getattr(model, "hf_overrides", None)))
    label = _label(model)
    if str(getattr(load, "load_format", "auto")) == "dummy":
        return identity_from_parts(label, [b"vllm dummy weights", model.model.encode(),
                                           *config_parts(model.model)],
                                   {**settings, "seed": getattr(model, "seed", None)})
    path = _checkpoint_dir(model.model, getattr(model, "revision", None),
                           getattr(load, "download_dir", None))
    return identity_from_checkpoint(path, settings, label=label)


def model_identity_for_tier(offloading: Any, model_id: str | None = None) -> ModelIdentity:
    """The identity of the model of vLLM's ``OffloadingConfig`` ``offloading``, or the
    ``model_id`` override (see the module doc). ``ValueError`` naming the fix if the checkpoint
    cannot be found or holds no weights (``--load-format dummy`` without a current config)."""
    if model_id is not None:
        return override(model_id)
    name = str(offloading.model.name)
    current = _current_vllm_config()
    if current is not None and str(current.model_config.model) == name:
        return model_identity_from_vllm(current)
    path = _checkpoint_dir(name, None, None)
    settings = {**checkpoint_defaults(path), "kv_dtype": str(offloading.model.dtype)}
    _log.info("tierd: the model id of %s comes from its checkpoint and config.json (vLLM's "
              "command-line --hf-overrides and --quantization are not visible to a tier: set "
              "\"model_id\" in the tier's config if you use them)", name)
    return identity_from_checkpoint(path, settings, label=os.path.basename(name.rstrip("/")))


def _current_vllm_config() -> Any:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def _label(model: Any) -> str:
    served = getattr(model, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model.model)


def _overrides(value: Any) -> dict[str, object]:
    if callable(value):  # a function of the config: its name is all that is stable
        return {"callable": f"{value.__module__}.{value.__qualname__}"}
    return dict(value or {})


def _checkpoint_dir(model: str, revision: str | None, download_dir: str | None) -> str:
    """The local folder (or file) of vLLM's checkpoint: ``model`` if it is a path, else the
    hub snapshot vLLM downloaded."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=revision, cache_dir=download_dir,
                                     local_files_only=True))
    except Exception as e:  # not installed, not downloaded, offline: all say "not here"
        raise ValueError(f"tierd cannot find the weights of {model!r} on this host ({e}), so it "
                         "cannot tell them from other weights of the same shape: set "
                         "\"model_id\" in kv_connector_extra_config") from e
