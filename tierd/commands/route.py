"""`tierd route`: rank the cluster's nodes for a prompt by the prefix they hold, from Redis or
through a daemon's ``Locate`` RPC.

    tierd route --tokens 0,1,2,...,63 --tenant acme --model /models/Llama-3-8B --num-layers 32 \\
        --num-kv-heads 8 --head-size 128 --dtype bfloat16 --kv-format vllm-hnc-v1 \\
        --redis-url redis://redis:6379/0
    tierd route --hashes dc918a88...,7f3a... --namespace 0123456789abcdef0123456789abcdef --json
    tierd route --tokens - --model Llama-3-8B@3f2a9c1b7d6e5f40 --num-layers 32 --num-kv-heads 8 \\
        --head-size 128 --socket-path /run/tierd/tierd.sock

The chain comes from token ids (hashed like vLLM 0.33: ``--block-size``, ``--hash-algo``,
``--cache-salt``, ``--lora-name`` with ``--lora-path``) or from hex block hashes; the namespace
from a tenant, the model (``--model``: a checkpoint folder, or the model id an engine logs and
``tierd stats`` lists) and the engine's layout fields, or as 32 hex digits. Nodes are ranked
per model: another model's copy of the same prompt is never counted. One Redis round trip (the
directory's locate script); a Redis that cannot be reached exits 1 with the URL and the fix.

With ``--socket-path`` (or ``--address`` and ``--token``) the daemon asks its own Redis. The tenant
is then the connection's (the token's, or the daemon's default tenant), never ``--tenant``, and
the layout fields are required: a caller cannot name another tenant's namespace.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tierd import hashing
from tierd.commands.flags import add_socket_path
from tierd.types import BlockHash, Namespace

if TYPE_CHECKING:
    from tierd.wire.layout import Layout

HELP = "Rank cluster nodes by the prefix of a prompt they hold (asks Redis, or a daemon)."


def configure(parser: argparse.ArgumentParser) -> None:
    chain = parser.add_mutually_exclusive_group(required=True)
    chain.add_argument("--tokens", metavar="IDS",
                       help="token ids as a JSON array or comma list ('-': standard input)")
    chain.add_argument("--hashes", metavar="HEX,...",
                       help="block hashes in chain order, hex, comma separated")
    parser.add_argument("--block-size", type=int, default=16, choices=hashing.BLOCK_SIZES,
                        help="tokens per block (hashing and layout; default 16)")
    parser.add_argument("--hash-algo", default="sha256_cbor", choices=hashing.HASH_ALGOS,
                        help="the engines' prefix-caching hash (default sha256_cbor)")
    parser.add_argument("--seed", default=None, help="NONE_HASH seed (vLLM's PYTHONHASHSEED)")
    parser.add_argument("--cache-salt", default=None, help="per-request salt of block 0")
    parser.add_argument("--lora-name", default=None, help="LoRA adapter name (needs --lora-path)")
    parser.add_argument("--lora-path", default=None,
                        help="LoRA adapter path as vLLM was given it (vLLM "
                             f"{hashing.VLLM_HASH_CONTRACT} hashes name and path)")
    parser.add_argument("--namespace", metavar="HEX",
                        help="the 16-byte namespace as 32 hex digits (instead of the fields below)")
    parser.add_argument("--tenant", default="default", help="tenant name (default 'default')")
    parser.add_argument("--model", metavar="DIR_OR_ID",
                        help="the engines' model: a checkpoint folder (fingerprinted as an engine "
                             "running it with its config's dtype does) or a model id as "
                             "`tierd stats` lists it")
    parser.add_argument("--kv-format", default="",
                        help="layout: slot byte order ('vllm-hnc-v1' for vLLM engines; default "
                             "'': the reference engine)")
    parser.add_argument("--num-layers", type=int, help="layout: layers")
    parser.add_argument("--num-kv-heads", type=int, help="layout: KV heads of this TP rank")
    parser.add_argument("--head-size", type=int, help="layout: head size")
    parser.add_argument("--dtype", default="bfloat16",
                        help="layout: KV dtype (float16, bfloat16, float32, fp8_e4m3, fp8_e5m2)")
    parser.add_argument("--tp-rank", type=int, default=0, help="layout: tensor-parallel rank")
    parser.add_argument("--tp-size", type=int, default=1, help="layout: tensor-parallel size")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="the cluster's Redis (default redis://127.0.0.1:6379/0)")
    parser.add_argument("--key-prefix", default="tierd:", help="directory key prefix")
    parser.add_argument("--timeout", type=float, default=2.0, help="Redis timeout, seconds")
    add_socket_path(parser, "ask the daemon on this Unix socket (Locate) instead of Redis")
    parser.add_argument("--address", metavar="HOST:PORT", default=None,
                        help="ask the daemon at this TCP address (needs --token)")
    parser.add_argument("--token", default=None, help="bearer token for the daemon (its tenant)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parse_hashes(text: str) -> list[BlockHash]:
    """Hex block hashes, comma or space separated; each 16 or 32 bytes."""
    out = []
    for part in text.replace(",", " ").split():
        try:
            raw = bytes.fromhex(part)
        except ValueError:
            raw = b""
        if len(raw) not in (16, 32):
            raise ValueError(f"block hash {part!r} is not 32 or 64 hex digits")
        out.append(BlockHash(raw))
    if not out:
        raise ValueError("no block hashes given; pass --hashes HEX,HEX or --tokens")
    return out


def resolve_layout(args: argparse.Namespace) -> Layout:
    """The engine layout from the layout flags (``ValueError`` naming the missing ones)."""
    from tierd.model_identity import identity_of_argument
    from tierd.wire.layout import Layout

    missing = [f"--{n.replace('_', '-')}" for n in ("model", "num_layers", "num_kv_heads",
                                                     "head_size") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"give --namespace HEX, or the model and engine layout: missing "
                         f"{', '.join(missing)}")
    return Layout(args.num_layers, args.num_kv_heads, args.head_size, args.dtype,
                  args.block_size, args.tp_rank, args.tp_size, kv_format=args.kv_format,
                  model_id=identity_of_argument(args.model).model_id)


def resolve_namespace(args: argparse.Namespace) -> Namespace:
    """The namespace from ``--namespace`` hex, or from the tenant and the layout fields."""
    from tierd.wire.layout import NAMESPACE_LEN, namespace_for

    if args.namespace is not None:
        try:
            raw = bytes.fromhex(args.namespace)
        except ValueError:
            raw = b""
        if len(raw) != NAMESPACE_LEN:
            raise ValueError(f"--namespace must be {2 * NAMESPACE_LEN} hex digits, "
                             f"got {args.namespace!r}")
        return Namespace(raw)
    return namespace_for(args.tenant, resolve_layout(args))


def chain_of(args: argparse.Namespace) -> list[BlockHash]:
    if args.hashes is not None:
        return parse_hashes(args.hashes)
    from tierd.commands.hash import check_lora, parse_tokens

    text = sys.stdin.read() if args.tokens == "-" else args.tokens
    check_lora(args.lora_name, args.lora_path)
    chain = hashing.block_hashes(parse_tokens(text), args.block_size, algo=args.hash_algo,
                                 seed=args.seed, cache_salt=args.cache_salt,
                                 lora_name=args.lora_name, lora_path=args.lora_path)
    if not chain:
        raise ValueError(f"fewer tokens than one block ({args.block_size}): nothing to route")
    return chain


def _summary(tiers: Sequence[str]) -> str:
    runs: list[list[Any]] = []
    for tier in tiers:
        if runs and runs[-1][0] == tier:
            runs[-1][1] += 1
        else:
            runs.append([tier, 1])
    return " ".join(f"{tier}x{n}" for tier, n in runs)


def _via_daemon(args: argparse.Namespace, chain: list[BlockHash]) -> tuple[int, list[Any]]:
    """Ask a daemon's Locate: (exit status, placements); errors printed with their fix."""
    import grpc

    from tierd.wire.client import TierdClient

    if args.namespace is not None:
        raise ValueError("--namespace cannot be used with a daemon (it takes the tenant from "
                         "the connection): give the layout flags instead")
    layout = resolve_layout(args)
    where = args.address or args.socket
    try:
        with TierdClient(socket_path=args.socket, address=args.address, token=args.token,
                         timeout=args.timeout) as client:
            located = client.locate(None, chain, layout=layout)
    except grpc.RpcError as exc:
        hint = ("start tierd serve, or pass --socket-path PATH"
                if exc.code() == grpc.StatusCode.UNAVAILABLE else exc.details())
        print(f"tierd route: error: daemon at {where}: {exc.code().name}: {hint}",
              file=sys.stderr)
        return 1, []
    if located.stale:
        print(f"tierd route: error: the daemon at {where} cannot reach its Redis right now "
              "(directory stale); retry, or check its redis_url", file=sys.stderr)
        return 1, []
    return 0, located.nodes


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from tierd.cluster.directory import Directory, DirectoryConfig

    logging.getLogger("tierd.cluster").setLevel(logging.ERROR)   # the error below says it all

    chain = chain_of(args)
    if args.socket is not None or args.address is not None:
        status, placements = _via_daemon(args, chain)
        return status or _print(args, None, chain, placements)
    namespace = resolve_namespace(args)

    async def locate() -> tuple[bool, str, list[Any]]:
        directory = Directory(DirectoryConfig(redis_url=args.redis_url,
                                              key_prefix=args.key_prefix,
                                              timeout_s=args.timeout))
        try:
            if not await directory.probe():
                return False, directory.last_error, []
            placements = await directory.locate(namespace, chain)
            return not directory.stale, directory.last_error, placements
        finally:
            await directory.close()

    ok, error, placements = asyncio.run(locate())
    if not ok:
        print(f"tierd route: error: cannot reach Redis at {args.redis_url} ({error}); start "
              "Redis or pass --redis-url redis://HOST:PORT/DB", file=sys.stderr)
        return 1
    return _print(args, namespace, chain, placements)


def _print(args: argparse.Namespace, namespace: Namespace | None, chain: list[BlockHash],
           placements: list[Any]) -> int:
    """The ranking as JSON or a table (``namespace`` None: the daemon resolved it)."""
    shown = namespace.hex() if namespace is not None else "of the daemon's tenant"
    if args.json:
        print(json.dumps({"namespace": namespace.hex() if namespace is not None else None,
                          "chain_blocks": len(chain),
                          "nodes": [{"node_id": p.node_id, "address": p.address,
                                     "prefix_blocks": p.prefix_blocks, "tiers": list(p.tiers),
                                     "score": p.score, "capacity_bytes": p.capacity_bytes,
                                     "heartbeat_age_s": p.heartbeat_age_s}
                                    for p in placements]}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(chain)}-block chain in namespace {shown}")
    for column in ("rank", "node", "address", "prefix", "tiers", "score", "heartbeat"):
        table.add_column(column, justify="right" if column in ("rank", "prefix", "score")
                         else "left")
    for rank, p in enumerate(placements, 1):
        table.add_row(str(rank), p.node_id, p.address, f"{p.prefix_blocks}/{len(chain)}",
                      _summary(p.tiers), f"{p.score:.2f}", f"{p.heartbeat_age_s:.1f}s ago")
    console = Console()
    console.print(table)
    if not placements:
        console.print("no live node holds the first block: any node will do (a full miss)")
    return 0
