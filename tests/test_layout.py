"""The house's rooms: README.md's Layout table names every package on disk and no other, every
package says in 2-5 lines what it holds, and the engine side (connector/) reaches the daemon only
through ``tierd.wire``."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def packages() -> dict[str, Path]:
    """Every package under tierd/ (links followed): import name -> folder, as the checkout has
    it (``tierd/connector`` is reported as ``connector/``)."""
    found = {}
    for folder, dirs, files in os.walk(ROOT / "tierd", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found[".".join(Path(folder).relative_to(ROOT).parts)] = Path(folder).resolve()
    return found


def layout_rows() -> dict[str, str]:
    """README.md's Layout table: import name (second column) -> path (first column's first
    backquoted name)."""
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    return {name: re.findall(r"`([^`]+)`", row[1])[0]
            for row in rows for name in re.findall(r"`([^`]+)`", row[2])}


def test_readme_layout_lists_every_package() -> None:
    """The table names each package under tierd/ and no package that is gone."""
    assert {"tierd", "tierd.wire", "tierd.daemon", "tierd.connector.reference",
            "tierd.connector.vllm.connector", "tierd.connector.vllm.tier"} <= set(packages())
    assert set(layout_rows()) == set(packages())


def test_readme_layout_paths_are_the_packages_folders() -> None:
    """Each row's path is the folder of the package it names."""
    found = packages()
    for name, path in layout_rows().items():
        assert (ROOT / path).resolve() == found[name], (name, path)


def test_every_package_says_what_it_holds() -> None:
    """Every package's ``__init__`` docstring is 2-5 lines."""
    for name, folder in packages().items():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc is not None and 2 <= len(doc.splitlines()) <= 5, (name, doc)


def _imported(path: Path) -> list[str]:
    """Every module ``path`` imports anywhere (lazily, under TYPE_CHECKING alike)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_the_engine_side_imports_nothing_of_the_daemon() -> None:
    """No module under connector/ imports ``tierd.daemon`` (the wire types live in tierd.wire)."""
    bad = {str(path.relative_to(ROOT)): name
           for path in sorted((ROOT / "connector").rglob("*.py")) for name in _imported(path)
           if name == "tierd.daemon" or name.startswith("tierd.daemon.")}
    assert bad == {}


_LOADED = """
import json, sys
import tierd.wire.arena, tierd.wire.client, tierd.wire.convert, tierd.wire.presence
import tierd.connector.core, tierd.connector.sglang, tierd.connector.vllm.connector
import tierd.connector.vllm.tier.jobs, tierd.connector.vllm.tier.lookups
import tierd.connector.reference.tierd_hooks
print(json.dumps(sorted(sys.modules)))
"""


def test_the_wire_and_the_engine_side_load_no_daemon_module() -> None:
    """Importing every engine-side front end and the wire loads no module of ``tierd.daemon``."""
    out = subprocess.run([sys.executable, "-P", "-c", _LOADED], env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert "tierd.connector.vllm.connector.worker" in loaded
    assert [m for m in loaded if m.startswith("tierd.daemon")] == []
