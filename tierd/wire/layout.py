"""An engine's KV layout, its fingerprint, and the namespace that scopes its blocks.

A stored block is one engine block for all layers: K and V of every layer for ``block_size``
tokens. Two engines may share blocks only if they run the same model (``model_id``: the weights
and settings, ``tierd.model_identity``), their layouts are byte-identical, *and* they belong to
the same tenant; the namespace (16 bytes, blake2b over tenant and fingerprint) encodes all
three, so the node index key ``make_key(namespace, hash)`` never collides across models, TP
ranks or tenants. Namespaces are built only here.

The fingerprint is versioned (``tierd-layout-v2`` since model ids): blocks stored under an
earlier version's namespace (shape only, no model) can never be named again, so they are never
served; they age out of the tiers by LRU like any unused block.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, get_args

from tierd.model_identity import validate_model_id
from tierd.types import Namespace
from tierd.wire.clip import clip

NAMESPACE_LEN = 16
"""Bytes of every namespace (blake2b digest size)."""

Dtype = Literal["float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2"]
DTYPE_BYTES: dict[str, int] = {
    "float16": 2, "bfloat16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
assert set(DTYPE_BYTES) == set(get_args(Dtype)), "every dtype needs an element size"

_FINGERPRINT_VERSION = b"tierd-layout-v2"
MAX_KV_FORMAT_LEN = 64


@dataclass(frozen=True, slots=True)
class Layout:
    """The shape of one engine block as it lies in the arena (per TP rank: ``num_kv_heads`` is
    the rank's own share of heads)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: Dtype
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    kv_format: str = ""
    """Byte order of a block inside its slot, named by the engine that writes it: "" is tierd's
    paged pool row (``tierd.gpu.layout``), ``vllm-hnc-v1`` the vLLM adapter's canonical order.
    Part of the fingerprint, so engines that order bytes differently never share blocks."""
    model_id: str = ""
    """The model that computes the blocks (``tierd.model_identity``: ``label@digest`` of the
    weights and settings). Required: ``validate`` refuses an empty one, since shape is not
    identity and two models of one shape must never share a block."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: 2 (K and V) * layers * kv heads * head size * tokens * elem size."""
        return (2 * self.num_layers * self.num_kv_heads * self.head_size * self.block_size
                * DTYPE_BYTES[self.dtype])

    def fingerprint(self) -> bytes:
        """A canonical, versioned byte string of every field: equal iff the layouts are equal."""
        fields = (self.num_layers, self.num_kv_heads, self.head_size, self.dtype,
                  self.block_size, self.tp_rank, self.tp_size, "format=" + self.kv_format,
                  "model=" + self.model_id)
        return _FINGERPRINT_VERSION + b"|" + b"|".join(str(f).encode() for f in fields)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix if any field is out of range."""
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"layout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"layout.dtype must be one of {sorted(DTYPE_BYTES)}, "
                             f"got {clip(self.dtype)}")
        if (not isinstance(self.kv_format, str) or len(self.kv_format) > MAX_KV_FORMAT_LEN
                or not all(c.isalnum() or c in "-_." for c in self.kv_format)):
            raise ValueError(f"layout.kv_format must be at most {MAX_KV_FORMAT_LEN} characters "
                             "of letters, digits, '-', '_' or '.'")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"layout.tp_rank must be in [0, tp_size={self.tp_size}), "
                             f"got {self.tp_rank!r}")
        try:
            validate_model_id(self.model_id)
        except ValueError as e:
            raise ValueError(f"layout.{e}") from None


def namespace_for(tenant: str, layout: Layout) -> Namespace:
    """The 16-byte namespace of ``tenant``'s blocks in ``layout`` (validates both).

    blake2b(digest_size=16) over the length-prefixed UTF-8 tenant name and the fingerprint, so
    no (tenant, layout) pair can be spelled as another one.
    """
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
    layout.validate()
    name = tenant.encode()
    digest = hashlib.blake2b(digest_size=NAMESPACE_LEN)
    digest.update(len(name).to_bytes(4, "big") + name)
    digest.update(layout.fingerprint())
    return Namespace(digest.digest())
