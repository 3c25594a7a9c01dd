"""The SGLang backend's extra-config keys and page grids, without SGLang (the backend itself runs
in SGLang's own controllers in tests/sglang, `make test-sglang`)."""

from __future__ import annotations

import pytest

from tierd.connector.sglang import TierdHiCacheStorage, TierdSglangConfig
from tierd.connector.sglang.base import HAVE_SGLANG
from tierd.connector.sglang.pages import _grid


def test_sglang_keys_are_left_to_sglang_and_link_keys_parsed() -> None:
    """SGLang's own keys pass through; tierd's link keys land in the link config; the engine
    name defaults to "sglang"."""
    config = TierdSglangConfig.from_extra_config({
        "backend_name": "tierd", "module_path": "tierd.connector.sglang",
        "class_name": "TierdHiCacheStorage", "interface_v1": 1, "prefetch_threshold": 64,
        "socket_path": "/run/tierd.sock", "timeout_seconds": 2.0, "model_path": "/models/m"})
    assert config.interface_v1 and config.model_path == "/models/m"
    assert (config.link.socket_path, config.link.timeout_seconds, config.link.engine_name) == (
        "/run/tierd.sock", 2.0, "sglang")


@pytest.mark.parametrize("extra, message", [
    ({"socket": "/x"}, "unknown"),
    ({"address": "h:1"}, "token"),
    ({"model_id": ""}, "model_id"),
    ({"model_path": 3}, "model_path"),
])
def test_bad_extra_config_names_the_fix(extra: dict[str, object], message: str) -> None:
    """An unknown key, a TCP address without a token, an empty model id and a non-path
    model_path are refused, naming what to change."""
    with pytest.raises(ValueError, match=message):
        TierdSglangConfig.from_extra_config(extra)


@pytest.mark.parametrize("offsets, grid", [
    ([0], (1, 1, 0, 0)),                                    # MLA page_first: one run
    ([0, 1000], (2, 1, 1000, 0)),                           # MHA page_first: K, V
    ([0, 1000, 10, 1010, 20, 1020], (3, 2, 10, 1000)),      # MHA layer_first: (layer, K/V)
    ([0, 10, 20], (3, 1, 10, 0)),                           # MLA layer_first
    ([0, 5, 7], None),                                      # no grid: refused
])
def test_page_runs_form_a_grid(offsets: list[int], grid: tuple[int, ...] | None) -> None:
    """A page's run offsets become BlockRows' (layers, heads) grid, or None."""
    assert _grid(offsets) == grid


def test_backend_imports_without_sglang() -> None:
    """The module imports where SGLang is not installed (a stand-in base class)."""
    assert not HAVE_SGLANG and callable(TierdHiCacheStorage)


def test_pages_another_engine_writes_count_as_stored() -> None:
    """A page without a slot before a page with one is another engine's write (stored); one
    after the last slot may be a lack of room (not stored); nothing counts without a Commit."""
    from tierd.connector.sglang.storage import _stored

    held = [True, False, False, False, False]
    slots = [None, None, 7, None, None]
    assert _stored(held, slots, committed=True) == [True, True, True, False, False]
    assert _stored(held, slots, committed=False) == [True, False, False, False, False]
