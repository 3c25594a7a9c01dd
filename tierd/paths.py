"""Where tierd's files are by default: its cache directory and the daemon's Unix socket.

Small on purpose: engine-side code (the connector, its native build) reads these without
importing the daemon's configuration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/tierd`` or ``$HOME/.cache/tierd``, read from ``env``."""
    env = os.environ if env is None else env
    home = env.get("HOME") or os.path.expanduser("~")
    base = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return Path(base) / "tierd"


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR/tierd.sock`` when a runtime dir exists, else under the cache dir."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "tierd.sock") if runtime else str(cache_dir(env) / "tierd.sock")


def client_socket_path(env: Mapping[str, str] | None = None) -> str:
    """The socket a client (``tierd stats``, the connector) should dial: ``TIERD_SOCKET_PATH``
    if set, else the daemon's default."""
    env = os.environ if env is None else env
    return env.get("TIERD_SOCKET_PATH") or default_socket_path(env)
