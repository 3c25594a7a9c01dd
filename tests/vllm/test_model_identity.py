"""Model identity inside real vLLM 0.33: engines share blocks only when they run the same
weights. Two model folders with identical config.json but other weight files, one folder twice,
weights rewritten in place between two engines, the model_id override, LoRA adapters on one base
(vLLM's own hasher) and `tierd hash --model` agreeing with the connector."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs real vLLM: run `make test-vllm`")

from harness import (  # noqa: E402
    BLOCK,
    EOS,
    Daemon,
    Engine,
    engine_layout,
    make_request,
    model_dir_in,
    vllm_config,
    write_weights,
)
from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = [(i * 53 + 5) % 997 for i in range(6 * BLOCK + 3)]  # 6 full blocks and a tail


def store_then_load(first_dir: str, second_dir: str, daemon: Daemon,
                    extra: dict[str, Any] | None = None,
                    between: Any = None) -> tuple[int, int]:
    """An engine on ``first_dir`` stores PROMPT; then (after ``between()``) a fresh engine on
    ``second_dir`` runs it: (blocks the second loaded, blocks it saved)."""
    first = Engine.start(vllm_config(first_dir, daemon.socket_path, extra=extra))
    try:
        first.run([make_request("a", PROMPT)])
        assert first.worker.worker_counters.data["saved_blocks"] == 6
    finally:
        first.close()
    if between is not None:
        between()
    second = Engine.start(vllm_config(second_dir, daemon.socket_path, extra=extra))
    try:
        second.run([make_request("b", PROMPT)])
        counters = second.worker.worker_counters.data
        assert second.invalid_reported == set()
        return counters["loaded_blocks"], counters["saved_blocks"]
    finally:
        second.close()


def model_rows(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        return {m.model_id: m for m in client.stats().models}


def test_same_config_other_weights_share_nothing(tmp_path: Any, daemon: Daemon) -> None:
    """Two folders with byte-identical config.json, other weight files: the second engine loads
    0 blocks and stores its own 6; `tierd stats` shows two models of 6 DRAM blocks each."""
    base = model_dir_in(str(tmp_path), "base", seed=1)
    tuned = model_dir_in(str(tmp_path), "tuned", seed=2)
    with open(os.path.join(base, "config.json")) as a, open(os.path.join(tuned,
                                                                         "config.json")) as b:
        assert a.read() == b.read()
    assert store_then_load(base, tuned, daemon) == (0, 6)
    rows = model_rows(daemon)
    assert sorted(m.blocks["dram"] for m in rows.values()) == [6, 6]
    assert sorted(k.split("@")[0] for k in rows) == ["base", "tuned"]
    assert daemon.pinned_blocks() == 0


def test_one_folder_twice_and_a_copy_share(tmp_path: Any, daemon: Daemon) -> None:
    """The same folder in two engines: all 6 blocks load. A copy of it on another disk under
    the same name (the same bytes, the same served name): they load too. A copy under another
    name is another model id (label@digest) until the operator says otherwise (model_id)."""
    base = model_dir_in(str(tmp_path), "base", seed=1)
    assert store_then_load(base, base, daemon) == (6, 0)
    for name, loaded in (("elsewhere/base", 6), ("renamed", 0)):
        copy = str(tmp_path / name)
        shutil.copytree(base, copy)
        second = Engine.start(vllm_config(copy, daemon.socket_path))
        try:
            second.run([make_request(name, PROMPT)])
            assert second.worker.worker_counters.data["loaded_blocks"] == loaded
        finally:
            second.close()


def test_weights_rewritten_in_place_share_nothing(tmp_path: Any, daemon: Daemon) -> None:
    """A model upgrade at the same path (new weights, same file names and shapes) between two
    engines: the second engine loads 0 of the old weights' blocks. The same holds across a
    daemon restart that keeps the SSD tier (the old blocks stay on disk, never served)."""
    path = model_dir_in(str(tmp_path), "served", seed=1)
    assert store_then_load(path, path, daemon,
                           between=lambda: write_weights(path, seed=5)) == (0, 6)


def test_model_id_override_shares_on_purpose(tmp_path: Any, daemon: Daemon) -> None:
    """Both engines set the same model_id: other weights, yet all 6 blocks load (what the
    operator asked for; docs/vllm.md warns a wrong value serves wrong KV). A bad id is refused
    at start-up with the fix."""
    base = model_dir_in(str(tmp_path), "base", seed=1)
    tuned = model_dir_in(str(tmp_path), "tuned", seed=2)
    assert store_then_load(base, tuned, daemon, extra={"model_id": "fleet-llama@v7"}) == (6, 0)
    assert list(model_rows(daemon)) == ["fleet-llama@v7"]
    with pytest.raises(ValueError, match="model_id must be"):
        Engine.start(vllm_config(base, daemon.socket_path, extra={"model_id": "no spaces"}))


def test_no_weight_files_names_the_fix(tmp_path: Any, daemon: Daemon) -> None:
    """A folder with only config.json (and no --load-format dummy): the connector refuses to
    guess, naming model_id; with --load-format dummy it keys by config and seed."""
    path = model_dir_in(str(tmp_path), "bare")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="model_id"):
        Engine.start(vllm_config(path, daemon.socket_path))
    config = vllm_config(path, daemon.socket_path)
    config.load_config.load_format = "dummy"
    assert engine_layout(config).model_id.startswith("bare@")


def test_lora_adapters_on_one_base_never_share_a_key() -> None:
    """vLLM's own block hasher: the same prompt with adapter A, adapter B and no adapter gives
    three disjoint chains, so tierd (one namespace per base model) never hands one adapter's
    block to another."""
    def hashes(lora: LoRARequest | None) -> set[bytes]:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        params.update_from_generation_config({}, EOS)
        request = Request(request_id="r", prompt_token_ids=list(PROMPT), sampling_params=params,
                          pooling_params=None, mm_features=None, lora_request=lora,
                          block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))
        return set(request.block_hashes)

    a, b = LoRARequest("sql", 1, "/adapters/sql"), LoRARequest("chat", 2, "/adapters/chat")
    chains = [hashes(a), hashes(b), hashes(None)]
    assert all(len(c) == 6 for c in chains)
    assert not (chains[0] & chains[1]) and not (chains[0] & chains[2])
    assert not (chains[1] & chains[2])


def test_tierd_hash_model_agrees_with_the_connector(tmp_path: Any,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`tierd hash --model DIR --json` prints the model id the connector derives for DIR (vLLM
    running it with its config's dtype)."""
    from tierd.commands import hash as hash_cmd

    path = model_dir_in(str(tmp_path), "tiny-llama", seed=3)
    parser = argparse.ArgumentParser()
    hash_cmd.configure(parser)
    assert hash_cmd.run(parser.parse_args(["0,1", "--model", path, "--json"])) == 0
    printed = json.loads(capsys.readouterr().out)["model_id"]
    assert printed == engine_layout(vllm_config(path, "/nonexistent.sock")).model_id
