"""The presence filter: counts follow the tier index, engines read it from shared memory, and a
filtered lookup is still counted by the node."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierd.daemon.arena import OwnedArena
from tierd.daemon.arena_owner import new_arena_name, remove_stale_arenas
from tierd.daemon.presence import PresenceFilter
from tierd.types import NamespacedKey
from tierd.wire.client import TierdClient
from tierd.wire.layout import namespace_for
from tierd.wire.presence import PresenceView

CELLS = 1024


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[PresenceFilter, PresenceView]]:
    """A filter beside a small arena in ``tmp_path``, and an engine's view of it."""
    arena = OwnedArena.create(f"tierd-{os.getpid()}-{secrets.token_hex(4)}", 4096,
                            directory=str(tmp_path), prefault=False)
    presence = PresenceFilter.create(arena, CELLS)
    yield presence, PresenceView(presence.name, str(tmp_path))
    presence.close()
    arena.close()
    arena.unlink()


def _keys(presence: PresenceFilter, n: int, cell: int | None = None,
          start: int = 0) -> list[NamespacedKey]:
    """``n`` distinct keys (a 16-byte namespace and a 32-byte hash, numbered from ``start``);
    all with ``cell`` as their first cell if given."""
    keys: list[NamespacedKey] = []
    i = start
    while len(keys) < n:
        key = NamespacedKey(b"n" * 16 + i.to_bytes(32, "big"))
        i += 1
        if cell is None or presence.cells_of(key)[0] == cell:
            keys.append(key)
    return keys


def test_a_key_counts_in_two_cells(pair: tuple[PresenceFilter, PresenceView]) -> None:
    """A key reads absent while either of its cells counts nothing: one that shares a cell with
    a held key is still a certain miss, and a key is present only while it is held."""
    presence, view = pair
    held = _keys(presence, 1)[0]
    first, second = presence.cells_of(held)
    others = [k for k in _keys(presence, 4, cell=first, start=1)
              if presence.cells_of(k)[1] not in (first, second)]
    assert others
    presence.stored([held], "dram")
    assert view.may_hold(presence.filter_key(held))
    assert not any(view.may_hold(presence.filter_key(k)) for k in others)
    assert not any(view.may_be_in_dram(presence.filter_key(k)) for k in others)
    presence.removed([held], "dram")
    assert not view.may_hold(presence.filter_key(held))


def test_counts_copies_per_tier_and_ignores_hbm(
        pair: tuple[PresenceFilter, PresenceView]) -> None:
    """A key is present while it has a DRAM or SSD copy; HBM reports do not count."""
    presence, view = pair
    key = _keys(presence, 1)[0]
    seen = presence.filter_key(key)
    presence.stored([key], "hbm")
    assert not view.may_hold(seen)
    presence.stored([key], "dram")
    presence.stored([key], "ssd")
    presence.removed([key], "dram")
    assert view.may_hold(seen) and presence.may_hold(key)
    presence.removed([key], "ssd")
    assert not view.may_hold(seen)


def test_a_cell_tells_whether_a_copy_may_be_in_dram(
        pair: tuple[PresenceFilter, PresenceView]) -> None:
    """A key with only an SSD copy may be held but is not in DRAM; with a DRAM copy too, or
    only one, it may be in DRAM; once its DRAM copy goes, its SSD copy still counts."""
    presence, view = pair
    key = _keys(presence, 1)[0]
    seen = presence.filter_key(key)
    presence.stored([key], "ssd")
    assert (view.may_hold(seen), view.may_be_in_dram(seen)) == (True, False)
    presence.stored([key], "dram")
    assert (view.may_hold(seen), view.may_be_in_dram(seen)) == (True, True)
    presence.removed([key], "dram")
    assert (view.may_hold(seen), view.may_be_in_dram(seen)) == (True, False)
    presence.removed([key], "ssd")
    presence.stored([key], "dram")
    assert (view.may_hold(seen), view.may_be_in_dram(seen)) == (True, True)
    presence.removed([key], "dram")
    assert (view.may_hold(seen), view.may_be_in_dram(seen)) == (False, False)


def test_a_saturated_counter_stays_maybe(pair: tuple[PresenceFilter, PresenceView]) -> None:
    """301 keys of one cell: past 255 the counter sticks, so once 300 of them go the one still
    held reads present (a counter that counted down from 255 would read 0: a false "absent"),
    and in DRAM; 20 SSD copies in a cell make it read "maybe in DRAM" too."""
    presence, view = pair
    keys = _keys(presence, 301, cell=5)
    presence.stored(keys, "dram")
    presence.removed(keys[1:], "dram")
    kept = presence.filter_key(keys[0])
    assert view.may_hold(kept) and view.may_be_in_dram(kept)
    ssd = _keys(presence, 20, cell=7)  # 20 SSD copies pass 254: in DRAM "maybe" too
    used = {c for k in [keys[0], *ssd] for c in presence.cells_of(k)} | {5, 6, 7}
    dram = next(k for k in _keys(presence, 8, cell=7, start=10**6)
                if presence.cells_of(k)[1] not in used)
    presence.stored(ssd, "ssd")
    presence.stored([dram], "dram")
    presence.removed([dram], "dram")
    presence.stored([dram], "ssd")  # in DRAM "maybe" at cell 7 only: its other cell says no
    assert view.may_hold(presence.filter_key(dram))
    assert not view.may_be_in_dram(presence.filter_key(dram))
    used |= set(presence.cells_of(dram))
    other = []
    for key in _keys(presence, 16, cell=6):
        if len(other) < 2 and presence.cells_of(key)[1] not in used:
            other.append(key)
            used.add(presence.cells_of(key)[1])
    presence.stored(other, "dram")
    presence.removed(other[:1], "dram")
    assert not view.may_hold(presence.filter_key(other[0]))  # its second cell counts nothing
    assert view.may_hold(presence.filter_key(other[1]))  # cell 6 still counts other[1]


def test_a_cleared_tier_is_recounted_from_what_is_held(
        pair: tuple[PresenceFilter, PresenceView]) -> None:
    """When the SSD tier goes, the counts are rebuilt from ``held()`` (the DRAM copies)."""
    presence, view = pair
    dram = _keys(presence, 2)
    taken = {c for k in dram for c in presence.cells_of(k)}  # the filter's secret places keys
    ssd = [k for k in _keys(presence, 64)[2:] if not taken & set(presence.cells_of(k))][:2]
    presence.bind(lambda: list(dram))
    presence.stored(dram, "dram")
    presence.stored(ssd, "ssd")
    presence.cleared("ssd")
    assert [view.may_hold(presence.filter_key(k)) for k in dram + ssd] == [True, True, False,
                                                                           False]


def test_bad_cell_counts_are_refused(tmp_path: Path) -> None:
    arena = OwnedArena.create(f"tierd-{os.getpid()}-{secrets.token_hex(4)}", 4096,
                            directory=str(tmp_path), prefault=False)
    try:
        for cells in (0, 1000, 512):
            with pytest.raises(ValueError, match="power of two"):
                PresenceFilter.create(arena, cells)
    finally:
        arena.close()
        arena.unlink()


def test_stale_filters_of_dead_daemons_are_removed(tmp_path: Path) -> None:
    """A filter left by a daemon killed with -9 (no process holds its lock) goes with its arena
    at the next start."""
    name = new_arena_name()
    for stale in (name, f"{name}-presence"):
        (tmp_path / stale).write_bytes(b"x")
    assert remove_stale_arenas(str(tmp_path)) == [name, f"{name}-presence"]


def test_daemon_filter_tracks_commits_and_demotions(make_daemon: Any, kit: Any) -> None:
    """Over a real socket: the engine maps the filter RegisterEngine names; a chain is absent
    until committed, present in DRAM and after demotion to SSD, where it no longer reads as in
    DRAM."""
    daemon = make_daemon(dram_high_watermark=1e-9, dram_low_watermark=1e-9)
    hashes = kit.chain(4)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        assert engine.presence_name == daemon.daemon.presence.name
        view = PresenceView(engine.presence_name, engine.arena_directory)

        def present() -> list[bool]:
            return [view.may_hold(NamespacedKey(engine.namespace + h)) for h in hashes]

        def in_dram() -> list[bool]:
            return [view.may_be_in_dram(NamespacedKey(engine.namespace + h)) for h in hashes]

        assert present() == [False] * 4
        arena = kit.attach(engine)
        assert kit.store_blocks(client, engine, arena, hashes[:3]) == 3
        assert present() == [True, True, True, False]
        assert in_dram() == [True, True, True, False]
        daemon.maintain()
        assert client.lookup(engine.engine_id, hashes[:3]) == ["ssd"] * 3
        assert present() == [True, True, True, False]
        assert in_dram() == [False] * 4
        arena.close()


def test_filtered_lookups_count_as_queried_tokens(daemon: Any, kit: Any) -> None:
    """Tokens an engine answered from the filter, sent with its next Reserve, are counted as
    queried and not hit."""
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        before = client.stats()
        reserved = client.reserve(engine.engine_id, kit.chain(1), filtered_query_tokens=640)
        client.abort(engine.engine_id, reserved.lease_id)
        after = client.stats()
    assert (after.query_tokens - before.query_tokens, after.hit_tokens) == (640, before.hit_tokens)


def test_no_filter_when_configured_off(make_daemon: Any, kit: Any) -> None:
    """presence_cells=0: RegisterEngine names no filter, so engines always ask."""
    daemon = make_daemon(presence_cells=0)
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
    assert engine.presence_name == "" and daemon.daemon.presence is None


def test_another_tenant_cannot_test_a_tenants_blocks(make_daemon: Any, kit: Any,
                                                     workdir: str) -> None:
    """Team A stores 50 blocks; team B maps the same filter file and knows A's tenant name,
    layout and hashes: with A's public namespace (blake2b of tenant and layout) or its own
    prefix it finds none of them (it found 50 of 50 when cells were keyed by the namespace);
    only A's prefix, which the daemon tells A's engines alone, finds them."""
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as f:
        f.write('"token-a" = "team-a"\n"token-b" = "team-b"\n')
    daemon = make_daemon(tcp_port=0, token_file=tokens)
    address = f"127.0.0.1:{daemon.daemon.tcp_port}"
    hashes = kit.chain(50)
    with TierdClient(address=address, token="token-a") as a, \
            TierdClient(address=address, token="token-b") as b:
        engine_a = a.register_engine(kit.layout)
        arena = kit.attach(engine_a)
        assert kit.store_blocks(a, engine_a, arena, hashes) == 50
        arena.close()
        engine_b = b.register_engine(kit.layout)
        view = PresenceView(engine_b.presence_name, engine_b.arena_directory)
        public = namespace_for("team-a", kit.layout)
        assert engine_a.namespace not in (public, engine_b.namespace)
        found_a = sum(view.may_hold(engine_a.namespace + h) for h in hashes)
        found_public = sum(view.may_hold(public + h) for h in hashes)
        found_own = sum(view.may_hold(engine_b.namespace + h) for h in hashes)
    assert found_a == 50
    # A probe finds both of its cells among ~100 occupied of 2^20 by chance: 5 misfires never.
    assert found_public < 5 and found_own < 5
