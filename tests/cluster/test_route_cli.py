"""`tierd route` against a real redis-server: ranks the nodes a test published."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import TYPE_CHECKING

import pytest

from tierd import hashing
from tierd.cluster.directory import Directory, DirectoryConfig, NodeRecord
from tierd.cluster.publisher import Publisher, PublisherConfig
from tierd.commands import route
from tierd.types import make_key
from tierd.wire.layout import Layout, namespace_for

if TYPE_CHECKING:
    from conftest import RedisServer

TOKENS = list(range(64))                # four 16-token blocks
LAYOUT = Layout(2, 2, 64, "bfloat16", 16, model_id="route-model@0")
LAYOUT_FLAGS = ["--model", "route-model@0", "--num-layers", "2", "--num-kv-heads", "2",
                "--head-size", "64"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    route.configure(parser)
    return parser.parse_args(list(argv))


async def publish(url: str, node_id: str, blocks: int) -> None:
    chain = hashing.block_hashes(TOKENS, 16)
    namespace = namespace_for("acme", LAYOUT)
    pub = Publisher(Directory(DirectoryConfig(redis_url=url)),
                    PublisherConfig(NodeRecord(node_id, f"{node_id}:50051")))
    pub.stored([make_key(namespace, h) for h in chain[:blocks]], "dram")
    assert await pub.step()
    await pub.directory.close()


def test_route_ranks_nodes_from_tokens(redis_server: RedisServer,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Node a holds 3 of the prompt's 4 blocks, b holds 1: JSON ranks a then b; another
    tenant's view of the same tokens finds nobody, and so does another model's (same shape)."""
    asyncio.run(publish(redis_server.url, "a", 3))
    asyncio.run(publish(redis_server.url, "b", 1))
    tokens = ",".join(map(str, TOKENS))
    assert route.run(parse("--tokens", tokens, "--tenant", "acme", *LAYOUT_FLAGS,
                           "--redis-url", redis_server.url, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["namespace"] == namespace_for("acme", LAYOUT).hex()
    assert [(n["node_id"], n["prefix_blocks"], n["tiers"], n["score"]) for n in out["nodes"]] == [
        ("a", 3, ["dram"] * 3, 2.4), ("b", 1, ["dram"], 0.8)]
    assert route.run(parse("--tokens", tokens, "--tenant", "other", *LAYOUT_FLAGS,
                           "--redis-url", redis_server.url, "--json")) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == []
    assert route.run(parse("--tokens", tokens, "--tenant", "acme", *LAYOUT_FLAGS,
                           "--model", "route-model-finetune@1", "--redis-url", redis_server.url,
                           "--json")) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == []


def test_route_from_hex_hashes_and_namespace(redis_server: RedisServer,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The same chain given as hex hashes and a hex namespace finds node a's 2-block prefix."""
    asyncio.run(publish(redis_server.url, "a", 2))
    hexes = ",".join(h.hex() for h in hashing.block_hashes(TOKENS, 16))
    assert route.run(parse("--hashes", hexes, "--namespace", namespace_for("acme", LAYOUT).hex(),
                           "--redis-url", redis_server.url)) == 0
    assert "2/4" in capsys.readouterr().out


def test_route_unreachable_redis_names_the_fix(redis_server: RedisServer,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A stopped Redis exits 1 with the URL and the --redis-url fix; bad input is ValueError."""
    redis_server.stop()
    assert route.run(parse("--hashes", "00" * 32, "--namespace", "00" * 16,
                           "--redis-url", redis_server.url, "--timeout", "0.5")) == 1
    err = capsys.readouterr().err
    assert f"cannot reach Redis at {redis_server.url}" in err and "--redis-url" in err
    with pytest.raises(ValueError, match="missing --model, --num-layers"):
        route.run(parse("--hashes", "00" * 32, "--redis-url", redis_server.url))
    with pytest.raises(ValueError, match="32 or 64 hex digits"):
        route.run(parse("--hashes", "abc", "--namespace", "00" * 16))


def test_route_chain_hashes_lora_name_and_path() -> None:
    """--lora-name with --lora-path hashes vLLM 0.33's ("lora", name, path); a name alone is
    refused with the fix."""
    tokens = ",".join(map(str, TOKENS))
    args = parse("--tokens", tokens, "--lora-name", "l", "--lora-path", "/l", "--cache-salt", "s")
    assert route.chain_of(args) == hashing.block_hashes(TOKENS, 16, lora_name="l",
                                                        lora_path="/l", cache_salt="s")
    with pytest.raises(ValueError, match="--lora-path together"):
        route.chain_of(parse("--tokens", tokens, "--lora-name", "l"))
