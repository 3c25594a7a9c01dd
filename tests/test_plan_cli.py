"""`tierd plan` and the `tierd demo` walk-through, through the real console-script dispatcher."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierd.cli import build_parser, main
from tierd.commands import plan as plan_command

BUNDLED = Path(__file__).resolve().parents[1] / "examples" / "chat_trace.jsonl"


def test_llama3_8b_fp16_prints_vllm_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """`tierd plan --kv-pool-gib 48`: 128 KiB/token, 2 MiB/block, 393,216 tokens, 48.00x."""
    assert main(["plan", "--model", "Llama-3-8B", "--kv-pool-gib", "48"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "KV bytes per token: 128 KiB" in out
    assert "KV bytes per block: 2 MiB (16 tokens)" in out
    assert "GPU KV cache size: 393,216 tokens" in out
    assert "Maximum concurrency for 8,192 tokens per request: 48.00x" in out
    assert out[out.index("Maximum concurrency for 8,192 tokens per request: 48.00x") + 2] == (
        "Concurrency 48.00x is 10-50x: workable, but traffic peaks will trigger preemption. "
        "Try, in order:")


def test_fp8_prints_half_bytes_double_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """`--kv-cache-dtype fp8`: 64 KiB/token, 1 MiB/block, 786,432 tokens, 96.00x."""
    assert main(["plan", "--kv-pool-gib", "48", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out.splitlines()
    for line in ("KV bytes per token: 64 KiB", "KV bytes per block: 1 MiB (16 tokens)",
                 "GPU KV cache size: 786,432 tokens",
                 "Maximum concurrency for 8,192 tokens per request: 96.00x"):
        assert line in out


def test_json_has_every_figure_and_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json --trace`: plan figures and trace waste as JSON; paged waste under 4%."""
    assert main(["plan", "--kv-pool-gib", "48", "--json", "--trace", str(BUNDLED)]) == 0
    doc = json.loads(capsys.readouterr().out)
    p = doc["plan"]
    assert (p["kv_bytes_per_token"], p["kv_bytes_per_block"]) == (131_072, 2_097_152)
    assert (p["num_blocks"], p["kv_cache_tokens"], p["max_concurrency"]) == (24_576, 393_216, 48.0)
    assert p["band"] == "10_to_50x"
    assert doc["trace"]["requests"] == 300
    assert doc["trace"]["paged_waste_fraction"] < 0.04


def test_trace_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    """`--trace` adds the contiguous-vs-paged lines for the bundled mix."""
    assert main(["plan", "--kv-pool-gib", "48", "--trace", str(BUNDLED)]) == 0
    out = capsys.readouterr().out
    assert "300 requests, mean 1,538 tokens, longest 8,192" in out
    assert "243.68 GiB wasted, 81.2% of what it reserves; 48 requests fit at once" in out
    assert "280.62 MiB wasted, 0.48% of what it reserves; 254 such requests fit at once" in out


def test_gpu_budget_and_tensor_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    """70B fp8 on 4x H100 at 0.93 with 70 GiB weights: per-GPU bytes and the pool sum."""
    argv = ["plan", "--model", "Llama-3-70B", "--gpu", "H100", "-tp", "4",
            "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.93",
            "--weights-gib", "70", "--max-model-len", "32768"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "KV bytes per token: 160 KiB, 40 KiB on each of 4 GPUs" in out
    assert ("KV pool: 80 GiB x 0.93 - weights 17.50 GiB - overhead 4 GiB = 52.9 GiB per GPU"
            in out)
    assert "Maximum concurrency for 32,768 tokens per request: 42.32x" in out


def test_custom_shape(capsys: pytest.CaptureFixture[str]) -> None:
    """`--model custom` with the three shape flags: 2 x 4 x 2 x 64 x 2 bytes = 2 KiB/token."""
    argv = ["plan", "--model", "custom", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
            "--kv-pool-gib", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "KV bytes per token: 2 KiB" in out
    assert "GPU KV cache size: 524,288 tokens" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "Llama-2", "--kv-pool-gib", "4"], "unknown model preset 'Llama-2'"),
        (["--block-size", "12", "--kv-pool-gib", "4"], "block size 12 is not a power of two"),
        (["--gpu-memory-utilization", "1.5", "--gpu", "H100"], r"outside (0, 1]"),
        (["--kv-pool-gib", "0.001"], "smaller than one 16-token block"),
        (["--model", "custom", "--layers", "4", "--kv-pool-gib", "4"],
         "--model custom needs --layers, --kv-heads and --head-dim"),
        (["--layers", "40", "--gpu", "H100"], "has no known weight size: give --weights-gib"),
        (["--gpu", "Z1"], "unknown GPU 'Z1'"),
        ([], "give --kv-pool-gib"),
        (["--kv-pool-gib", "4", "--trace", "/nonexistent/t.jsonl"], "does not exist; fix --trace"),
    ],
)
def test_bad_input_exits_2_with_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad input exits with status 2 and a one-line message naming the fix."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierd plan: error: ")
    assert message in err


def test_bad_trace_line_names_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace whose second line lacks output_len exits 2 naming line 2 and the format."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 3, "output_len": 4}\n{"prompt_len": 3}\n')
    assert main(["plan", "--kv-pool-gib", "4", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace} line 2: output_len must be a non-negative integer, got None" in err
    assert '{"prompt_len": 512, "output_len": 128}' in err


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Every `tierd plan` flag carries help text, and `--help` renders it."""
    sub = argparse.ArgumentParser()
    plan_command.configure(sub)
    flags = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(flags) == 16
    assert all(a.help and len(a.help) > 20 for a in flags), [a.dest for a in flags if not a.help]
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["plan", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(a.option_strings[0] in out for a in flags)


def test_walkthrough_prints_plans_and_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """`tierd demo --walkthrough` narrates a few plans, then paged vs contiguous."""
    assert main(["demo", "--walkthrough"]) == 0
    out = capsys.readouterr().out
    assert "   GPU KV cache size: 393,216 tokens" in out
    assert "   Maximum concurrency for 8,192 tokens per request: 96.00x" in out
    assert "Caveat: A100 is Ampere: no native fp8" in out
    assert "0.48% of what it reserves" in out


def test_plan_never_imports_torch() -> None:
    """`tierd plan` and `tierd demo --walkthrough` through the console entry point leave torch
    unimported."""
    code = (
        "import sys, contextlib, io\n"
        "from tierd.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--kv-pool-gib', '48']) == 0\n"
        "    assert main(['demo', '--walkthrough']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip() == "False"
