"""A Docker engine for the deployment tests: the one already running, or Debian's `dockerd`
started for the session with its data in a temporary folder.

``DockerEngine.start(tmp)`` asks the engine at ``DOCKER_HOST`` (or the default socket); when none
answers it starts ``dockerd`` on a socket of its own under ``tmp`` (data root and exec root there
too) and ``stop()`` ends it and removes what it made. Builds use the classic builder
(``DOCKER_BUILDKIT=0``): Debian's engine ships no buildx.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


class DockerEngine:
    """Runs ``docker`` (and ``docker compose``) against one engine."""

    def __init__(self, host: str | None, process: subprocess.Popen[bytes] | None = None,
                 root: Path | None = None) -> None:
        self.env = dict(os.environ, DOCKER_BUILDKIT="0")
        if host:
            self.env["DOCKER_HOST"] = host
        self._process = process
        self._root = root

    @classmethod
    def start(cls, tmp: Path) -> DockerEngine:
        """The engine already answering, or a new ``dockerd`` under ``tmp`` (made only then);
        RuntimeError naming the fix when neither works."""
        if shutil.which("docker") is None:
            raise RuntimeError("no docker client: apt-get install docker.io")
        running = cls(os.environ.get("DOCKER_HOST"))
        if running.run("info", check=False, timeout=20).returncode == 0:
            return running
        if shutil.which("dockerd") is None:
            raise RuntimeError("no Docker engine answers and dockerd is missing: "
                               "apt-get install docker.io")
        tmp.mkdir(parents=True, exist_ok=True)
        host = f"unix://{tmp}/docker.sock"
        log = open(tmp / "dockerd.log", "wb")
        process = subprocess.Popen(
            ["dockerd", "--host", host, "--data-root", str(tmp / "data"),
             "--exec-root", str(tmp / "exec"), "--pidfile", str(tmp / "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        engine = cls(host, process, tmp)
        deadline = time.monotonic() + 60
        while engine.run("info", check=False, timeout=20).returncode != 0:
            if process.poll() is not None or time.monotonic() > deadline:
                engine.stop()
                raise RuntimeError(f"dockerd did not start: see {tmp / 'dockerd.log'}")
            time.sleep(0.5)
        return engine

    def stop(self) -> None:
        """Stop the engine this object started (containers first); no-op for a borrowed one."""
        if self._process is None:
            return
        running = self.run("ps", "-q", check=False).stdout.split()
        if running:
            self.run("rm", "-f", *running, check=False)
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._root is not None:
            for mounted in ("data", "exec/netns/default"):   # what dockerd may leave mounted
                subprocess.run(["umount", "-R", str(self._root / mounted)], capture_output=True)
            shutil.rmtree(self._root, ignore_errors=True)
        self._process = None

    def run(self, *args: str, check: bool = True, timeout: float = 900,
            input: str | None = None, cwd: str | Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``docker ARGS``; with ``check`` a failure raises with its output."""
        done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                              input=input, cwd=cwd, env=dict(self.env, **(env or {})))
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited {done.returncode}:\n"
                               f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done

    def inspect(self, name: str) -> dict[str, Any]:
        """``docker inspect`` of one container or image."""
        result: list[dict[str, Any]] = json.loads(self.run("inspect", name).stdout)
        return result[0]

    def wait_healthy(self, name: str, timeout: float = 120) -> None:
        """Until the container's health check passes; RuntimeError with its logs if it exits or
        stays unhealthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.inspect(name)["State"]
            if state.get("Health", {}).get("Status") == "healthy":
                return
            if not state["Running"]:
                break
            time.sleep(1)
        logs = self.run("logs", name, check=False)
        raise RuntimeError(f"container {name} not healthy:\n{logs.stdout[-3000:]}"
                           f"{logs.stderr[-3000:]}")
