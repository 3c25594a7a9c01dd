"""An engine whose daemon is out of reach says so: one WARNING at start naming the socket it
dials and the daemon's default socket, then at most one a minute (DEBUG in between)."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from tierd.connector.core.link import DaemonLink
from tierd.connector.core.settings import ClientSettings
from tierd.daemon.layout import Layout
from tierd.paths import default_socket_path

LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_size=16,
                model_id="core-test@0")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    found = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    caplog.clear()
    return found


def test_unreachable_daemon_warns_once_a_minute(workdir: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """No daemon on the socket: the first connect logs one WARNING naming the socket and the
    default; tries every 10 s for the next 50 s add none; the try at 60 s adds one more."""
    caplog.set_level(logging.DEBUG, logger="tierd.connector.core.link")
    path = os.path.join(workdir, "tierd.sock")
    clock = Clock()
    link = DaemonLink(ClientSettings(socket_path=path, retry_seconds=10.0), LAYOUT, "t",
                      attach=True, clock=clock)
    assert not link.connect()
    [first] = _warnings(caplog)
    assert first.startswith(f"tierd daemon at unix:{path} unavailable (UNAVAILABLE: "), first
    assert first.endswith(
        f"); running without it, next try in 10.0 s; `tierd serve` listens on "
        f"{default_socket_path()} by default: point the engine's socket_path "
        "(TIERD_SOCKET_PATH) at the --socket-path the daemon runs with"), first
    for _ in range(5):
        clock.now = link.retry_at
        assert not link.connect()
        assert _warnings(caplog) == []
    assert clock.now == 1050.0
    clock.now = 1060.0
    assert not link.connect()
    assert len(_warnings(caplog)) == 1


def test_default_socket_without_daemon_says_start_it(workdir: str, monkeypatch: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Dialing the default socket itself, the warning says to start `tierd serve`."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", workdir)
    monkeypatch.delenv("TIERD_SOCKET_PATH", raising=False)
    link = DaemonLink(ClientSettings(), LAYOUT, "t", attach=True, clock=Clock())
    with caplog.at_level(logging.WARNING, logger="tierd.connector.core.link"):
        assert not link.connect()
    [warning] = _warnings(caplog)
    assert warning.endswith(f"; {workdir}/tierd.sock is tierd's default socket: start "
                            "`tierd serve`"), warning
