"""The engine group: with ``engine_group`` the socket, arena and presence filter belong to that
group (0660) so engines of another user in it connect and attach; without it they stay the
daemon user's, and an engine refused is told the file, its owner and mode, and the fixes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tierd.daemon.config import TierdConfig
from tierd.daemon.engine_access import group_id
from tierd.paths import default_socket_path

GID = 54321  # a group no user of this host has: only the test's engine gets it
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching the engine's user needs root")


def _mode(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def _engine(socket_path: str, groups: list[int]) -> subprocess.CompletedProcess[str]:
    """An engine process of uid ``NOBODY`` with ``groups``: as root it connects once and closes
    (so every module the connect path imports lazily is loaded: the checkout and its venv may sit
    in a folder that user cannot read), then drops to that user and registers through
    ``DaemonLink`` (attaching the arena and presence filter)."""
    script = textwrap.dedent(f"""
        import logging, os, sys
        import grpc
        from tierd.connector.core.link import DaemonLink
        from tierd.connector.core.settings import ClientSettings
        from tierd.wire.layout import Layout
        import tierd.wire.presence, tierd.connector.core.arena_slots
        layout = Layout(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16",
                        block_size=16, model_id="test-model@0")
        settings = ClientSettings(socket_path={socket_path!r})
        warm = DaemonLink(settings, layout, attach=True, presence=True)
        assert warm.connect(), "root could not connect"
        warm.close()
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        os.setgroups({groups!r}); os.setgid({NOBODY}); os.setuid({NOBODY})
        link = DaemonLink(settings, layout, attach=True, presence=True)
        up = link.connect()
        print("up" if up else "down", link.session.presence is not None if up else "",
              link.session.client.on_lane if up else "")
        link.close()
    """)
    return subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                          timeout=120)


def test_engine_group_must_exist() -> None:
    """An unknown group name is refused naming the fix; a numeric gid is taken as is."""
    with pytest.raises(ValueError, match="engine_group 'no-such-group-xyz' is not a group of "
                                         "this host: give a group name"):
        TierdConfig(engine_group="no-such-group-xyz").validate()
    assert group_id("54321") == 54321


@needs_root
def test_group_engine_connects_and_attaches(make_daemon: Any, workdir: str) -> None:
    """Socket, lane, arena and filter are 0660 of the engine group; an engine of another user
    with that group registers (over the lane) and maps both; the SSD directory stays the
    daemon's."""
    sockdir = os.path.join(workdir, "run")
    os.makedirs(sockdir, mode=0o755)
    os.chmod(workdir, 0o755)
    running = make_daemon(engine_group=str(GID), socket_path=os.path.join(sockdir, "t.sock"))
    arena = running.daemon.arena
    assert _mode(running.config.socket_path) == (0o660, GID)
    assert _mode(running.config.socket_path + ".lane") == (0o660, GID)
    assert _mode(arena.path) == (0o660, GID)
    assert _mode(arena.path + "-presence") == (0o660, GID)
    assert _mode(running.config.ssd_dir)[1] != GID
    result = _engine(running.config.socket_path, [GID])
    assert result.stdout.split() == ["up", "True", "True"], result.stderr


@needs_root
def test_engine_of_another_user_is_told_the_fix(make_daemon: Any, workdir: str) -> None:
    """Without engine_group an engine of another user is told the socket's path, owner and mode
    and both fixes, not that no daemon answers; so is one lacking the group."""
    sockdir = os.path.join(workdir, "run")
    os.makedirs(sockdir, mode=0o755)
    os.chmod(workdir, 0o755)
    running = make_daemon(socket_path=os.path.join(sockdir, "t.sock"))
    path = running.config.socket_path
    assert _mode(running.daemon.arena.path) == (0o600, 0)
    result = _engine(path, [])
    assert result.stdout.split() == ["down"]
    mode = f"{_mode(path)[0]:04o}"
    assert result.stderr.splitlines() == [
        f"WARNING tierd daemon at unix:{path} unavailable (the daemon's socket {path} is owned "
        f"by uid 0, gid 0 with mode {mode}, so this engine (uid {NOBODY}, groups [{NOBODY}]) "
        "may not open it; run the engine as the daemon's user, or start the daemon with "
        "engine_group (TIERD_ENGINE_GROUP) set to a group this engine has (docs/daemon.md, "
        f"'Engines in other containers')); running without it, next try in 10.0 s; `tierd "
        f"serve` listens on {default_socket_path()} by default: point the engine's socket_path "
        "(TIERD_SOCKET_PATH) at the --socket-path the daemon runs with"]


@needs_root
def test_arena_refused_names_owner_mode_and_fix(make_daemon: Any, workdir: str) -> None:
    """Attaching an arena this user may not open raises PermissionError naming the arena, its
    owner and mode and the fixes."""
    running = make_daemon()
    path = running.daemon.arena.path
    script = textwrap.dedent(f"""
        import os
        from tierd.wire.arena import ShmArena
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        try:
            ShmArena.attach({running.daemon.arena.name!r})
        except PermissionError as exc:
            print(exc)
    """)
    result = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == (
        f"[Errno 13] the daemon's arena {path} is owned by uid 0, gid 0 with mode 0600, so this "
        f"engine (uid {NOBODY}, groups [{NOBODY}]) may not open it; run the engine as the "
        "daemon's user, or start the daemon with engine_group (TIERD_ENGINE_GROUP) set to a "
        "group this engine has (docs/daemon.md, 'Engines in other containers')"), result.stderr


@needs_root
def test_stats_of_another_user_is_told_the_fix(make_daemon: Any, workdir: str) -> None:
    """`tierd stats` run by a user who may not open the socket names its owner, mode and the
    fixes instead of "no daemon answers"."""
    sockdir = os.path.join(workdir, "run")
    os.makedirs(sockdir, mode=0o755)
    os.chmod(workdir, 0o755)
    running = make_daemon(socket_path=os.path.join(sockdir, "t.sock"))
    path = running.config.socket_path
    warm_path = path + ".warm"  # another address: the warm-up's connection is not shared
    os.symlink(path, warm_path)
    script = textwrap.dedent(f"""
        import json, os, sys
        import grpc, rich.console, rich.table
        from tierd.cli import build_parser
        import tierd.wire.client, tierd.wire.access
        args = build_parser().parse_args(["stats", "--socket-path", {path!r}])
        with tierd.wire.client.TierdClient(socket_path={warm_path!r}) as warm:  # lazy imports
            warm.stats()
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        sys.exit(args._run(args))
    """)
    result = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"tierd stats: the daemon's socket {path} is owned by uid 0, gid 0 with mode "
        f"{_mode(path)[0]:04o}, so this engine (uid {NOBODY}, groups [{NOBODY}]) may not open "
        "it; run the engine as the daemon's user, or start the daemon with engine_group "
        "(TIERD_ENGINE_GROUP) set to a group this engine has (docs/daemon.md, 'Engines in "
        "other containers')")
