"""`tierd why`: where a prompt's blocks live on this node and why the first missing one misses.

    tierd why 0,1,2,...,4095 --model /models/Llama-3-8B --num-layers 32 --num-kv-heads 8 \\
        --head-size 128 --dtype bfloat16 --kv-format vllm-hnc-v1
    cat prompt.json | tierd why --model Llama-3-8B@3f2a9c1b7d6e5f40 --num-layers 32 \\
        --num-kv-heads 8 --head-size 128 --cache-salt acme --json

The prompt is hashed with the engine's settings as `tierd hash` takes them (``--block-size``,
``--algo``, ``--seed``, ``--cache-salt``, ``--lora-name`` with ``--lora-path``); the namespace is
the connection's tenant (the daemon's default tenant, or ``--token``'s) with the model and the
layout flags of `tierd route`. The daemon (``Why``) answers block by block: which of the tenant's
engines report it in HBM, DRAM, SSD. At the first block that misses it says why:

- a partial block (the prompt's last tokens fill no block: never stored);
- evicted: when, from which tier, under which pressure (the daemon's ghost list of recent
  evictions; one evicted long ago reads as never stored);
- stored under another namespace of the same tenant: the same tokens are held with another
  model id or layout field, or hashed with another algorithm, seed, cache salt, block size or
  without the LoRA adapter (this command hashes the prompt each of those ways and the daemon
  searches the tenant's namespaces for them), naming each field that differs;
- never stored: with nothing stored under the namespace at all, the engine stores nothing for
  this tenant and layout (its connector is not saving, or saves elsewhere).

On a cluster node the answer also lists the nodes that hold a prefix of the prompt (the cluster
directory's ``Locate``, the remote tier included), and a miss that another node would have hit
says so. Another tenant's blocks are never searched or named. ``--json`` prints one object for
scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from tierd import hashing
from tierd.commands.flags import add_socket_path

if TYPE_CHECKING:
    from tierd.daemon.why import Variant, WhyAnswer
    from tierd.types import BlockHash
    from tierd.wire.client import TierdClient
    from tierd.wire.layout import Layout

HELP = "Explain where a prompt's blocks live on this node and why the first missing one misses."

MAX_BLOCKS = 4096
"""Blocks of each chain asked about (the daemon's default max_blocks_per_request)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tokens", nargs="?", default="-",
                        help="token ids as a JSON array or a comma list; omitted or '-': read "
                             "standard input")
    parser.add_argument("--block-size", type=int, default=16, choices=hashing.BLOCK_SIZES,
                        help="tokens per block, as vLLM's --block-size (default 16)")
    parser.add_argument("--algo", default="sha256_cbor", choices=hashing.HASH_ALGOS,
                        help="the engine's prefix-caching hash (default sha256_cbor)")
    parser.add_argument("--seed", default=None,
                        help="NONE_HASH seed (vLLM's PYTHONHASHSEED; default 'vllm-none-hash')")
    parser.add_argument("--cache-salt", default=None, help="per-request salt of block 0")
    parser.add_argument("--lora-name", default=None, help="LoRA adapter name (needs --lora-path)")
    parser.add_argument("--lora-path", default=None,
                        help="LoRA adapter path as vLLM was given it (LoRARequest.lora_path)")
    parser.add_argument("--model", metavar="DIR_OR_ID",
                        help="the engine's model: a checkpoint folder or a model id as "
                             "`tierd stats` lists it (required)")
    parser.add_argument("--num-layers", type=int, help="layout: layers (required)")
    parser.add_argument("--num-kv-heads", type=int,
                        help="layout: KV heads of this TP rank (required)")
    parser.add_argument("--head-size", type=int, help="layout: head size (required)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="layout: KV dtype (float16, bfloat16, float32, fp8_e4m3, fp8_e5m2)")
    parser.add_argument("--kv-format", default="",
                        help="layout: slot byte order ('vllm-hnc-v1' for vLLM engines; default "
                             "'': the reference engine)")
    parser.add_argument("--tp-rank", type=int, default=0, help="layout: tensor-parallel rank")
    parser.add_argument("--tp-size", type=int, default=1, help="layout: tensor-parallel size")
    add_socket_path(parser, "Daemon Unix socket (default: $TIERD_SOCKET_PATH, else the default "
                            "socket of `tierd serve`).")
    parser.add_argument("--address", metavar="HOST:PORT", default=None,
                        help="reach the daemon over TCP instead (needs --token)")
    parser.add_argument("--token", default=None,
                        help="bearer token from the daemon's token file (selects the tenant)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def variants_of(tokens: list[int], args: argparse.Namespace, *, covering: int | None = None,
                only: Collection[str] | None = None) -> list[Variant]:
    """The prompt hashed with each setting changed that an engine commonly gets different:
    the other hash algorithm, the default seed and seed 0, no cache salt, no LoRA, every
    other block size (one setting at a time, each chain at most ``MAX_BLOCKS`` blocks).
    ``covering``: each chain only as many blocks as cover that many leading tokens (a probe);
    ``only``: just the variants whose ``differs`` is in it."""
    from tierd.daemon.why import Variant

    base: dict[str, Any] = dict(block_size=args.block_size, algo=args.algo, seed=args.seed,
                                cache_salt=args.cache_salt, lora_name=args.lora_name,
                                lora_path=args.lora_path)
    changes: list[tuple[str, dict[str, Any]]] = [
        (f"algo {a}", {"algo": a}) for a in hashing.HASH_ALGOS if a != args.algo]
    if args.seed is not None:
        changes.append((f"seed default ({hashing.DEFAULT_SEED})", {"seed": None}))
    if args.seed != "0":
        changes.append(("seed 0", {"seed": "0"}))
    if args.cache_salt is not None:
        changes.append(("no cache_salt", {"cache_salt": None}))
    if args.lora_name is not None:
        changes.append(("no LoRA", {"lora_name": None, "lora_path": None}))
    changes += [(f"block_size {b}", {"block_size": b}) for b in hashing.BLOCK_SIZES
                if b != args.block_size]
    quiet = logging.getLogger("tierd.hashing")
    level, quiet.level = quiet.level, logging.ERROR  # the xxhash warning is not the user's
    try:
        out = []
        for differs, change in changes:
            if only is not None and differs not in only:
                continue
            settings = base | change
            size = settings.pop("block_size")
            end = MAX_BLOCKS * size if covering is None else min(
                MAX_BLOCKS * size, -(-covering // size) * size)
            chain = hashing.block_hashes(tokens[:end], size, **settings)
            out.append(Variant(differs, size, chain))
        return out
    finally:
        quiet.level = level


def run(args: argparse.Namespace) -> int:
    import grpc

    from tierd.commands.hash import check_lora, parse_tokens
    from tierd.commands.route import resolve_layout
    from tierd.wire.client import TierdClient

    tokens = parse_tokens(sys.stdin.read() if args.tokens == "-" else args.tokens)
    check_lora(args.lora_name, args.lora_path)
    layout = resolve_layout(args)
    size = args.block_size
    if len(tokens) > MAX_BLOCKS * size:
        raise ValueError(f"{len(tokens)} tokens is over {MAX_BLOCKS} blocks of {size}: ask about "
                         "the first part of the prompt")
    chain = hashing.block_hashes(tokens, size, algo=args.algo, seed=args.seed,
                                 cache_salt=args.cache_salt, lora_name=args.lora_name,
                                 lora_path=args.lora_path)
    try:
        with TierdClient(socket_path=args.socket, address=args.address, token=args.token,
                         timeout=10.0) as client:
            answer = client.why(layout, chain)
            if answer.first_miss < len(chain):  # search the tenant's other namespaces too
                answer = _with_variants(client, layout, chain, tokens, args, answer)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            print("tierd why: no daemon answers: start one with `tierd serve`, or point at it "
                  "with --socket-path PATH (or --address HOST:PORT --token TOKEN)",
                  file=sys.stderr)
        else:
            print(f"tierd why: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    report = explain(answer, layout, len(tokens))
    if args.json:
        print(json.dumps(report))  # one line: the C encoder (indent would use the Python one)
    else:
        print_report(report)
    return 0


def _with_variants(client: TierdClient, layout: Layout, chain: list[BlockHash],
                   tokens: list[int], args: argparse.Namespace, answer: WhyAnswer) -> WhyAnswer:
    """``answer`` (a miss at ``first_miss``) with the prompt's other hashings searched too. A
    variant explains the miss only if it holds more tokens than the chain did, so each is
    first hashed just past them (a probe, with the chain cut there alike: one cheap Why);
    only the variants that hold that much are hashed whole and asked about with the whole
    chain, for their exact extent."""
    covering = answer.first_miss * layout.block_size + 1
    probes = variants_of(tokens, args, covering=covering)
    probed = client.why(layout, chain[:answer.first_miss + 1], probes)
    names = {v.differs for v in probes}
    found = {e.differs[0] for e in probed.elsewhere if e.differs and e.differs[0] in names}
    if not found:
        return answer
    return client.why(layout, chain, variants_of(tokens, args, only=found))


def explain(answer: WhyAnswer, layout: Layout, num_tokens: int) -> dict[str, Any]:
    """The ``--json`` object: each block's places, the first miss and its verdict."""
    size = layout.block_size
    blocks = [{"index": i, "tokens": [i * size, (i + 1) * size],
               "hbm_engines": list(b.hbm_engines), "dram": b.dram, "ssd": b.ssd}
              for i, b in enumerate(answer.blocks)]
    partial = num_tokens - len(answer.blocks) * size
    report: dict[str, Any] = {
        "model_id": layout.model_id, "block_size": size, "num_tokens": num_tokens,
        "hit_tokens": answer.first_miss * size, "partial_tokens": partial,
        "namespace_blocks": answer.namespace_blocks, "engines": answer.engines,
        "blocks": blocks, "first_miss": None, "verdict": "hit",
    }
    if answer.cluster:
        report["cluster_stale"] = answer.cluster_stale
        report["nodes"] = [{"node_id": p.node_id, "address": p.address,
                            "prefix_blocks": p.prefix_blocks, "tiers": list(p.tiers)}
                           for p in answer.nodes]
    if answer.first_miss == len(answer.blocks):
        if partial:
            report |= {"verdict": "partial_block", "reason": (
                f"every full block is held; the last {partial} tokens fill no block of {size} "
                "and are never stored (engines store full blocks only)")}
        else:
            report["reason"] = "every block of the prompt is held on this node"
        return report
    report["first_miss"] = answer.first_miss
    if answer.evicted is not None:
        e = answer.evicted
        report |= {"verdict": "evicted", "evicted": {
            "seconds_ago": e.seconds_ago, "idle_seconds": e.idle_seconds, "tier": e.tier,
            "pressure": e.pressure}, "reason": (
            f"block {answer.first_miss} was evicted {e.seconds_ago:.1f} s ago from {e.tier} "
            f"after {e.idle_seconds:.1f} s unused: {e.cause}")}
    elsewhere = [{"model_id": h.model_id, "differs": list(h.differs), "tokens": h.tokens}
                 for h in answer.elsewhere]
    report["elsewhere"] = elsewhere
    if answer.evicted is None and elsewhere:
        best = answer.elsewhere[0]
        report |= {"verdict": "other_namespace", "reason": (
            f"{best.tokens} tokens of this prompt are stored for this tenant with "
            f"{', '.join(best.differs)}: the engine's settings differ from the ones given here")}
    elif answer.evicted is None:
        report["verdict"] = "never_stored"
        if answer.namespace_blocks == 0:
            report["reason"] = (
                "nothing at all is stored under this tenant, model and layout: the engine "
                "stores nothing here (is its connector saving? does it use this daemon, token "
                "and layout?)")
        else:
            report["reason"] = (
                f"block {answer.first_miss} was never stored on this node (or left before the "
                "oldest eviction the daemon remembers)")
            if answer.ssd_min_hits:
                report["reason"] += (f"; blocks with fewer than ssd_min_hits "
                                     f"({answer.ssd_min_hits}) hits are never written to SSD")
    better = [p for p in answer.nodes if p.prefix_blocks > answer.first_miss]
    if better:
        report["reason"] += (f"; node {better[0].node_id} ({better[0].address}) holds "
                             f"{better[0].prefix_blocks} blocks of it: routing sent the prompt "
                             "elsewhere (tierd route)")
    return report


def print_report(report: dict[str, Any]) -> None:
    """The report as text: runs of blocks by place, then the verdict."""
    size = report["block_size"]
    print(f"{report['num_tokens']} tokens, {len(report['blocks'])} blocks of {size}, model "
          f"{report['model_id']}: {report['hit_tokens']} tokens held from the start")
    runs: list[tuple[str, int, int]] = []
    for b in report["blocks"]:
        place = "+".join([*(["hbm(" + ",".join(b["hbm_engines"]) + ")"] if b["hbm_engines"]
                            else []), *(["dram"] if b["dram"] else []),
                          *(["ssd"] if b["ssd"] else [])]) or "missing"
        if runs and runs[-1][0] == place:
            runs[-1] = (place, runs[-1][1], b["index"])
        else:
            runs.append((place, b["index"], b["index"]))
    for place, first, last in runs:
        span = f"block {first}" if first == last else f"blocks {first}-{last}"
        print(f"  {span:<16} tokens {first * size}..{(last + 1) * size - 1}  {place}")
    if report["partial_tokens"]:
        print(f"  partial block    {report['partial_tokens']} tokens: never stored")
    for node in report.get("nodes", []):
        print(f"  cluster: node {node['node_id']} holds {node['prefix_blocks']} blocks "
              f"({' '.join(node['tiers'])})")
    if report.get("cluster_stale"):
        print("  cluster: Redis could not be asked (the directory is stale)")
    print(f"verdict: {report['verdict']}: {report['reason']}")
    for other in report.get("elsewhere", [])[1:]:
        print(f"  also {other['tokens']} tokens with {', '.join(other['differs'])}")
