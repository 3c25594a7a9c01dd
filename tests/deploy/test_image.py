"""The project's images, run for real on a Docker engine: the daemon container becomes healthy
and answers `tierd stats` and `/metrics` from the host, the demo runs from a second container
sharing its IPC namespace and socket volume, and a plain `docker run` with Docker's defaults
fails at once with a message naming the fix."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_images import ROOT, Images
from docker_engine import DockerEngine

IMAGE_LIMIT_BYTES = 400 * 10**6
SMALL = ("-e", "TIERD_DRAM_BYTES=192MiB", "--shm-size", "256m")  # fits a CI runner's memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_stats(socket_path: Path) -> dict[str, object]:
    """`tierd stats --json` run on the host (this checkout) against a container's socket."""
    done = subprocess.run([sys.executable, "-P", "-m", "tierd.cli", "stats", "--socket-path",
                           str(socket_path), "--json"], capture_output=True, text=True,
                          timeout=60, env=_host_env())
    assert done.returncode == 0, done.stderr
    stats: dict[str, object] = json.loads(done.stdout)
    return stats


def tier(stats: dict[str, object], name: str) -> dict[str, int]:
    """One tier's entry of `tierd stats --json` ("dram" or "ssd")."""
    (entry,) = [t for t in stats["tiers"] if name in str(t["tier"]).lower()]  # type: ignore[attr-defined]
    return entry  # type: ignore[no-any-return]


def _host_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "build" / "pythonpath"))


@pytest.fixture
def name(docker: DockerEngine) -> Iterator[str]:
    """A unique container name, removed at teardown."""
    name = f"tierd-test-{uuid.uuid4().hex[:8]}"
    yield name
    docker.run("rm", "-f", "-v", name, check=False)


def test_daemon_image_has_no_torch_and_stays_small(docker: DockerEngine, images: Images) -> None:
    """The daemon image carries no torch and stays under 400 MB (its size is printed for the
    README); the engine image has torch."""
    size = docker.inspect(images.daemon)["Size"]
    print(f"\n{images.daemon}: {size / 1e6:.0f} MB (limit {IMAGE_LIMIT_BYTES / 1e6:.0f} MB)")
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
    assert docker.run("run", "--rm", "--entrypoint", "python", images.daemon, "-c", probe,
                      check=False).returncode == 0, "torch is installed in the daemon image"
    assert docker.run("run", "--rm", "--entrypoint", "python", images.engine, "-c", probe,
                      check=False).returncode == 1, "the engine image lost torch"
    assert size <= IMAGE_LIMIT_BYTES


def test_images_carry_the_native_helpers_built_at_install(docker: DockerEngine,
                                                          images: Images) -> None:
    """Both images hold the native helpers, built by the build stage's compiler (which the
    images themselves do not carry), and they load: checksums and loads take no Python path."""
    probe = ("import shutil, sys; from tierd.connector.native import library; "
             "sys.exit(library.shared_library() is None or shutil.which('gcc') is not None)")
    for image in (images.daemon, images.engine):
        assert docker.run("run", "--rm", "--entrypoint", "python", image, "-c", probe,
                          check=False).returncode == 0, f"{image}: no native helpers, or a gcc"


def test_daemon_healthy_stats_metrics_and_demo_from_a_second_container(
        docker: DockerEngine, images: Images, name: str, tmp_path: Path) -> None:
    """The daemon container turns healthy; the host reads `tierd stats` through the socket
    folder and `/metrics` through the published port; the demo container (IPC and socket shared)
    exits 0 having loaded blocks from the daemon, which the host then sees."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)   # the container's user (10001) binds the socket here
    port = free_port()
    docker.run("run", "-d", "--name", name, "--ipc", "shareable", *SMALL,
               "-e", "TIERD_METRICS_PORT=9400", "-e", "TIERD_METRICS_HOST=0.0.0.0",
               "-p", f"127.0.0.1:{port}:9400", "-v", f"{run_dir}:/run/tierd", images.daemon)
    docker.wait_healthy(name)
    stats = host_stats(run_dir / "tierd.sock")
    assert tier(stats, "dram")["capacity_bytes"] == 192 << 20
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert b"tierd_" in metrics
    demo = docker.run("run", "--rm", "--ipc", f"container:{name}",
                      "-v", f"{run_dir}:/run/tierd", images.engine,
                      "demo", "--socket-path", "/run/tierd/tierd.sock", "--system-tokens", "512",
                      check=False, timeout=600)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    loaded = re.search(r"loaded from tierd (\d+)", demo.stdout)
    assert loaded and int(loaded.group(1)) > 0, demo.stdout[-3000:]
    assert tier(host_stats(run_dir / "tierd.sock"), "dram")["used_blocks"] > 0


def test_plain_docker_run_fails_at_once_naming_the_fix(docker: DockerEngine, images: Images,
                                                       name: str) -> None:
    """`docker run tierd:local` with Docker's defaults (64 MB /dev/shm, 1 GiB arena): the daemon
    exits within seconds, non-zero, naming --shm-size and TIERD_DRAM_BYTES (no SIGBUS)."""
    started = time.monotonic()
    done = docker.run("run", "--name", name, images.daemon, check=False, timeout=120)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode not in (0, 135), output
    assert "--shm-size" in output and "TIERD_DRAM_BYTES" in output, output
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
