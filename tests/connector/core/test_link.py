"""The core's daemon link against a real daemon: back-off while absent, the one error
classification (what keeps the session, what drops it), late failures of old sessions, and the
warning of a daemon out of reach (one at start naming the socket dialed and the daemon's default,
then at most one a minute, DEBUG in between)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import grpc
import pytest

from tierd.connector.core.errors import classify
from tierd.connector.core.link import DaemonLink, Session
from tierd.connector.core.settings import ClientSettings
from tierd.paths import default_socket_path
from tierd.types import BlockHash
from tierd.wire.layout import Layout

LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_size=16,
                model_id="core-test@0")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_absent_daemon_backs_off_doubling_then_connects(workdir: str, make_daemon: Any) -> None:
    """No daemon: attempts at 0, 1, 3, 7 s (waits 1, 2, 4, capped at 4); once one listens the
    next due attempt registers, attaches the arena and the listener hears of it."""
    clock, heard = Clock(), []
    settings = ClientSettings(socket_path=os.path.join(workdir, "tierd.sock"), retry_seconds=1.0,
                              retry_max_seconds=4.0, timeout_seconds=2.0)
    link = DaemonLink(settings, LAYOUT, "t", attach=True, clock=clock, on_session=heard.append)
    assert not link.connect() and link.retry_at == clock.now + 1.0
    clock.now += 0.5
    assert not link.connect() and link.retry_at == 1001.0  # too early: no attempt
    for wait in (2.0, 4.0, 4.0):
        clock.now = link.retry_at
        assert not link.connect() and link.retry_at == clock.now + wait
    make_daemon()
    assert not link.connect()  # the back-off still runs
    clock.now = link.retry_at
    assert link.connect() and link.up and heard == [link.session]
    assert link.slots.num_slots > 0 and link.arena_tensor.numel() == link.arena.size
    link.close()
    assert not link.up


def test_one_classification_of_failed_calls(make_daemon: Any) -> None:
    """A release of an unknown lease is "lease" (kept); a bad request is "request" (kept);
    an engine the daemon forgot is "forgotten" (dropped, re-registered at once), also on a
    call that names a lease (its details name the engine); a daemon
    gone, or a missed deadline, is "down" (dropped until the back-off passes)."""
    daemon = make_daemon()
    clock = Clock()
    link = DaemonLink(ClientSettings(socket_path=daemon.config.socket_path, retry_seconds=5.0,
                                     timeout_seconds=1.0), LAYOUT, "t", attach=False, clock=clock)
    assert link.connect()
    engine_id = link.engine.engine_id
    exc = _error(lambda: link.client.release(engine_id, "no-such-lease"))
    assert link.failed(exc, names_lease=True) == "lease" and link.up
    exc = _error(lambda: link.client.acquire(engine_id, [b"short"]))
    assert link.failed(exc) == "request" and link.up
    link.client.unregister_engine(engine_id)
    exc = _error(lambda: link.client.lookup(engine_id, []))
    assert classify(exc) == "forgotten" and classify(exc, names_lease=True) == "forgotten"
    released = _error(lambda: link.client.release(engine_id, "no-such-lease"))
    assert released.code() == grpc.StatusCode.NOT_FOUND
    assert classify(released, names_lease=True) == "forgotten"
    assert link.failed(exc) == "forgotten" and not link.up and link.retry_at == clock.now
    assert link.connect() and link.engine.engine_id != engine_id
    daemon._loop.call_soon_threadsafe(time.sleep, 2.5)  # the daemon stalls past the deadline
    exc = _error(lambda: link.client.lookup(link.engine.engine_id, [BlockHash(bytes(32))]))
    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert link.failed(exc) == "down" and not link.up and link.retry_at == clock.now + 5.0
    time.sleep(2.5)  # the stall ends
    clock.now += 5.0
    assert link.connect()
    daemon.stop()
    exc = _error(lambda: link.client.lookup(link.engine.engine_id, []))
    assert classify(exc) == "down"
    assert link.failed(exc) == "down" and not link.up and link.retry_at == clock.now + 5.0


def test_a_late_failure_of_an_old_session_keeps_the_new_one(make_daemon: Any) -> None:
    """A failure reported for a session the link already replaced drops nothing."""
    daemon = make_daemon()
    link = DaemonLink(ClientSettings(socket_path=daemon.config.socket_path, retry_seconds=0.0),
                      LAYOUT, "t", attach=True)
    assert link.connect()
    old: Session | None = link.session
    assert old is not None
    old.client.unregister_engine(old.engine_id)
    exc = _error(lambda: old.client.lookup(old.engine_id, []))
    assert link.failed(exc, old) == "forgotten" and link.connect()
    assert link.session is not old
    assert link.failed(exc, old) == "forgotten" and link.up  # old news: kept
    link.close()


def test_a_call_on_a_dropped_session_is_an_rpc_error(make_daemon: Any) -> None:
    """Another thread dropped the session (its channel closed) while this one still uses it:
    the call fails like any daemon call (a ``grpc.RpcError``, classified "down"), blocking or
    not, never with gRPC's ``ValueError``; the link keeps its new session."""
    daemon = make_daemon()
    link = DaemonLink(ClientSettings(socket_path=daemon.config.socket_path, retry_seconds=0.0),
                      LAYOUT, "t", attach=True)
    assert link.connect()
    old = link.session
    assert old is not None
    link.failed(_error(lambda: old.client.lookup("no-such-engine", [])), old)
    assert not link.up and link.connect()
    for call in (lambda: old.client.lookup(old.engine_id, []),
                 lambda: old.client.commit_async(old.engine_id, "lease", [])):
        exc = _error(call)
        assert classify(exc) == "down" and link.failed(exc, old) == "down"
        assert link.failed(exc) == "down"  # naming no session: still not the new one's failure
    assert link.up
    link.close()


def test_settings_name_the_fix() -> None:
    """Out-of-range settings raise ValueError naming the knob."""
    for bad, match in (({"timeout_seconds": 0}, "timeout_seconds"),
                       ({"retry_seconds": 2.0, "retry_max_seconds": 1.0}, "retry_max_seconds"),
                       ({"address": "h:1"}, "token")):
        with pytest.raises(ValueError, match=match):
            ClientSettings(**bad).validate_client()
    assert ClientSettings(retry_seconds=3.0).longest_retry == 3.0


def test_front_end_configs_share_the_client_knobs() -> None:
    """Both front ends' configs are ClientSettings with the same knob names; the hooks' earlier
    names are refused with a ValueError naming the new one."""
    from tierd.connector.reference.tierd_config import TierdHooksConfig
    from tierd.connector.vllm.config import TierdVllmConfig

    vllm = TierdVllmConfig.from_extra_config({"timeout_seconds": 2.0, "retry_max_seconds": 40})
    assert isinstance(vllm, ClientSettings) and vllm.longest_retry == 40
    for old, new in (("call_timeout_s", "timeout_seconds"), ("reconnect_min_s", "retry_seconds"),
                     ("reconnect_max_s", "retry_max_seconds")):
        with pytest.raises(ValueError, match=rf"{old}=\.\.\.\) is now {new}: use .*{new}=3\.0"):
            TierdHooksConfig(**{old: 3.0})
    hooks = TierdHooksConfig(timeout_seconds=3.0, retry_seconds=0.1, retry_max_seconds=1.0)
    assert isinstance(hooks, ClientSettings)
    assert (hooks.timeout_seconds, hooks.retry_seconds, hooks.retry_max_seconds) == (3.0, 0.1, 1.0)


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
