"""`tierd bench tenants`: can a hostile tenant starve a well-behaved one under ``tenant_quotas``?

A real `tierd serve` (DRAM only, a token file of two tenants, ``tenant_quotas`` giving the
well-behaved tenant half the arena and the other one a quarter) runs four phases, each on a
fresh daemon, each with the well-behaved client paced at the same rate:

1. ``alone``: the well-behaved tenant only;
2. ``benign``: beside the other tenant behaving well at the same rate (a working set within its
   quota, every lease released): the cost of a second client's load alone, on these cores;
3. ``hostile``: beside the other tenant turned hostile: it abandons half its read leases (they
   pin until they expire), spams blank reservations it never commits, and stores a working set
   10x its quota;
4. ``no quotas``: phase 3 without ``tenant_quotas`` (context: what the quotas prevent).

The well-behaved client (a process, its own token) first stores its working set (40% of the
arena: within its share), then until the deadline loads a random chain of it at a fixed rate:
``Acquire`` (timed), a copy of every acquired block out of the arena, ``Release``; a block that
missed is stored again through blank slots (``Reserve(blank_slots)`` + copy + ``Commit`` with
names), as TierdTier stores.

Figures, each the hostile phase against the phase alone of the same run: the well-behaved
tenant's hit ratio (blocks acquired / blocks asked for; target >= 0.9 of alone's) and its p99
``Acquire`` latency (target <= 1.1x alone's; beside it, against the benign phase: the same
load without the hostility), and the daemon's RSS at the start and the end of the timed part
of the hostile phase (target: growth <= max(4 MiB, 5%)). ~100 s on 2 cores (``--seconds`` per
phase).
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from tierd.bench.soak import _layout, _quantile, _usage
from tierd.bench.tierd_serve import TierdServe

HELP = ("Two tenants, one hostile (abandoned leases, blank-slot spam, a working set 10x its "
        "quota): the well-behaved one's hit ratio and p99 Acquire vs running alone; RSS.")

CHAIN_BLOCKS = 8
WELL_SHARE, OTHER_SHARE = 0.5, 0.25     # of the arena, by tenant_quotas
WORKING_SET = {"well": 0.4, "benign": 0.2, "hostile": 2.5}  # of the arena (hostile: 10x quota)
TOKENS = {"well": "bench-token-well", "other": "bench-token-other"}  # tenant -> token


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="timed part of each phase, seconds (15)")
    parser.add_argument("--dram-bytes", default="64MiB", help="the daemon's arena (64MiB)")
    parser.add_argument("--block-kib", type=int, default=64, help="block size in KiB (64)")
    parser.add_argument("--rate", type=float, default=50.0,
                        help="loads per second of each client (50)")
    parser.add_argument("--lease-seconds", type=float, default=3.0,
                        help="the daemon's lease: how long abandoned leases pin (3)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--role", choices=tuple(WORKING_SET), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chains", type=int, default=0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.role is not None:
        return _client(args)
    from tierd.daemon.config import parse_bytes

    dram = parse_bytes(args.dram_bytes)
    block = args.block_kib << 10
    phases = {}
    for name, other, quotas in (("alone", None, True), ("benign", "benign", True),
                                ("hostile", "hostile", True), ("no quotas", "hostile", False)):
        phases[name] = _phase(args, dram, block, other, quotas)
    return _report(args, dram, block, phases)


def _phase(args: argparse.Namespace, dram: int, block: int, other: str | None,
           quotas: bool) -> dict[str, Any]:
    """One daemon, the clients of one phase; their figures and the daemon's RSS."""
    workdir = tempfile.mkdtemp(prefix="tierd-tenants-")
    sock = os.path.join(workdir, "d.sock")
    tokens = os.path.join(workdir, "tokens.toml")
    with open(tokens, "w") as f:
        f.write("".join(f'"{token}" = "{tenant}"\n' for tenant, token in TOKENS.items()))
    flags = ["--dram-bytes", str(dram), "--slab-bytes", str(max(block, 1 << 20)),
             "--ssd-dir", "", "--lease-seconds", str(args.lease_seconds),
             "--maintain-seconds", "0.5", "--token-file", tokens, "--presence-cells", "0"]
    if quotas:
        flags += ["--tenant-quotas", f'{{ well = {{ dram = "{WELL_SHARE:.0%}" }}, other = '
                                     f'{{ dram = "{OTHER_SHARE:.0%}" }} }}']
    server = TierdServe(workdir, flags, socket_path=sock)
    try:
        daemon = server.start()
        return _drive(args, daemon, sock, workdir, dram, block, other)
    finally:
        server.stop(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)


def _drive(args: argparse.Namespace, daemon: subprocess.Popen[bytes], sock: str, workdir: str,
           dram: int, block: int, other: str | None) -> dict[str, Any]:
    warmup = 3.0 + WORKING_SET["well"] * dram / block / 400  # the clients' first stores
    start = time.time() + warmup
    until = start + args.seconds
    roles = ["well"] + ([other] if other is not None else [])
    chains = {r: max(1, int(WORKING_SET[r] * dram / block) // CHAIN_BLOCKS) for r in roles}
    outs = {r: os.path.join(workdir, f"{r}.json") for r in roles}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tierd.bench.tenants", "--role", r, "--socket", sock,
         "--start", repr(start), "--until", repr(until), "--out", outs[r],
         "--chains", str(chains[r]), "--block-kib", str(args.block_kib),
         "--rate", str(args.rate)]) for r in roles]
    while time.time() < start:
        time.sleep(0.05)
    rss_start, anon_start, _ = _usage(daemon.pid)
    for p in procs:
        p.wait()
    rss_end, anon_end, _ = _usage(daemon.pid)
    results = {r: _load(path) for r, path in outs.items()}
    well = results["well"]
    lat = sorted(well["latencies"])
    return {"well_hit_ratio": well["hits"] / well["asked"] if well["asked"] else 0.0,
            "well_loads": len(lat), "well_p50_ms": _quantile(lat, 0.5) * 1e3,
            "well_p99_ms": _quantile(lat, 0.99) * 1e3, "well_errors": well["errors"],
            "well_error_kinds": well["error_kinds"],
            "other_refused": results[other]["refused"] if other is not None else 0,
            "other_errors": results[other]["errors"] if other is not None else 0,
            "rss_start_mib": rss_start, "rss_end_mib": rss_end,
            "anon_start_mib": anon_start, "anon_end_mib": anon_end,
            "exit_codes": [p.returncode for p in procs]}


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {"latencies": [], "hits": 0, "asked": 0, "errors": 1, "refused": 0,
                "error_kinds": ["client wrote no result"]}
    return data


def _report(args: argparse.Namespace, dram: int, block: int,
            phases: dict[str, dict[str, Any]]) -> int:
    alone, benign, hostile = phases["alone"], phases["benign"], phases["hostile"]
    hit = hostile["well_hit_ratio"] / alone["well_hit_ratio"] if alone["well_hit_ratio"] else 0.0
    p99 = hostile["well_p99_ms"] / alone["well_p99_ms"] if alone["well_p99_ms"] else 0.0
    same_load = hostile["well_p99_ms"] / benign["well_p99_ms"] if benign["well_p99_ms"] else 0.0
    growth = hostile["rss_end_mib"] - hostile["rss_start_mib"]
    rss_limit = max(4.0, 0.05 * hostile["rss_start_mib"])
    errors = sum(p["well_errors"] + sum(c != 0 for c in p["exit_codes"]) for p in phases.values())
    checks = [("hit ratio, hostile / alone", round(hit, 3), ">= 0.9", hit >= 0.9),
              ("p99 Acquire, hostile / alone", round(p99, 3), "<= 1.1", p99 <= 1.1),
              ("RSS growth MiB (hostile phase)", round(growth, 2), f"<= {rss_limit:.1f}",
               growth <= rss_limit),
              ("well-behaved errors", errors, "== 0", errors == 0)]
    ok = all(good for *_, good in checks)
    if args.json:
        print(json.dumps({"phases": phases, "checks": [list(c) for c in checks],
                          "p99_hostile_over_benign": same_load, "pass": ok}, indent=2))
        return 0 if ok else 1
    mib = 1 << 20
    print(f"tierd bench tenants: arena {dram / mib:.0f} MiB of {block >> 10} KiB blocks, DRAM "
          f"only, lease {args.lease_seconds:g} s, {args.seconds:g} s per phase at "
          f"{args.rate:g} loads/s per client; quotas: well-behaved {WELL_SHARE:.0%}, other "
          f"{OTHER_SHARE:.0%}; working sets {WORKING_SET['well']:.0%} of the arena, benign "
          f"{WORKING_SET['benign']:.0%}, hostile {WORKING_SET['hostile'] / OTHER_SHARE:g}x its "
          "quota")
    for name, p in phases.items():
        print(f"  {name:<10} well-behaved: hit ratio {p['well_hit_ratio']:.3f} over "
              f"{p['well_loads']} loads, Acquire p50 {p['well_p50_ms']:.2f} ms, p99 "
              f"{p['well_p99_ms']:.2f} ms, errors {p['well_errors']}"
              + (f" ({', '.join(p['well_error_kinds'])})" if p["well_error_kinds"] else "")
              + (f"; the other refused {p['other_refused']} calls" if name != "alone" else ""))
        print(f"  {'':<10} daemon RSS {p['rss_start_mib']:.1f} -> {p['rss_end_mib']:.1f} MiB "
              f"(heap {p['anon_start_mib']:.1f} -> {p['anon_end_mib']:.1f} MiB)")
    print(f"  context    p99 Acquire, hostile / benign (same load)  {same_load:.3f}")
    for name, value, target, good in checks:
        print(f"  verdict    {name:<32} {value!s:>8}  target {target:<7} "
              f"{'ok' if good else 'MISSED'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# -- the client processes ------------------------------------------------------------------------

def _client(args: argparse.Namespace) -> int:
    """One tenant's engine: the well-behaved loop or the hostile one, paced at ``--rate``, until
    ``--until`` (wall clock); results to ``--out`` as JSON."""
    import grpc

    from tierd.daemon.arena import ShmArena
    from tierd.daemon.client import TierdClient
    from tierd.types import BlockHash

    layout = _layout(args.block_kib << 10)
    size = layout.block_bytes
    rng = random.Random(args.role)
    chains = [[BlockHash(hashlib.sha256(f"{args.role}/{c}/{i}".encode()).digest())
               for i in range(CHAIN_BLOCKS)] for c in range(args.chains)]
    token = TOKENS["well" if args.role == "well" else "other"]
    client = TierdClient(socket_path=args.socket, token=token, timeout=30.0)
    engine = client.register_engine(layout, args.role)
    arena = ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
    geometry = engine.geometry
    into = bytearray(size)
    counts = {"hits": 0, "asked": 0, "errors": 0, "refused": 0}
    kinds: set[str] = set()
    latencies = array.array("d")

    def content(h: bytes) -> bytes:
        return (h * (size // len(h) + 1))[:size]

    def store(hashes: list[BlockHash], blank: bool) -> None:
        if blank:
            res = client.reserve_blank_async(engine.engine_id, len(hashes)).result()
        else:
            res = client.reserve(engine.engine_id, hashes)
        for h, slot in zip(hashes, res.slot_ids):
            if slot is not None:
                arena.view(geometry.offset(slot), size)[:] = content(h)
        written = [slot is not None for slot in res.slot_ids]
        client.commit(engine.engine_id, res.lease_id, written,
                      names=hashes[:len(written)] if blank else ())

    def guarded(call: Any) -> Any:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                counts["refused"] += 1
            else:
                counts["errors"] += 1
                kinds.add(f"{exc.code().name}: {(exc.details() or '')[:80]}")
            return None

    if args.role != "hostile":
        for hashes in chains:  # the warm-up: the whole working set, before the timed part
            guarded(lambda: store(hashes, blank=False))
    while time.time() < args.start:
        time.sleep(0.01)
    period = 1.0 / args.rate
    tick = time.time()
    n = 0
    while time.time() < args.until:
        tick += period
        pause = tick - time.time()
        if pause > 0:
            time.sleep(pause)
        n += 1
        hashes = rng.choice(chains)
        t0 = time.perf_counter()
        got = guarded(lambda: client.acquire(engine.engine_id, hashes, count_lookup=True))
        if args.role == "benign":
            if got is not None and got.num_blocks:
                guarded(lambda: client.release(engine.engine_id, got.lease_id))
            if got is not None and got.num_blocks < len(hashes):
                guarded(lambda: store(hashes[got.num_blocks:], blank=False))
            continue
        if args.role == "well":
            latencies.append(time.perf_counter() - t0)
            if got is None:
                counts["errors"] += 1
                continue
            counts["asked"] += len(hashes)
            counts["hits"] += got.num_blocks
            for slot in got.slot_ids:
                into[:] = arena.view(geometry.offset(slot), size)
            if got.num_blocks:
                guarded(lambda: client.release(engine.engine_id, got.lease_id))
            if got.num_blocks < len(hashes):
                guarded(lambda: store(hashes[got.num_blocks:], blank=True))
            continue
        # hostile: abandon every other lease, store what missed, spam blank slots
        if got is not None and got.num_blocks and n % 2:
            guarded(lambda: client.release(engine.engine_id, got.lease_id))
        done = got.num_blocks if got is not None else 0
        if done < len(hashes):
            guarded(lambda: store(hashes[done:], blank=False))
        if n % 5 == 0:
            guarded(lambda: client.reserve_blank_async(engine.engine_id, 256).result())
    arena.close()
    client.close()
    with open(args.out, "w") as f:
        json.dump({**counts, "error_kinds": sorted(kinds), "latencies": list(latencies)}, f)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tierd bench tenants", description=HELP)
    configure(parser)
    sys.exit(run(parser.parse_args()))
