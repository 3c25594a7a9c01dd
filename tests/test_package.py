"""The package's shape: every module has one import name, the README's layout table names every
package, and the vLLM connector imports none of the daemon's server side."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Printed as JSON by a fresh interpreter outside the checkout (`-P`: no working directory on
# sys.path), so only what the environment itself provides is importable.
_NAMES = """
import importlib.util, json
import tierd.connector, tierd.gpu
print(json.dumps({
    "second": [n for n in ("tierd.tierd", "connector", "gpu", "tests")
               if importlib.util.find_spec(n) is not None],
    "gpu": list(tierd.gpu.__path__), "connector": list(tierd.connector.__path__)}))
"""

_VLLM_IMPORTS = """
import json, sys
import tierd.connector.vllm.connector
print(json.dumps(sorted(sys.modules)))
"""


def run_fresh(script: str, cwd: Path) -> object:
    """``script``'s JSON output, from a new interpreter of this environment started in ``cwd``."""
    out = subprocess.run([sys.executable, "-P", "-c", script], cwd=cwd, env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_module_has_one_name(tmp_path: Path) -> None:
    """tierd.gpu and tierd.connector come from tierd/; tierd.tierd, gpu, connector, tests do not
    import."""
    got = run_fresh(_NAMES, tmp_path)
    assert got == {"second": [], "gpu": [str(ROOT / "tierd" / "gpu")],
                   "connector": [str(ROOT / "tierd" / "connector")]}


def test_links_point_at_the_top_level_folders() -> None:
    """tierd/gpu and tierd/connector are relative links to gpu/ and connector/."""
    for name in ("gpu", "connector"):
        link = ROOT / "tierd" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link


def packages() -> set[str]:
    """Every package under tierd/ (links followed), as import names."""
    found = set()
    for folder, dirs, files in os.walk(ROOT / "tierd", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.add(".".join(Path(folder).relative_to(ROOT).parts))
    return found


def layout_imports() -> set[str]:
    """The import names in the second column of README.md's Layout table."""
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row[2])}


def test_readme_layout_lists_every_package() -> None:
    """README.md's Layout table names each package under tierd/, and no package that is gone."""
    assert packages() >= {"tierd", "tierd.daemon", "tierd.gpu", "tierd.connector.vllm.connector"}
    assert layout_imports() == packages()


def test_vllm_connector_imports_no_server_side(tmp_path: Path) -> None:
    """import tierd.connector.vllm.connector loads neither the daemon's config, the cluster
    code nor redis."""
    loaded = run_fresh(_VLLM_IMPORTS, tmp_path)
    assert isinstance(loaded, list) and "tierd.connector.vllm.connector.worker" in loaded
    assert [m for m in loaded if m == "redis" or m.startswith(
        ("tierd.daemon.config", "tierd.cluster", "redis."))] == []
