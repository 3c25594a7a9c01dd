"""`tierd bench tenants`: can a hostile tenant starve a well-behaved one under ``tenant_quotas``?

Four arms, each a real `tierd serve` of its own (DRAM only, a token file of two tenants,
``tenant_quotas`` giving the well-behaved tenant half the arena and the other one a quarter),
each with the well-behaved client paced at the same rate:

1. ``alone``: the well-behaved tenant only;
2. ``benign``: beside the other tenant behaving well at the same rate (a working set within its
   quota, every lease released);
3. ``hostile``: beside the other tenant turned hostile: it abandons half its read leases (they
   pin until they expire), spams blank reservations it never commits, and stores a working set
   10x its quota;
4. ``no quotas``: arm 3 without ``tenant_quotas`` (context: what the quotas prevent).

A round starts the four daemons and their clients together; then the arms take turns of
``--slice`` seconds (0.5 s), round robin, until each had ``--seconds`` of turns: one arm's
clients run at a time, so no arm's daemon or clients take CPU from another's, and the host's
noise (other jobs, a slow minute) falls on every arm alike, spread over the round in short
pieces. Each figure is the median over the rounds of the arm's value over the alone arm's of
the same round. ``--slice 0``: the four arms at once instead, over ``--seconds``.

The well-behaved client (a process, its own token) first stores its working set (40% of the
arena: within its share), then in its turns loads a random chain of it, at random times (Poisson
arrivals at ``--rate``, so no client keeps a fixed phase against the other's calls):
``Acquire`` (timed), a copy of every acquired block out of the arena, ``Release``; a block that
missed is stored again through blank slots (``Reserve(blank_slots)`` + copy + ``Commit`` with
names), as TierdTier stores.

The other tenant's client runs at ``--other-nice`` (19): on a node each engine has cores of its
own, so the other engine's own CPU never delays the well-behaved one's calls; on a small host its
process would share the two cores with the daemon and the well-behaved client, a cost no daemon
can avoid. The daemon's work for the other tenant is at the daemon's priority, so it is measured.
``--other-nice 0`` measures the host's share too.

Targets: hostile / alone, the well-behaved tenant's hit ratio (blocks acquired / blocks asked
for) >= 0.9 and p99 ``Acquire`` <= 1.1; the daemon's RSS over the timed part of every hostile
round grows <= max(4 MiB, 5%). About 3 minutes (``--rounds`` x 4 arms x ``--seconds``, and
each round's warm-up).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tierd.bench.soak import _layout, _quantile, _usage
from tierd.bench.tierd_serve import TierdServe

HELP = ("Two tenants, one hostile (abandoned leases, blank-slot spam, a working set 10x its "
        "quota): the well-behaved one's hit ratio and p99 Acquire vs running alone; RSS.")

CHAIN_BLOCKS = 8
WELL_SHARE, OTHER_SHARE = 0.5, 0.25     # of the arena, by tenant_quotas
WORKING_SET = {"well": 0.4, "benign": 0.2, "hostile": 2.5}  # of the arena (hostile: 10x quota)
TOKENS = {"well": "bench-token-well", "other": "bench-token-other"}  # tenant -> token
ARMS: dict[str, tuple[str | None, bool]] = {  # arm -> (the other client's role, quotas on)
    "alone": (None, True), "benign": ("benign", True), "hostile": ("hostile", True),
    "no quotas": ("hostile", False)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="turns of each arm in each round, seconds (10)")
    parser.add_argument("--slice", type=float, default=0.5,
                        help="length of one arm's turn, seconds (0.5; 0: the arms at once)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each of the four arms in turns (3)")
    parser.add_argument("--dram-bytes", default="64MiB", help="the daemon's arena (64MiB)")
    parser.add_argument("--block-kib", type=int, default=64, help="block size in KiB (64)")
    parser.add_argument("--rate", type=float, default=50.0,
                        help="loads per second of each client (50)")
    parser.add_argument("--lease-seconds", type=float, default=3.0,
                        help="the daemon's lease: how long abandoned leases pin (3)")
    parser.add_argument("--other-nice", type=int, default=19,
                        help="niceness of the other tenant's client (19: its own CPU does not "
                             "compete with the daemon and the well-behaved client)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--role", choices=tuple(WORKING_SET), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chains", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--turn", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--arms", type=int, default=1, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.role is not None:
        return _client(args)
    from tierd.daemon.config import parse_bytes

    dram = parse_bytes(args.dram_bytes)
    block = args.block_kib << 10
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ARMS}
    for _ in range(args.rounds):
        for name, result in _round(args, dram, block).items():
            runs[name].append(result)
    return _report(args, dram, block, runs)


@dataclass(frozen=True, slots=True)
class Turns:
    """When an arm's clients run: turns of ``slice`` seconds from ``start``, round robin over
    ``arms``, this arm's being number ``turn`` (``slice`` 0: always)."""

    start: float
    slice: float
    arms: int
    turn: int

    def wall(self, active: float) -> float:
        """The wall-clock time at which this arm has had ``active`` seconds of turns."""
        if not self.slice:
            return self.start + active
        done, within = divmod(active, self.slice)
        return self.start + (done * self.arms + self.turn) * self.slice + within

    def mine(self, t: float) -> bool:
        """Whether wall-clock time ``t`` is in one of this arm's turns."""
        return not self.slice or math.floor((t - self.start) / self.slice) % self.arms == \
            self.turn


def _round(args: argparse.Namespace, dram: int, block: int) -> dict[str, dict[str, Any]]:
    """The four arms, each on its own daemon, taking turns (``Turns``): the host's noise falls
    on every arm alike and no arm's processes take CPU from another's, so what differs between
    arms is what one daemon let its second tenant do to the first."""
    warmup = 4.0 + WORKING_SET["well"] * dram / block / 400 * len(ARMS)  # the first stores
    with contextlib.ExitStack() as stack:
        daemons = {name: stack.enter_context(_daemon(args, dram, block, quotas))
                   for name, (_, quotas) in ARMS.items()}
        start = time.time() + warmup
        procs: dict[str, dict[str, subprocess.Popen[bytes]]] = {}
        for turn, (name, (other, _)) in enumerate(ARMS.items()):
            sock, workdir = daemons[name][1:]
            procs[name] = {role: _spawn(args, role, sock, workdir, dram, block, start, turn)
                           for role in ["well"] + ([other] if other else [])}
        while time.time() < start:
            time.sleep(0.05)
        rss_start = {name: _usage(d[0].pid) for name, d in daemons.items()}
        for clients in procs.values():
            for p in clients.values():
                p.wait()
        return {name: _figures(procs[name], daemons[name][2], rss_start[name],
                               _usage(daemons[name][0].pid)) for name in ARMS}


@contextlib.contextmanager
def _daemon(args: argparse.Namespace, dram: int, block: int,
            quotas: bool) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """A `tierd serve` of its own folder (DRAM only, the two tenants' token file, quotas if
    asked); yields the process, its socket and its folder, both removed afterwards."""
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
        yield server.start(), sock, workdir
    finally:
        server.stop(timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)


def _spawn(args: argparse.Namespace, role: str, sock: str, workdir: str, dram: int, block: int,
           start: float, turn: int) -> subprocess.Popen[bytes]:
    chains = max(1, int(WORKING_SET[role] * dram / block) // CHAIN_BLOCKS)
    return subprocess.Popen(
        [sys.executable, "-m", "tierd.bench.tenants", "--role", role, "--socket", sock,
         "--start", repr(start),
         "--out", os.path.join(workdir, f"{role}.json"), "--chains", str(chains),
         "--block-kib", str(args.block_kib), "--rate", str(args.rate),
         "--slice", repr(args.slice), "--arms", str(len(ARMS)), "--turn", str(turn),
         "--seconds", repr(args.seconds), "--other-nice", str(args.other_nice)])


def _figures(clients: dict[str, subprocess.Popen[bytes]], workdir: str,
             rss_start: tuple[float, float, int], rss_end: tuple[float, float, int]
             ) -> dict[str, Any]:
    """One arm's figures: the well-behaved client's, the other client's refusals and errors,
    the daemon's RSS at the start and the end of the timed part."""
    results = {role: _load(os.path.join(workdir, f"{role}.json")) for role in clients}
    well = results["well"]
    other = next((r for role, r in results.items() if role != "well"), None)
    lat = sorted(well["latencies"])
    return {"well_hit_ratio": well["hits"] / well["asked"] if well["asked"] else 0.0,
            "well_loads": len(lat), "well_p50_ms": _quantile(lat, 0.5) * 1e3,
            "well_p99_ms": _quantile(lat, 0.99) * 1e3, "well_errors": well["errors"],
            "well_error_kinds": well["error_kinds"],
            "well_nice": well.get("nice"), "other_nice": other.get("nice") if other else None,
            "other_refused": other["refused"] if other is not None else 0,
            "other_errors": other["errors"] if other is not None else 0,
            "rss_start_mib": rss_start[0], "rss_end_mib": rss_end[0],
            "anon_start_mib": rss_start[1], "anon_end_mib": rss_end[1],
            "exit_codes": [p.returncode for p in clients.values()]}


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {"latencies": [], "hits": 0, "asked": 0, "errors": 1, "refused": 0,
                "error_kinds": ["client wrote no result"]}
    return data


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per arm, the median over the rounds of the well-behaved tenant's hit ratio, p50 and p99
    ``Acquire`` and of the daemon's RSS at the start; the largest RSS growth of any round; the
    errors summed."""
    return {name: {"hit_ratio": _median([p["well_hit_ratio"] for p in arm]),
                   "p50_ms": _median([p["well_p50_ms"] for p in arm]),
                   "p99_ms": _median([p["well_p99_ms"] for p in arm]),
                   "rss_growth_mib": max((p["rss_end_mib"] - p["rss_start_mib"] for p in arm),
                                         default=0.0),
                   "rss_start_mib": _median([p["rss_start_mib"] for p in arm]),
                   "errors": sum(p["well_errors"] + sum(c != 0 for c in p["exit_codes"])
                                 for p in arm)}
            for name, arm in runs.items()}


def paired(runs: dict[str, list[dict[str, Any]]], arm: str, field: str) -> float:
    """The median over the rounds of ``arm``'s ``field`` divided by the alone arm's of the
    same round (arms of one round ran at the same time, on the same host)."""
    return _median([p[field] / a[field] if a[field] else 0.0
                    for p, a in zip(runs[arm], runs["alone"], strict=True)])


def verdicts(runs: dict[str, list[dict[str, Any]]],
             summary: dict[str, dict[str, float]]) -> list[tuple[str, float, str, bool]]:
    """The targets, each ``(name, value, target, met)``: the hostile arm's hit ratio and p99
    ``Acquire`` against the alone arm's (``paired``), the hostile rounds' largest RSS growth,
    and no well-behaved errors."""
    hit = paired(runs, "hostile", "well_hit_ratio")
    p99 = paired(runs, "hostile", "well_p99_ms")
    growth = summary["hostile"]["rss_growth_mib"]
    rss_limit = max(4.0, 0.05 * summary["hostile"]["rss_start_mib"])
    errors = int(sum(s["errors"] for s in summary.values()))
    return [("hit ratio, hostile / alone", round(hit, 3), ">= 0.9", hit >= 0.9),
            ("p99 Acquire, hostile / alone", round(p99, 3), "<= 1.1", p99 <= 1.1),
            ("RSS growth MiB (hostile rounds)", round(growth, 2), f"<= {rss_limit:.1f}",
             growth <= rss_limit),
            ("well-behaved errors", errors, "== 0", errors == 0)]


def _report(args: argparse.Namespace, dram: int, block: int,
            runs: dict[str, list[dict[str, Any]]]) -> int:
    summary = summarize(runs)
    checks = verdicts(runs, summary)
    benign = paired(runs, "benign", "well_p99_ms")
    ok = all(good for *_, good in checks)
    if args.json:
        print(json.dumps({"rounds": runs, "medians": summary, "checks": [list(c) for c in checks],
                          "p99_benign_over_alone": benign, "pass": ok}, indent=2))
        return 0 if ok else 1
    mib = 1 << 20
    turns = (f"turns of {args.slice:g} s, round robin" if args.slice
             else "the four arms of a round at once")
    print(f"tierd bench tenants: arena {dram / mib:.0f} MiB of {block >> 10} KiB blocks, DRAM "
          f"only, lease {args.lease_seconds:g} s, {args.rounds} rounds of {args.seconds:g} s "
          f"per arm ({turns}), a daemon each, Poisson arrivals at {args.rate:g} loads/s per "
          "client; "
          f"quotas: well-behaved {WELL_SHARE:.0%}, other {OTHER_SHARE:.0%}; working sets "
          f"{WORKING_SET['well']:.0%} of the arena, benign "
          f"{WORKING_SET['benign']:.0%}, hostile {WORKING_SET['hostile'] / OTHER_SHARE:g}x its "
          f"quota; the other client at nice {args.other_nice}")
    for name, arm in runs.items():
        s = summary[name]
        p99s = ", ".join(f"{p['well_p99_ms']:.2f}" for p in arm)
        refused = sum(p["other_refused"] for p in arm)
        kinds = sorted({k for p in arm for k in p["well_error_kinds"]})
        print(f"  {name:<10} well-behaved, medians: hit ratio {s['hit_ratio']:.3f}, Acquire p50 "
              f"{s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms (rounds: {p99s}), errors "
              f"{s['errors']:g}" + (f" ({', '.join(kinds)})" if kinds else "")
              + (f"; the other refused {refused} calls" if name != "alone" else ""))
        print(f"  {'':<10} daemon RSS growth, largest of the rounds {s['rss_growth_mib']:+.2f} "
              f"MiB (last round {arm[-1]['rss_start_mib']:.1f} -> "
              f"{arm[-1]['rss_end_mib']:.1f} MiB)")
    print(f"  context    p99 Acquire, benign / alone (a second tenant's load)  {benign:.3f}")
    for name, value, target, good in checks:
        print(f"  verdict    {name:<32} {value!s:>8}  target {target:<7} "
              f"{'ok' if good else 'MISSED'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# -- the client processes ------------------------------------------------------------------------

def _client(args: argparse.Namespace) -> int:
    """One tenant's engine: the well-behaved loop or the hostile one, Poisson arrivals at
    ``--rate`` in its arm's turns, until it had ``--seconds`` of them; results to ``--out`` as
    JSON."""
    if args.role != "well" and args.other_nice:
        os.nice(args.other_nice)  # before gRPC starts its threads: they inherit it
    import grpc

    from tierd.types import BlockHash
    from tierd.wire.arena import ShmArena
    from tierd.wire.client import TierdClient

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
    turns = Turns(args.start, args.slice, args.arms, args.turn)
    arrivals = random.Random(f"{args.role}/{args.turn}/arrivals")
    active = 0.0
    n = 0
    while True:
        active += arrivals.expovariate(args.rate)
        if active >= args.seconds:
            break
        pause = turns.wall(active) - time.time()
        if pause > 0:
            time.sleep(pause)
        elif not turns.mine(time.time()):
            continue  # behind, past this arm's turn: leave the next arm's turn to it
        n += 1
        hashes = rng.choice(chains)
        t0 = time.perf_counter()
        got = guarded(lambda: client.acquire(engine.engine_id, hashes))
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
        json.dump({**counts, "error_kinds": sorted(kinds), "latencies": list(latencies),
                   "nice": os.getpriority(os.PRIO_PROCESS, 0)}, f)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tierd bench tenants", description=HELP)
    configure(parser)
    sys.exit(run(parser.parse_args()))
