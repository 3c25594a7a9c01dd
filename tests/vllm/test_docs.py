"""docs/vllm.md's `vllm serve` command is valid for vLLM 0.33: its own argument parser takes it
and builds a KV-transfer config that names TierdConnector with the documented settings."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")

from tierd.connector.vllm.connector import VLLM_VERSIONS_TESTED, TierdVllmConfig  # noqa: E402

pytestmark = pytest.mark.vllm

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "vllm.md")


def documented_commands() -> list[list[str]]:
    """The `vllm serve` arguments of docs/vllm.md's command blocks (GPU, then CPU)."""
    blocks = re.findall(r"```bash\n(.*?)```", open(DOC).read(), re.S)
    assert len(blocks) >= 2, "docs/vllm.md lost its GPU or CPU command block"
    return [documented_command(block) for block in blocks[:2]]


def documented_command(block: str) -> list[str]:
    line = " ".join(part.rstrip("\\").strip() for part in block.splitlines()
                    if part.strip() and not part.startswith("tierd serve"))
    words = shlex.split(line)
    assert words[:3] == ["PYTHONHASHSEED=0", "vllm", "serve"], words[:3]
    return words[3:]


@pytest.mark.parametrize("which,block_size", [(0, 16), (1, 32)], ids=["gpu", "cpu"])
def test_documented_flags_parse_with_vllms_own_parser(which: int, block_size: int) -> None:
    """`vllm serve`'s parser (vLLM 0.33) accepts the documented flags (GPU: block size 16; CPU:
    32, which vLLM's CPU attention needs); the connector's extra config parses with tierd's own
    keys."""
    import vllm
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert vllm.__version__ in VLLM_VERSIONS_TESTED
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(documented_commands()[which])
    assert args.model == "MODEL" or args.model_tag == "MODEL"
    assert args.prefix_caching_hash_algo == "sha256_cbor" and args.block_size == block_size
    transfer = args.kv_transfer_config
    assert transfer.kv_connector == "TierdConnector"
    assert transfer.kv_connector_module_path == "tierd.connector.vllm.connector"
    assert transfer.kv_role == "kv_both" and transfer.kv_load_failure_policy == "recompute"
    TierdVllmConfig.from_extra_config(transfer.kv_connector_extra_config)


def test_documented_tier_command_parses() -> None:
    """docs/vllm.md's TierdTier command: vLLM 0.33's parser takes it, its extra config is a
    TieringOffloadingSpec whose secondary tier vLLM's factory resolves to TierdTier, and the
    tier's own keys parse with tierd's config."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from tierd.connector.vllm.tier import TierdTier

    blocks = re.findall(r"```bash\n(.*?)```", open(DOC).read(), re.S)
    (block,) = [b for b in blocks if "OffloadingConnector" in b]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(documented_command(block))
    transfer = args.kv_transfer_config
    assert transfer.kv_connector == "OffloadingConnector"
    extra = transfer.kv_connector_extra_config
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] > 0
    (tier,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(tier) is TierdTier
    own = {k: v for k, v in tier.items() if k not in ("type", "module_path")}
    TierdVllmConfig.from_extra_config(own, where="secondary_tiers entry", front_end="TierdTier")


@pytest.mark.parametrize("which", ["TierdConnector", "OffloadingConnector"])
def test_quick_start_as_written_connects(which: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick start copied as printed: its `tierd serve` line with defaults, in a new user's
    environment, and the engine's settings from its `--kv-transfer-config`, reach one another:
    the engine registers on the daemon (nothing silently runs without tierd)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tierd.bench.tierd_serve import documented_daemon
    from tierd.connector.core.link import DaemonLink
    from tierd.wire.layout import Layout

    blocks = re.findall(r"```bash\n(.*?)```", open(DOC).read(), re.S)
    block = next(b for b in blocks if which in b)
    (daemon_line,) = [line for line in block.splitlines() if line.startswith("tierd serve")]
    transfer = make_arg_parser(FlexibleArgumentParser()).parse_args(
        documented_command(block)).kv_transfer_config
    extra = transfer.kv_connector_extra_config
    if which == "OffloadingConnector":
        (tier,) = extra["secondary_tiers"]
        extra = {k: v for k, v in tier.items() if k not in ("type", "module_path")}
    with documented_daemon(daemon_line, str(tmp_path)) as env:
        for key in [k for k in os.environ if k.startswith(("TIERD_", "XDG_"))]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("HOME", env["HOME"])
        config = TierdVllmConfig.from_extra_config(extra)
        link = DaemonLink(config, Layout(2, 2, 64, "float16", 16, model_id="quickstart@0"),
                          attach=True)
        try:
            assert link.connect(), "the documented engine config does not reach the daemon"
            assert link.client.stats().engines
        finally:
            link.close()
