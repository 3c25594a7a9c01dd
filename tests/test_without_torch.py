"""The daemon's side of tierd runs where torch is not installed (its image carries none):
`tierd serve` answers Health and Stats, `stats`/`route`/`hash`/`plan` work, torch is an
engine-side extra (`tierd[engine]`), and `tierd demo` says to install it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierd.wire.client import TierdClient

ROOT = Path(__file__).resolve().parents[1]

NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
sys.argv = ["tierd", *sys.argv[1:]]
from tierd.cli import main
sys.exit(main())
"""
"""`tierd ARGS` in an interpreter where torch cannot be imported, whatever is installed."""


def tierd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-c", NO_TORCH, *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "TIERD_CONFIG": ""})


def test_serve_starts_and_answers_without_torch(tmp_path: Path) -> None:
    """`tierd serve` without torch comes up, is SERVING, answers Stats, and stops cleanly."""
    sock = str(tmp_path / "t.sock")
    daemon = subprocess.Popen(
        [sys.executable, "-P", "-c", NO_TORCH, "serve", "--socket-path", sock, "--dram-bytes",
         "8MiB", "--slab-bytes", "1MiB", "--no-prefault", "--ssd-dir", str(tmp_path / "ssd"),
         "--ssd-bytes", "4MiB"], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TIERD_CONFIG": ""})
    try:
        with TierdClient(socket_path=sock, timeout=10.0) as client:
            client.wait_ready(timeout=60)
            assert client.stats().engines == []
        stats = tierd("stats", "--socket-path", sock, "--json")
        assert stats.returncode == 0 and '"engines": []' in stats.stdout, stats.stderr
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, err
    assert "torch" not in err


def test_daemon_side_commands_run_without_torch(tmp_path: Path) -> None:
    """hash and plan do their work, stats and route their refusal of an absent daemon."""
    hashed = tierd("hash", ",".join(map(str, range(16))))
    assert hashed.returncode == 0 and "block 0" in hashed.stdout, hashed.stderr
    planned = tierd("plan", "--model", "llama-3-8b", "--kv-pool-gib", "20")
    assert planned.returncode == 0, planned.stderr
    stats = tierd("stats", "--socket-path", str(tmp_path / "none.sock"))
    assert (stats.returncode, "no daemon answers" in stats.stderr) == (1, True), stats.stderr
    route = tierd("route", "--tokens", ",".join(map(str, range(16))), "--model", "m@1",
                  "--num-layers", "2", "--num-kv-heads", "2", "--head-size", "16", "--dtype",
                  "float16", "--socket-path", str(tmp_path / "none.sock"))
    assert route.returncode == 1 and route.stderr.startswith(
        f"tierd route: error: daemon at {tmp_path / 'none.sock'}: UNAVAILABLE"), route.stderr


def test_demo_without_torch_names_the_extra() -> None:
    """`tierd demo` without torch exits 2 naming `pip install 'tierd[engine]'`."""
    demo = tierd("demo")
    assert demo.returncode == 2
    assert demo.stderr.strip() == (
        "tierd demo: error: this command runs an engine and needs torch: pip install "
        "'tierd[engine]' (serve, stats, route, hash and plan do not)")


def test_torch_is_an_engine_extra() -> None:
    """pyproject: torch is not a dependency of the daemon; `engine` and `test` bring it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("torch")]
    for extra in ("engine", "test"):
        assert "torch>=2.4,<3" in project["optional-dependencies"][extra]
