"""docker-compose.yml brought up as shipped (`docker compose up`, Compose v2): Redis, the daemon
and the demo worker, until the demo exits 0. The only override swaps the Redis image for one made
without a registry; the project's images are the ones the session built from its Dockerfile."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from deploy_images import ROOT, Images
from docker_engine import DockerEngine


def test_compose_up_runs_the_demo_to_exit_0(docker: DockerEngine, images: Images,
                                            tmp_path: Path) -> None:
    """Every service starts in order (Redis healthy, then tierd healthy, then the demo), the demo
    connects to the daemon through the shared socket volume and IPC namespace and exits 0."""
    override = tmp_path / "images.yml"
    override.write_text(f"services:\n  redis:\n    image: {images.redis}\n")
    project = f"tierd-test-{uuid.uuid4().hex[:8]}"
    compose = ["docker-compose", "-p", project, "-f", str(ROOT / "docker-compose.yml"),
               "-f", str(override)]
    env = dict(docker.env, TIERD_DRAM_BYTES="192MiB", TIERD_SHM_SIZE="256m")
    try:
        up = subprocess.run([*compose, "up", "--no-build", "--exit-code-from", "demo"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-2000:]
        assert "loaded from tierd" in up.stdout and "tierd-1" in up.stdout
    finally:
        subprocess.run([*compose, "down", "-v"], capture_output=True, timeout=120, env=env)
