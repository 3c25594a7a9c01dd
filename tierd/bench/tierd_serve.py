"""`tierd serve` as a child process, as the tests (the main suite, tests/vllm, tests/sglang,
tests/vllm_serve) and the benchmarks start it: the flags on the command line and no config file
of this host (``TIERD_CONFIG`` emptied), its stderr kept in a log file, ready once it answers
on its Unix socket. ``copy_bench_daemons``: the pair the copy benchmarks measure against.
``documented_daemon``: a quick start's ``tierd serve`` line run verbatim, as a new user would."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc

from tierd.paths import client_socket_path
from tierd.wire.client import TierdClient
from tierd.wire.replies import DaemonStats

LOG_NAME = "tierd-serve.log"


class TierdServe:
    """`tierd serve` on ``socket_path`` (default ``workdir/tierd.sock``) with ``flags`` after
    ``--socket-path`` and ``--log-level WARNING`` (a flag given again wins). Every start appends
    its stderr to ``workdir/tierd-serve.log`` (a file, not a pipe nobody drains). ``process``
    is the running child, None before the first start and after a stop."""

    def __init__(self, workdir: str, flags: Sequence[str] = (),
                 socket_path: str | None = None) -> None:
        self.workdir = workdir
        self.flags = list(flags)
        self.socket_path = socket_path or os.path.join(workdir, "tierd.sock")
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        """Starts so far (the first is 1)."""

    def start(self, *flags: str, timeout: float = 60.0) -> subprocess.Popen[bytes]:
        """Start the daemon with ``self.flags`` and then ``flags`` (this start only) and block
        until it answers, for up to ``timeout`` s. If it exits or stays silent, it is killed and
        ``RuntimeError`` quotes what this start wrote to the log. Returns the child."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.starts += 1
        log_path = os.path.join(self.workdir, LOG_NAME)
        with open(log_path, "ab") as log:
            offset = log.tell()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tierd.commands.serve", "--socket-path", self.socket_path,
                 "--log-level", "WARNING", *self.flags, *flags],
                env={**os.environ, "TIERD_CONFIG": ""}, stdout=subprocess.DEVNULL, stderr=log)
        if not self._answers(timeout):
            self.stop(kill=True)
            with open(log_path, "rb") as log:
                log.seek(offset)
                raise RuntimeError(f"tierd serve did not come up: {log.read()!r}")
        return self.process

    def _answers(self, timeout: float) -> bool:
        """Whether the child answers within ``timeout`` s (False at once if it exits)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while self.process.poll() is None and time.monotonic() < deadline:
                try:
                    client.wait_ready(timeout=0.5)
                    return True
                except grpc.FutureTimeoutError:
                    pass
        return False

    def stop(self, kill: bool = False, timeout: float = 60.0) -> None:
        """SIGTERM: the daemon writes its DRAM blocks to SSD (where it has an SSD tier) and
        removes its socket and arena; SIGKILL if it has not exited after ``timeout`` s, or at
        once with ``kill`` (the next start on the same arena directory removes what a killed
        daemon left). Waits for the exit; does nothing when no child runs."""
        if self.process is not None and self.process.poll() is None:
            if not kill:
                self.process.terminate()
                try:
                    self.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self, kill: bool = False) -> None:
        """``stop(kill)``, then ``start()``."""
        self.stop(kill=kill)
        self.start()

    def client(self) -> TierdClient:
        """A new client on the daemon's socket; the caller closes it."""
        return TierdClient(socket_path=self.socket_path, timeout=10.0)

    def stats(self) -> DaemonStats:
        with self.client() as client:
            return client.stats()

    def pinned_blocks(self) -> int:
        """Blocks pinned by a lease in any tier (0 once every engine released its loads)."""
        return sum(t.pinned_blocks for t in self.stats().tiers)


def copy_bench_daemons(workdir: str, socks: str, dram_bytes: int,
                       ssd_bytes: int) -> dict[str, TierdServe]:
    """The two daemons of the copy benchmarks (`tierd bench vllm`, `tierd bench sglang`),
    started: "dram" (no SSD tier: loads from its arena, nothing written behind them) and "ssd"
    (an SSD tier of ``ssd_bytes`` under ``workdir/ssd`` that every committed block is demoted to,
    leaving DRAM, at the next 50 ms pass), 64 MiB slabs, sockets in ``socks``. Stop each."""
    common = ["--dram-bytes", str(dram_bytes), "--slab-bytes", "64MiB"]
    daemons = {
        "dram": TierdServe(workdir, [*common, "--ssd-dir", ""],
                           socket_path=os.path.join(socks, "dram.sock")),
        "ssd": TierdServe(workdir, [*common, "--ssd-dir", os.path.join(workdir, "ssd"),
                                    "--ssd-bytes", str(ssd_bytes), "--dram-high-watermark",
                                    "1e-9", "--dram-low-watermark", "1e-9",
                                    "--maintain-seconds", "0.05"],
                          socket_path=os.path.join(socks, "ssd.sock"))}
    try:
        for daemon in daemons.values():
            daemon.start(timeout=300)
    except BaseException:
        for daemon in daemons.values():
            daemon.stop()
        raise
    return daemons


def fresh_user_env(home: str) -> dict[str, str]:
    """This process's environment as a new user's shell would have it: ``HOME`` = ``home`` and
    no ``TIERD_*`` or ``XDG_*`` variable, so every tierd default (socket, SSD folder) resolves
    under ``home``, the same way for the daemon and for an engine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERD_", "XDG_"))}
    return {**env, "HOME": home}


@contextmanager
def documented_daemon(line: str, home: str, timeout: float = 120.0) -> Iterator[dict[str, str]]:
    """Run a doc's ``tierd serve ...`` line as written (a trailing ``&`` and ``# comment``
    dropped) in ``fresh_user_env(home)``, this Python running ``tierd``; yield that environment
    once the daemon answers on the socket its own defaults name (RuntimeError quoting its log if
    it does not), and stop it on exit."""
    words = shlex.split(line, comments=True)
    words = words[:-1] if words[-1:] == ["&"] else words
    assert words[:2] == ["tierd", "serve"], f"not a `tierd serve` line: {line!r}"
    env = fresh_user_env(home)
    socket_path = client_socket_path(env)
    log_path = os.path.join(home, LOG_NAME)
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "tierd.cli", *words[1:]], env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        with TierdClient(socket_path=socket_path, timeout=10.0) as client:
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"`{line}` did not answer on {socket_path}:\n"
                                       + open(log_path).read()[-3000:])
                try:
                    client.wait_ready(timeout=0.5)
                    break
                except grpc.FutureTimeoutError:
                    pass
        yield env
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
