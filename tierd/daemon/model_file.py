"""``models.json``: the namespace -> model map kept in the SSD directory, as bytes and back.

A JSON object ``{"<namespace hex>": {"tenant": str, "model_id": str, "block_bytes": int}}``,
least recently registered first. ``parse`` trusts nothing: the file may be damaged or planted, so
every field is checked (model ids as ``tierd.model_identity`` checks an engine's, so no control
character or terminal escape reaches ``tierd stats``) and any fault is one ``ValueError`` naming
it. ``render`` writes only entries ``parse`` accepts, so the daemon always reads back its own file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from tierd.model_identity import validate_model_id
from tierd.types import Namespace
from tierd.wire.layout import NAMESPACE_LEN

FILE_NAME = "models.json"
ENTRY_BYTES = 4096
"""The most bytes one entry takes (a tenant of ``MAX_TENANT_BYTES``, every byte escaped, fits):
the file is refused unread above ``ENTRY_BYTES * max_models``."""
MAX_TENANT_BYTES = 1024
"""Longer tenant names (or ones with unprintable characters) are not written: their namespaces'
SSD blocks are not attributed after a restart."""
MAX_BLOCK_BYTES = 1 << 48


@dataclass(frozen=True, slots=True)
class NamespaceModel:
    """Whose blocks a namespace holds and how big each is."""

    tenant: str
    model_id: str
    block_bytes: int


def storable(model: NamespaceModel) -> bool:
    """Whether ``render`` writes ``model`` (its tenant name is printable and not too long)."""
    return model.tenant.isprintable() and 0 < len(model.tenant.encode()) <= MAX_TENANT_BYTES


def render(entries: Sequence[tuple[Namespace, NamespaceModel]]) -> bytes:
    """The file's bytes for ``entries`` (oldest first), the entries ``storable`` refuses left
    out."""
    return json.dumps({ns.hex(): {"tenant": m.tenant, "model_id": m.model_id,
                                  "block_bytes": m.block_bytes}
                       for ns, m in entries if storable(m)}, ensure_ascii=False).encode()


def parse(data: bytes, max_models: int) -> list[tuple[Namespace, NamespaceModel]]:
    """The entries of a file's bytes, oldest first, at most the newest ``max_models``.
    ValueError naming the first fault: not JSON (or nested too deeply, or NaN/Infinity), not an
    object of well-formed entries, a namespace not 16 bytes of hex, a tenant ``storable``
    refuses, a model id an engine could not register, or ``block_bytes`` not an integer in
    [1, 2^48]."""
    try:
        raw = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    out: list[tuple[Namespace, NamespaceModel]] = []
    for hex_ns, entry in raw.items():
        where = f"entry {hex_ns[:2 * NAMESPACE_LEN + 8]!r}"
        try:
            namespace = bytes.fromhex(hex_ns)
        except ValueError:
            namespace = b""
        if len(namespace) != NAMESPACE_LEN:
            raise ValueError(f"{where}: the key is not a {NAMESPACE_LEN}-byte namespace in hex")
        if not isinstance(entry, dict) or set(entry) != {"tenant", "model_id", "block_bytes"}:
            raise ValueError(f"{where}: not an object of tenant, model_id and block_bytes")
        tenant, model_id, block_bytes = entry["tenant"], entry["model_id"], entry["block_bytes"]
        if not isinstance(tenant, str) or not storable(NamespaceModel(tenant, "", 0)):
            raise ValueError(f"{where}: tenant must be printable text of 1 to "
                             f"{MAX_TENANT_BYTES} bytes")
        try:
            validate_model_id(model_id)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if type(block_bytes) is not int or not 0 < block_bytes <= MAX_BLOCK_BYTES:
            raise ValueError(f"{where}: block_bytes must be an integer in [1, 2^48], got "
                             f"{block_bytes!r:.40}")
        out.append((Namespace(namespace), NamespaceModel(tenant, model_id, block_bytes)))
    return out[len(out) - max_models:] if len(out) > max_models else out


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number a model table holds")
