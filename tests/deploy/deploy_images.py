"""The images the deployment tests run, built without an image registry.

- **Base images** from Debian's own archive: ``debootstrap`` (minbase, bookworm: Python 3.11 and
  its venv module) packed into a tarball and ``docker import``-ed as ``tierd-test-base``; a copy
  with ``redis-server`` as ``tierd-test-redis`` (the compose file's Redis). The tarballs are kept
  in the cache folder (``TIERD_DEPLOY_CACHE``, default ``~/.cache/tierd/deploy``): ~3 min once.
- **A wheelhouse** of tierd's dependencies and CPU torch, downloaded by the base image's own pip
  (so markers match its Python) with this host's CA bundle and ``/opt/wheels``; kept in the cache
  folder, keyed by the dependency list, and served to builds from a loopback HTTP server.
- **The project's images** from its own Dockerfile, base image and pip sources as build args:
  ``tierd:local`` (daemon, the default target) and ``tierd-engine:local`` (``--target engine``).
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from docker_engine import DockerEngine

ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
TORCH = "torch==2.13.0"      # the CPU wheel this machine keeps in /opt/wheels
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
WHEELS = os.environ.get("TORCH_WHEEL_DIR", "/opt/wheels")


@dataclass(frozen=True)
class Images:
    """Names of the images a session built."""

    base: str
    redis: str
    daemon: str
    engine: str


def cache_dir() -> Path:
    path = Path(os.environ.get("TIERD_DEPLOY_CACHE")
                or Path.home() / ".cache" / "tierd" / "deploy")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _rootfs_tarball(name: str, extra: tuple[str, ...]) -> Path:
    """``cache/NAME-bookworm.tar``: a minbase Debian with python3-venv (and ``extra``)."""
    tarball = cache_dir() / f"{name}-{SUITE}.tar"
    if tarball.exists():
        return tarball
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is missing: apt-get install debootstrap")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        rootfs = Path(tmp) / "rootfs"
        include = ",".join(("python3", "python3-venv", *extra))
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={include}", SUITE,
                        str(rootfs), MIRROR], check=True, capture_output=True, timeout=1200)
        subprocess.run(["chroot", str(rootfs), "apt-get", "clean"], check=True, timeout=60)
        for folder in ("var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info"):
            shutil.rmtree(rootfs / folder, ignore_errors=True)
            (rootfs / folder).mkdir()
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True,
                       timeout=300)
        partial.rename(tarball)
    return tarball


def import_base(docker: DockerEngine, name: str, extra: tuple[str, ...] = ()) -> str:
    """``docker import`` of the cached rootfs; returns the image name."""
    image = f"{name}:{SUITE}"
    if docker.run("image", "inspect", image, check=False).returncode != 0:
        with open(_rootfs_tarball(name, extra), "rb") as tar:
            subprocess.run(["docker", "import", "-", image], stdin=tar, check=True,
                           capture_output=True, env=docker.env, timeout=300)
    return image


def requirements() -> list[str]:
    """What the images install: tierd's dependencies, its engine extra, the build backend."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build = project["build-system"]["requires"]
    deps = project["project"]["dependencies"]
    engine = project["project"]["optional-dependencies"].get("engine", [])
    return sorted({*build, *deps, *(d for d in engine if not d.startswith("torch")), TORCH})


def wheelhouse(docker: DockerEngine, base: str) -> Path:
    """``cache/wheels-KEY``: every wheel of ``requirements()`` for the base image's Python."""
    wanted = requirements()
    key = hashlib.sha256("\n".join([base, *wanted]).encode()).hexdigest()[:12]
    folder = cache_dir() / f"wheels-{key}"
    if (folder / ".complete").exists():
        return folder
    folder.mkdir(exist_ok=True)
    quoted = " ".join(f"'{r}'" for r in wanted)
    docker.run("run", "--rm", "--network", "host", "-v", f"{folder}:/wh",
               "-v", f"{WHEELS}:/opt/wheels:ro", "-v", f"{HOST_CA}:/host-ca.crt:ro", base,
               "sh", "-c", "python3 -m venv /tmp/v && /tmp/v/bin/pip download -q "
               f"--cert /host-ca.crt --find-links /opt/wheels -d /wh {quoted}")
    (folder / ".complete").touch()
    return folder


@contextmanager
def served(folder: Path) -> Iterator[str]:
    """A loopback HTTP server listing ``folder`` (a pip ``--find-links`` page); yields its URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build_all(docker: DockerEngine) -> Images:
    """Base images, then the daemon and engine images from the project's Dockerfile."""
    base = import_base(docker, "tierd-test-base")
    redis = import_base(docker, "tierd-test-redis", ("redis-server",))
    with served(wheelhouse(docker, base)) as url:
        local = f"--no-index --find-links {url}"
        # The classic builder builds every stage before the target (BuildKit skips unused ones),
        # so the daemon's build needs torch's source too; the engine's build reuses that layer.
        common = ("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}",
                  "--build-arg", f"PIP_ARGS={local}", "--build-arg", f"TORCH_ARGS={local}")
        docker.run(*common, "-t", "tierd:local", str(ROOT))
        docker.run(*common, "--target", "engine", "-t", "tierd-engine:local", str(ROOT))
    return Images(base, redis, "tierd:local", "tierd-engine:local")


if __name__ == "__main__":  # builds the images by hand: python tests/deploy/deploy_images.py
    engine = DockerEngine.start(Path(tempfile.gettempdir()) / "tierd-docker-by-hand")
    print(build_all(engine), file=sys.stderr)
