"""End to end: the reference engine's greedy tokens are identical whether a prefix was computed,
hit in the hot tier, loaded from DRAM, from SSD, or from SSD after a `tierd serve` kill -9 and
restart; tenants never share a prefix; a daemon killed mid-run changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import pytest
import torch

from tierd.bench.tierd_serve import TierdServe
from tierd.connector.reference.engine import EngineConfig, LLMEngine, Request
from tierd.connector.reference.model import LlamaModel, model_identity
from tierd.connector.reference.tierd_hooks import TierdHooks, TierdHooksConfig, layout_for
from tierd.wire.client import TierdClient

BS = 16
SYSTEM = 80  # a shared 5-block "system prompt"


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = torch.randint(0, 512, (n,), generator=gen).tolist()
    return tokens


def hooks_for(socket_path: str | None = None, **overrides: Any) -> TierdHooks:
    values: dict[str, Any] = dict(socket_path=socket_path, timeout_seconds=5.0,
                                  save_staging_bytes=2 << 20, load_staging_bytes=1 << 20,
                                  retry_seconds=0.05, retry_max_seconds=0.2)
    values.update(overrides)
    return TierdHooks(TierdHooksConfig(**values))


def engine_with(model: LlamaModel, hooks: TierdHooks | None, **overrides: Any) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"num_blocks": 64, "block_size": BS, **overrides}),
                     hooks)


def finish(engine: LLMEngine, requests: list[Request]) -> list[list[int]]:
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    return [r.output_token_ids for r in requests]


def chats() -> list[list[int]]:
    """Three users' first turns behind one shared system prompt."""
    system = prompt(SYSTEM, seed=100)
    return [system + prompt(20 + 7 * u, seed=200 + u) for u in range(3)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_identical_tokens_computed_hot_dram_ssd(tiny_model: LlamaModel, make_daemon: Any,
                                                kv_cache_dtype: str) -> None:
    """Three chats sharing 5 system blocks: computed (no tierd), hot-tier hits, loaded from DRAM
    into a fresh engine, then (after a maintain pass demotes all to SSD) loaded from SSD into
    another fresh engine: the same tokens each time."""
    daemon = make_daemon()
    prompts = chats()
    plain = engine_with(tiny_model, None, kv_cache_dtype=kv_cache_dtype)
    want = finish(plain, [plain.add_request(p, 8) for p in prompts])

    hooks = hooks_for(daemon.config.socket_path)
    hot = engine_with(tiny_model, hooks, kv_cache_dtype=kv_cache_dtype)
    first = hot.add_request(prompts[0], 8)
    assert finish(hot, [first]) == want[:1]
    rest = [hot.add_request(p, 8) for p in prompts[1:]]
    assert finish(hot, rest) == want[1:]
    assert [r.num_hot_hit_tokens for r in rest] == [SYSTEM, SYSTEM]
    assert hooks.flush()
    hooks.close()

    spec = hot.kv_cache.spec
    system_hashes = first.block_hashes[:SYSTEM // BS]
    with TierdClient(socket_path=daemon.config.socket_path) as client:
        probe = client.register_engine(layout_for(spec, model_identity(hot.model).model_id))
        assert client.lookup(probe.engine_id, system_hashes) == ["dram"] * 5
        for tier in ("dram", "ssd"):
            if tier == "ssd":
                daemon.maintain()
                assert client.lookup(probe.engine_id, system_hashes) == ["ssd"] * 5
            loader = hooks_for(daemon.config.socket_path)
            fresh = engine_with(tiny_model, loader, kv_cache_dtype=kv_cache_dtype)
            requests = [fresh.add_request(p, 8) for p in prompts]
            assert finish(fresh, requests) == want, f"tokens differ after a {tier} load"
            assert requests[0].num_loaded_tokens >= SYSTEM, f"{tier}: the prefix was not loaded"
            assert loader.stats.checksum_failures == 0
            assert loader.flush()
            loader.close()
            daemon.maintain()  # the next round starts from SSD only
    daemon.check_integrity()


def test_tenants_never_share_a_prefix(tiny_model: LlamaModel, make_daemon: Any,
                                      workdir: str) -> None:
    """Two bearer tokens over TCP: tenant B finds nothing of tenant A's prompt (0 blocks looked
    up, 0 loaded), tenant A's second engine loads 4 blocks; tokens identical throughout."""
    token_file = os.path.join(workdir, "tokens.toml")
    with open(token_file, "w") as f:
        f.write('"token-a" = "team-a"\n"token-b" = "team-b"\n')
    daemon = make_daemon(tcp_port=0, token_file=token_file)
    assert daemon.daemon is not None and daemon.daemon.tcp_port
    address = f"127.0.0.1:{daemon.daemon.tcp_port}"
    tokens = prompt(70, seed=7)
    saver = hooks_for(address=address, token="token-a")
    want = engine_with(tiny_model, saver).generate([tokens], 8)
    assert saver.flush() and saver.stats.saved_blocks == 4
    saver.close()
    for token, loaded in (("token-b", 0), ("token-a", 64)):
        hooks = hooks_for(address=address, token=token)
        engine = engine_with(tiny_model, hooks)
        request = engine.add_request(tokens, 8)
        assert finish(engine, [request]) == want
        assert request.num_loaded_tokens == loaded, token
        assert hooks.stats.lookup_hit_blocks == loaded // BS
        hooks.close()


# -- a real `tierd serve` process -------------------------------------------------------------

def serve(workdir: str) -> subprocess.Popen[bytes]:
    """`tierd serve` whose maintain pass (every 50 ms) demotes every committed block to SSD,
    answering on ``workdir/tierd.sock``."""
    return TierdServe(workdir, [
        "--dram-bytes", "16MiB", "--slab-bytes", "256KiB", "--arena-directory", workdir,
        "--no-prefault", "--ssd-dir", os.path.join(workdir, "ssd"), "--ssd-bytes", "4MiB",
        "--dram-high-watermark", "1e-9", "--dram-low-watermark", "1e-9",
        "--maintain-seconds", "0.05"]).start()


def wait_until(predicate: Any, what: str) -> None:
    """Poll ``predicate`` (a readiness wait, not a timing assertion) for up to 60 s."""
    for _ in range(1200):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def kill_9(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_ssd_load_after_kill_9_and_restart(tiny_model: LlamaModel, workdir: str,
                                           processes: list[subprocess.Popen[bytes]]) -> None:
    """Blocks written through reach SSD; `tierd serve` is killed with SIGKILL and restarted on
    the same SSD dir; a fresh engine loads the 4 blocks from SSD and generates identical tokens."""
    socket_path = os.path.join(workdir, "tierd.sock")
    tokens = prompt(70, seed=8)
    processes.append(serve(workdir))
    saver = hooks_for(socket_path)
    engine = engine_with(tiny_model, saver)
    assert saver.wait_connected(timeout=60)
    want = engine.generate([tokens], 8)[0]
    assert saver.flush() and saver.stats.saved_blocks == 4
    hashes = engine.add_request(tokens, 1).block_hashes[:4]
    with TierdClient(socket_path=socket_path) as client:
        probe = client.register_engine(layout_for(engine.kv_cache.spec,
                                                  model_identity(engine.model).model_id))
        wait_until(lambda: client.lookup(probe.engine_id, hashes) == ["ssd"] * 4, "demotion")
    saver.close()
    kill_9(processes[0])
    processes.append(serve(workdir))
    loader = hooks_for(socket_path)
    fresh = engine_with(tiny_model, loader)
    assert loader.wait_connected(timeout=60)
    request = fresh.add_request(tokens, 8)
    assert finish(fresh, [request]) == [want]
    assert (request.num_loaded_tokens, loader.stats.checksum_failures) == (64, 0)
    loader.close()


def test_daemon_killed_mid_run(tiny_model: LlamaModel, workdir: str,
                               processes: list[subprocess.Popen[bytes]]) -> None:
    """Four requests in flight when `tierd serve` is killed with SIGKILL: the engine finishes
    them with the same tokens as without tierd; after a restart the hooks reconnect."""
    socket_path = os.path.join(workdir, "tierd.sock")
    prompts = [prompt(40 + 9 * i, seed=30 + i) for i in range(4)]
    plain = engine_with(tiny_model, None, max_num_batched_tokens=32)
    want = finish(plain, [plain.add_request(p, 12) for p in prompts])
    processes.append(serve(workdir))
    hooks = hooks_for(socket_path)
    engine = engine_with(tiny_model, hooks, max_num_batched_tokens=32)
    assert hooks.wait_connected(timeout=60)
    requests = [engine.add_request(p, 12) for p in prompts]
    for _ in range(4):
        engine.step()
    kill_9(processes[0])
    assert finish(engine, requests) == want
    assert hooks.flush()  # the queued saves met the dead daemon
    assert not hooks.connected and hooks.stats.disconnects == 1
    processes.append(serve(workdir))
    assert hooks.wait_connected(timeout=60)
    assert hooks.stats.connects == 2
    hooks.close()
