"""The chart's DaemonSet pod run on Docker as a kubelet would run it: host folders made
root:root 0755 (as `DirectoryOrCreate` makes them), the initContainer and the daemon with the
rendered commands, users, capabilities, environment and mounts. The daemon's user binds its
socket; an engine of the same user runs the demo through the host paths; the daemon killed with
-9 and replaced keeps its SSD blocks and leaves no arena behind."""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_images import ROOT, Images
from docker_engine import DockerEngine
from test_image import host_stats, tier

helm = pytest.importorskip("helm_python", reason="needs Helm's SDK: run `make test-deploy`")

DOWNWARD = {"spec.nodeName": "test-node", "status.podIP": "127.0.0.1"}


def pod_spec(values: dict[str, Any]) -> dict[str, Any]:
    rendered = helm.Chart.load(ROOT / "helm" / "tierd").render(values, name="rel",
                                                               namespace="ns")
    (daemon,) = [d for d in yaml.safe_load_all(rendered["tierd/templates/daemonset.yaml"]) if d]
    spec: dict[str, Any] = daemon["spec"]["template"]["spec"]
    return spec


def docker_args(container: dict[str, Any], spec: dict[str, Any],
                host_paths: dict[str, Path]) -> list[str]:
    """`docker run` flags for a pod's container: user, capabilities, no-new-privileges, env
    (downward-API fields filled in), host-path mounts (each hostPath replaced by a test folder)."""
    security = container.get("securityContext", {})
    args = ["--user", f"{security.get('runAsUser', 0)}:{security.get('runAsGroup', 0)}"]
    for group in spec.get("securityContext", {}).get("supplementalGroups", []):
        args += ["--group-add", str(group)]
    caps = security.get("capabilities", {})
    args += [f"--cap-drop={c}" for c in caps.get("drop", [])]
    args += [f"--cap-add={c}" for c in caps.get("add", [])]
    if security.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    for env in container.get("env", []):
        value = env.get("value")
        if value is None:
            value = DOWNWARD[env["valueFrom"]["fieldRef"]["fieldPath"]]
        args += ["-e", f"{env['name']}={value}"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    for mount in container.get("volumeMounts", []):
        args += ["-v", f"{host_paths[volumes[mount['name']]]}:{mount['mountPath']}"]
    if "command" in container:
        args += ["--entrypoint", container["command"][0]]
    return args


def container_command(container: dict[str, Any]) -> list[str]:
    command: list[str] = container.get("command", [])[1:] + container.get("args", [])
    return command


@pytest.fixture
def host(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Test folders for the chart's host paths: socket and SSD folders root:root 0755 (what the
    kubelet creates), the "node's /dev/shm" a 1777 folder in this host's /dev/shm."""
    shm = Path("/dev/shm") / f"tierd-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o1777)
    shm.chmod(0o1777)
    paths = {"/run/tierd": tmp_path / "run", "/var/lib/tierd/ssd": tmp_path / "ssd",
             "/dev/shm": shm}
    for path in (paths["/run/tierd"], paths["/var/lib/tierd/ssd"]):
        path.mkdir(mode=0o755)
        os.chown(path, 0, 0)
    yield paths
    shutil.rmtree(shm, ignore_errors=True)


def test_pod_binds_serves_an_engine_and_survives_kill_9(docker: DockerEngine, images: Images,
                                                        host: dict[str, Path]) -> None:
    """initContainer then daemon as uid 10001 with every capability dropped: healthy on its
    socket; the demo engine (uid 10001, host paths mounted as the chart's README says) loads
    from it; kill -9, and a replacement pod keeps the SSD blocks and removes the dead arena."""
    repository, tag = images.daemon.split(":")
    spec = pod_spec({"image": {"repository": repository, "tag": tag},
                     "dram": {"bytes": "192MiB"}, "redis": {"enabled": False}})
    (init,) = spec["initContainers"]
    (main,) = spec["containers"]
    prepared = docker.run("run", "--rm", *docker_args(init, spec, host), images.daemon,
                          *container_command(init), check=False)
    assert prepared.returncode == 0, prepared.stderr
    names = [f"tierd-pod-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        docker.run("run", "-d", "--name", names[0], *docker_args(main, spec, host),
                   images.daemon, *container_command(main))
        docker.wait_healthy(names[0])
        sock = host["/run/tierd"] / "tierd.sock"
        demo = docker.run("run", "--rm", "--user", "10001:10001",
                          "-v", f"{host['/run/tierd']}:/run/tierd",
                          "-v", f"{host['/dev/shm']}:/dev/shm", images.engine,
                          "demo", "--socket-path", "/run/tierd/tierd.sock",
                          "--system-tokens", "512", check=False, timeout=600)
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        deadline = time.monotonic() + 60   # the write-behind gives every block an SSD copy
        while (ssd := tier(host_stats(sock), "ssd")["used_blocks"]) == 0:
            assert time.monotonic() < deadline, "no block reached the SSD tier"
            time.sleep(1)
        dead = arenas(host["/dev/shm"])
        assert dead, "the arena is not in the node's /dev/shm"
        docker.run("kill", "-s", "KILL", names[0])
        docker.run("run", "-d", "--name", names[1], *docker_args(main, spec, host),
                   images.daemon, *container_command(main))
        docker.wait_healthy(names[1])
        assert tier(host_stats(sock), "ssd")["used_blocks"] >= ssd
        alive = arenas(host["/dev/shm"])
        assert alive and not set(alive) & set(dead), (dead, alive)
    finally:
        docker.run("rm", "-f", *names, check=False)


def arenas(folder: Path) -> list[str]:
    """The arena files in a /dev/shm folder."""
    return sorted(n for n in os.listdir(folder) if re.match(r"tierd-arena-[0-9a-f]+$", n))
