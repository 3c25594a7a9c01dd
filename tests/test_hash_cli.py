"""`tierd hash`: prints vLLM's known answer for tokens 0..15 and rejects bad input with status 2."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from tierd.cli import main
from tierd.hashing import block_hashes

NONE_HASH_HEX = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
BLOCK0_HEX = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
TOKENS_0_15 = ",".join(map(str, range(16)))


def test_stdin_comma_list_prints_known_answer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`echo 0,1,...,15 | tierd hash` prints NONE_HASH and vLLM's block-0 hash."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(TOKENS_0_15 + "\n"))
    assert main(["hash"]) == 0
    out = capsys.readouterr().out
    assert f"none_hash   {NONE_HASH_HEX}" in out
    assert f"block 0     {BLOCK0_HEX}  tokens 0..15" in out
    assert "partial" not in out


def test_console_process_reads_stdin() -> None:
    """The same through a real `python -m tierd.cli hash` process fed on standard input."""
    done = subprocess.run(
        [sys.executable, "-m", "tierd.cli", "hash"],
        input=TOKENS_0_15 + ",16,17\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert BLOCK0_HEX in done.stdout
    assert "(2 trailing tokens form a partial block: never hashed)" in done.stdout


def test_json_argument_and_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    """A JSON array argument with --json gives every figure, hashes as hex."""
    tokens = list(range(40))
    flags = ["--json", "--cache-salt", "t", "--lora-name", "l", "--lora-path", "/l"]
    assert main(["hash", json.dumps(tokens), *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = block_hashes(tokens, cache_salt="t", lora_name="l", lora_path="/l")
    assert [b["hash"] for b in report["blocks"]] == [h.hex() for h in expected]
    assert [b["extra_keys"] for b in report["blocks"]] == [
        [["lora", "l", "/l"], ["cache_salt", "t"]],
        [["lora", "l", "/l"]],
    ]
    assert [b["event_extra_keys"] for b in report["blocks"]] == [["l", "t"], ["l"]]
    assert (report["lora_path"], report["vllm_hash_contract"]) == ("/l", "0.33")
    assert [(b["start"], b["end"]) for b in report["blocks"]] == [(0, 16), (16, 32)]
    assert report["none_hash"] == NONE_HASH_HEX
    assert (report["num_tokens"], report["unhashed_tokens"]) == (40, 8)
    assert (report["seed"], report["algo"], report["block_size"]) == (
        "vllm-none-hash",
        "sha256_cbor",
        16,
    )


def test_flags_reach_the_hash(capsys: pytest.CaptureFixture[str]) -> None:
    """--block-size, --algo and --seed give what the library gives for the same choices."""
    tokens = list(range(24))
    args = ["hash", "0 1 2 3 4 5 6 7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23", "--json"]
    assert main([*args, "--block-size", "8", "--algo", "xxhash_cbor", "--seed", "42"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = block_hashes(tokens, 8, algo="xxhash_cbor", seed="42")
    assert [b["hash"] for b in report["blocks"]] == [h.hex() for h in expected]


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        ("1,x", "give integers like 1,2,3"),
        ("[1.5]", "array of integers"),
        ("[true]", "array of integers"),
        ("[1, 2", "valid JSON"),
        ('{"a": 1}', "array of integers"),
        ("1,-2", "[0, 4294967295]"),
        ("4294967296", "[0, 4294967295]"),
        ("", "no token ids given"),
    ],
)
def test_bad_input_exits_2_with_the_fix(
    text: str, fix: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Malformed or out-of-range token lists exit 2 with one line that says what to change."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["hash"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierd hash: error: ")
    assert fix in err


def test_unsupported_block_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--block-size 12 is refused by the parser, listing the allowed sizes."""
    with pytest.raises(SystemExit) as info:
        main(["hash", "1,2", "--block-size", "12"])
    assert info.value.code == 2
    assert "choose from 8, 16, 32, 64, 128" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--lora-name", "l"], ["--lora-path", "/l"]])
def test_lora_flags_come_as_a_pair(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--lora-name without --lora-path (or the reverse) exits 2: vLLM 0.33 hashes both."""
    assert main(["hash", TOKENS_0_15, *flags]) == 2
    err = capsys.readouterr().err
    assert "give --lora-name and --lora-path together" in err and "vLLM 0.33" in err


def test_help_names_the_vllm_contract(capsys: pytest.CaptureFixture[str]) -> None:
    """`tierd hash --help` says which vLLM release's hash contract it prints."""
    with pytest.raises(SystemExit):
        main(["hash", "--help"])
    out = capsys.readouterr().out
    assert "vLLM 0.33" in out and "--lora-path" in out


def test_model_flag_prints_each_checkpoints_id(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--model DIR` prints the folder's model id (two same-shape folders with other weights:
    two ids; the chain is the same); a badly spelled id exits 2 naming model_id."""
    from pathlib import Path

    ids = []
    for name, seed in (("base", 1), ("tuned", 2)):
        folder = Path(str(tmp_path)) / name
        folder.mkdir()
        (folder / "config.json").write_text('{"torch_dtype": "bfloat16", "hidden_size": 64}')
        (folder / "pytorch_model.bin").write_bytes(bytes([seed]) * 100_000)
        assert main(["hash", TOKENS_0_15, "--model", str(folder), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["blocks"][0]["hash"] == BLOCK0_HEX
        ids.append(out["model_id"])
    assert ids[0].startswith("base@") and ids[1].startswith("tuned@")
    assert ids[0].split("@")[1] != ids[1].split("@")[1]
    assert main(["hash", TOKENS_0_15, "--model", "llama@1"]) == 0
    assert "model_id    llama@1  (model_id override)" in capsys.readouterr().out
    assert main(["hash", TOKENS_0_15, "--model", "not an id"]) == 2
    assert "model_id must be" in capsys.readouterr().err
