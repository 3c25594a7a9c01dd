"""docs/sglang.md's launch command, parsed by SGLang 0.5.23's own argument parser, and its extra
config building tierd's backend."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs real SGLang: run `make test-sglang`")

from sglang.srt.server_args import ServerArgs  # noqa: E402

from tierd.connector.sglang import SGLANG_VERSIONS_TESTED, TierdSglangConfig  # noqa: E402

pytestmark = pytest.mark.sglang

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"


def launch_args() -> list[str]:
    """The arguments of the ``sglang.launch_server`` command in the doc's first bash block."""
    block = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    command = block.group(1).split("python -m sglang.launch_server", 1)[1]
    return shlex.split(command.replace("\\\n", " "))


def test_doc_command_parses_and_names_tierd() -> None:
    """SGLang's parser accepts every flag; the extra config selects tierd's class with the v1
    interface, and tierd's config parser accepts its keys."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(launch_args())
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert (extra["module_path"], extra["class_name"], extra["interface_v1"]) == (
        "tierd.connector.sglang", "TierdHiCacheStorage", 1)
    assert TierdSglangConfig.from_extra_config(extra).interface_v1
    import sglang

    assert sglang.__version__ in SGLANG_VERSIONS_TESTED
    assert f"Tested against SGLang {sglang.__version__}" in DOC.read_text()


def test_quick_start_as_written_connects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick start copied as printed: its `tierd serve` line with defaults, in a new user's
    environment, and the backend's settings from its extra config, reach one another: the
    backend registers on the daemon (nothing silently runs without tierd)."""
    import os

    from tierd.bench.tierd_serve import documented_daemon
    from tierd.connector.core.link import DaemonLink
    from tierd.wire.layout import Layout

    block = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    (daemon_line,) = [ln for ln in block.group(1).splitlines() if ln.startswith("tierd serve")]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    extra = json.loads(parser.parse_args(launch_args()).hicache_storage_backend_extra_config)
    with documented_daemon(daemon_line, str(tmp_path)) as env:
        for key in [k for k in os.environ if k.startswith(("TIERD_", "XDG_"))]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("HOME", env["HOME"])
        config = TierdSglangConfig.from_extra_config(extra)
        link = DaemonLink(config.link, Layout(2, 2, 64, "float16", 64, model_id="quickstart@0"),
                          attach=True)
        try:
            assert link.connect(), "the documented backend config does not reach the daemon"
            assert link.client.stats().engines
        finally:
            link.close()
