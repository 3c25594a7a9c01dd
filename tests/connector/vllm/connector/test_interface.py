"""What TierdConnector shows vLLM before any request: the stand-in base classes without vLLM,
metadata that pickles (vLLM ships it to the workers), and extra-config keys checked with the fix
named."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from fake_vllm import fake_config

from tierd.connector.vllm.connector import (
    TierdConnector,
    TierdConnectorMetadata,
    TierdWorkerMetadata,
)
from tierd.connector.vllm.connector.base import HAVE_VLLM, KVConnectorRole, StandinKVConnectorBase
from tierd.connector.vllm.connector.metadata import LoadSpec, SaveSpec


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed: the real base classes are used")
def test_imports_without_vllm_and_metadata_pickles() -> None:
    """Without vLLM the connector subclasses the stand-ins; both metadata types pickle."""
    assert issubclass(TierdConnector, StandinKVConnectorBase)
    assert [(r.name, r.value) for r in KVConnectorRole] == [("SCHEDULER", 0), ("WORKER", 1)]
    meta = TierdConnectorMetadata(loads=[LoadSpec("r", [3, 4], [b"x" * 32, b"y" * 32])],
                                  saves=[SaveSpec("r", [5], [b"z" * 32], [3])],
                                  recomputing=["q"])
    assert pickle.loads(pickle.dumps(meta)) == meta
    report = pickle.loads(pickle.dumps(TierdWorkerMetadata({"r": 1}, {4})))
    assert report.aggregate(TierdWorkerMetadata({"r": 1, "s": 1}, {7})) == TierdWorkerMetadata(
        {"r": 2, "s": 1}, {4, 7})


@pytest.mark.parametrize("extra, match", [
    ({"socket": "/x"}, r"unknown kv_connector_extra_config key\(s\) \['socket'\].*known keys: "
                       r"\['address', .*'socket_path'"),
    ({"hash_algo": "sha256"}, r"key 'hash_algo' was removed: vLLM 0.33 hashes every block "
                              r"itself \(--prefix-caching-hash-algo\); drop it")])
def test_bad_extra_config_names_the_fix(extra: dict[str, Any], match: str) -> None:
    """An unknown extra-config key lists the known ones; a removed one says why and to drop it."""
    with pytest.raises(ValueError, match=match):
        TierdConnector(fake_config(extra), KVConnectorRole.SCHEDULER)

