"""Layouts, fingerprints and namespaces: equal only for the same tenant and identical layout."""

from __future__ import annotations

import dataclasses

import pytest

from tierd.wire.layout import NAMESPACE_LEN, Layout, namespace_for

LLAMA = Layout(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16,
               model_id="llama3-8b@0")


def test_block_bytes_counts_k_and_v_of_every_layer() -> None:
    """A Llama-8B-like block: 2 * 32 * 8 * 128 * 16 tokens * 2 bytes = 2 MiB."""
    assert LLAMA.block_bytes == 2 * 32 * 8 * 128 * 16 * 2 == 2 * 1024 * 1024
    assert dataclasses.replace(LLAMA, dtype="fp8_e4m3").block_bytes == 1024 * 1024
    assert dataclasses.replace(LLAMA, dtype="float32").block_bytes == 4 * 1024 * 1024


def test_namespace_is_16_bytes_and_stable() -> None:
    """The same tenant and layout always give the same 16-byte namespace."""
    ns = namespace_for("default", LLAMA)
    assert len(ns) == NAMESPACE_LEN == 16
    assert ns == namespace_for("default", dataclasses.replace(LLAMA))


@pytest.mark.parametrize("change", [
    {"num_layers": 31}, {"num_kv_heads": 4}, {"head_size": 64}, {"dtype": "float16"},
    {"block_size": 32}, {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2},
    {"kv_format": "vllm-hnc-v1"}, {"model_id": "llama3-8b-instruct@1"},
])
def test_any_layout_difference_changes_the_namespace(change: dict[str, object]) -> None:
    """Two models or two TP ranks never share a namespace."""
    other = dataclasses.replace(LLAMA, **change)  # type: ignore[arg-type]
    assert other.fingerprint() != LLAMA.fingerprint()
    assert namespace_for("default", other) != namespace_for("default", LLAMA)


def test_a_layout_needs_a_model_id() -> None:
    """Shape is not identity: a layout without a model id (or a badly spelled one) is refused
    with the fix."""
    for bad in ("", "two words", "x" * 129):
        with pytest.raises(ValueError, match="layout.model_id"):
            dataclasses.replace(LLAMA, model_id=bad).validate()


def test_earlier_shape_only_namespaces_are_never_named_again() -> None:
    """Blocks stored by tierd before model ids live under blake2b(tenant, v1 fingerprint of the
    shape): no layout of this version, whatever its model id, maps to such a namespace."""
    import hashlib

    def v1_namespace(tenant: str, layout: Layout) -> bytes:  # the earlier version's formula
        fields = (layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype,
                  layout.block_size, layout.tp_rank, layout.tp_size)
        base = b"tierd-layout-v1|" + b"|".join(str(f).encode() for f in fields)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(len(tenant).to_bytes(4, "big") + tenant.encode())
        digest.update(base + (b"|format=" + layout.kv_format.encode() if layout.kv_format
                              else b""))
        return digest.digest()

    for model_id in ("llama3-8b@0", "", "x"):
        layout = dataclasses.replace(LLAMA, model_id=model_id or "m")
        assert namespace_for("default", layout) != v1_namespace("default", layout)
    assert LLAMA.fingerprint().startswith(b"tierd-layout-v2|")


def test_tenants_never_share_a_namespace() -> None:
    """Tenant names are length-prefixed: 'a' and 'ab' and other tenants all differ."""
    names = {namespace_for(t, LLAMA) for t in ("a", "ab", "b", "default", "team-x")}
    assert len(names) == 5


@pytest.mark.parametrize("bad, fix", [
    ({"num_layers": 0}, "num_layers"), ({"head_size": -1}, "head_size"),
    ({"dtype": "int8"}, "dtype"), ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"block_size": True}, "block_size"),
])
def test_bad_layout_raises_value_error_naming_the_field(bad: dict[str, object], fix: str) -> None:
    """Each bad field raises ValueError whose message names it."""
    layout = dataclasses.replace(LLAMA, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=fix):
        layout.validate()
    with pytest.raises(ValueError, match=fix):
        namespace_for("default", layout)


def test_empty_tenant_is_rejected() -> None:
    """A tenant must be named."""
    with pytest.raises(ValueError, match="tenant"):
        namespace_for("", LLAMA)
