"""In the vLLM venv (tierd imported from the checkout through ``build/pythonpath``), every module
has one import name too: the checkout's connector/, gpu/ and tests/ are not top-level packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]

_NAMES = """
import importlib.util, json
import tierd.connector.vllm.connector, tierd.gpu
print(json.dumps({
    "second": [n for n in ("tierd.tierd", "connector", "gpu", "tests")
               if importlib.util.find_spec(n) is not None],
    "gpu": list(tierd.gpu.__path__), "vllm": tierd.connector.vllm.__file__}))
"""


def test_one_name_per_module_in_the_vllm_venv(tmp_path: Path) -> None:
    """tierd.connector.vllm and tierd.gpu import from the checkout's tierd/; gpu, connector,
    tests and tierd.tierd do not import."""
    out = subprocess.run([sys.executable, "-P", "-c", _NAMES], cwd=tmp_path, env=dict(os.environ),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["second"] == []
    assert [os.path.realpath(p) for p in got["gpu"]] == [str(ROOT / "gpu")]
    assert os.path.realpath(got["vllm"]) == str(ROOT / "connector" / "vllm" / "__init__.py")
