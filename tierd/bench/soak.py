"""`tierd bench soak`: a real `tierd serve` under N client processes for a bounded time, with a
working set of 3x its DRAM arena: are there errors, wrong bytes, leaked pins, or growth?

The daemon is a child process on a Unix socket in a temporary directory (loopback only: nothing
listens on TCP), with its own SSD directory and the default policy (watermarks, write-behind,
a pre-faulted arena, so the arena's pages are resident from the start and RSS growth is the
daemon's own memory); only the sizes and the lease are set. Each client process registers an
engine of the shared layout (one tenant, so clients hit each other's blocks) and, until the
deadline, picks a random chain of the working set and does what an engine does: ``Acquire``
with ``count_lookup``, verifies every acquired block where it lies in the arena (its checksum
against the one the daemon returned and against the content the chain's hash determines: a
mismatch is a wrong byte), ``Release``, then ``Reserve`` + copy + ``Commit`` of the blocks that
missed. Every RPC is timed; any RPC error is counted.

Figures, each judged against a limit measured in the same run:

- ops/s (RPCs) and p50 / p99 RPC latency over all clients (context, not a target);
- errors and wrong bytes: target 0;
- leaked pins: once the clients stopped (each released what it held), the daemon's pinned DRAM
  blocks, polled until 0 for at most the lease time plus one maintain pass: target 0 after it;
- daemon RSS and open fds, sampled every second: the slope of the last half (after warm-up),
  as growth over that half beside its noise (2 sigma of the samples about their fit, at least
  one MiB): target growth <= noise.

Default ~120 s (``--seconds``); ``--quick`` ~20 s with a smaller arena.
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierd.bench.tierd_serve import TierdServe

if TYPE_CHECKING:
    from tierd.wire.layout import Layout

HELP = ("Soak a real daemon: N clients, working set 3x DRAM; errors, wrong bytes, leaked pins, "
        "RSS and fd slope.")

WORKING_SET = 3.0     # working set / DRAM arena
CHAIN_BLOCKS = 8      # blocks per chain of the working set
MAINTAIN_S = 0.5      # the daemon's maintain pass period in the soak


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None,
                        help="how long the clients run (120; 20 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="~20 s with a 32 MiB arena, for a smoke run")
    parser.add_argument("--clients", type=int, default=4, help="client processes (4)")
    parser.add_argument("--dram-bytes", default=None,
                        help="the daemon's arena (64MiB; 32MiB with --quick); working set 3x")
    parser.add_argument("--block-kib", type=int, default=64, help="block size in KiB (64)")
    parser.add_argument("--lease-seconds", type=float, default=5.0,
                        help="the daemon's lease: the bound of the leaked-pin wait (5)")
    parser.add_argument("--dir", default=None, help="work directory (socket, SSD): default a "
                        "temporary one under the tierd cache dir")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chains", type=int, default=0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.client is not None:
        return _client(args)
    from tierd.daemon.config import parse_bytes
    from tierd.paths import cache_dir

    seconds = args.seconds if args.seconds is not None else (20.0 if args.quick else 120.0)
    dram = parse_bytes(args.dram_bytes or ("32MiB" if args.quick else "64MiB"))
    block = args.block_kib << 10
    chains = max(1, int(WORKING_SET * dram / block) // CHAIN_BLOCKS)
    base = args.dir or str(cache_dir() / "bench")
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tierd-soak-", dir=base)
    sockdir = tempfile.mkdtemp(prefix="tierd-s")  # a short path: sockets are capped at 108 B
    sock = os.path.join(sockdir, "d.sock")
    slab = max(block, 1 << 20)
    server = TierdServe(workdir, [
        "--dram-bytes", str(dram), "--slab-bytes", str(slab),
        "--ssd-dir", os.path.join(workdir, "ssd"), "--ssd-bytes", str(8 * dram),
        "--lease-seconds", str(args.lease_seconds), "--maintain-seconds", str(MAINTAIN_S),
        "--ssd-io-threads", "2"], socket_path=sock)
    try:
        daemon = server.start()
        figures = _soak(args, daemon, sock, workdir, seconds, dram, block, chains)
    finally:
        server.stop(timeout=120)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)
    return _report(figures, args.json)


# -- the driver ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Sample:
    t: float          # seconds since the clients started
    rss_mib: float    # VmRSS: anonymous + file + shared memory (the arena) resident
    anon_mib: float   # RssAnon: the daemon's own heap
    fds: int


def _soak(args: argparse.Namespace, daemon: subprocess.Popen[bytes], sock: str, workdir: str,
          seconds: float, dram: int, block: int, chains: int) -> dict[str, Any]:
    from tierd.wire.client import TierdClient

    with TierdClient(socket_path=sock, timeout=30.0) as probe:
        probe.wait_ready(timeout=60)
        start = time.monotonic()
        until = time.time() + seconds
        outs = [os.path.join(workdir, f"client-{i}.json") for i in range(args.clients)]
        clients = [subprocess.Popen(
            [sys.executable, "-m", "tierd.bench.soak", "--client", str(i), "--socket", sock,
             "--until", repr(until), "--out", outs[i], "--chains", str(chains),
             "--block-kib", str(args.block_kib)]) for i in range(args.clients)]
        samples: list[Sample] = []
        while any(c.poll() is None for c in clients):
            samples.append(Sample(time.monotonic() - start, *_usage(daemon.pid)))
            time.sleep(1.0)
        for c in clients:
            c.wait()
        wall = time.monotonic() - start
        pinned, waited = _pinned_after(probe, args.lease_seconds + 2 * MAINTAIN_S + 1.0)
        stats = probe.stats()
    results = [_load(path) for path in outs]
    latencies = array.array("d")
    for r in results:
        latencies.extend(r["latencies"])
    lat = sorted(latencies)
    rss = _trend([(s.t, s.rss_mib) for s in samples])
    anon = _trend([(s.t, s.anon_mib) for s in samples])
    fds = _trend([(s.t, float(s.fds)) for s in samples])
    dram_tier = next(t for t in stats.tiers if t.tier == "dram")
    ssd_tier = next(t for t in stats.tiers if t.tier == "ssd")
    return {
        "clients": args.clients, "seconds": round(wall, 1), "dram_bytes": dram,
        "block_bytes": block, "working_set_bytes": chains * CHAIN_BLOCKS * block,
        "lease_seconds": args.lease_seconds,
        "rpcs": len(lat), "ops_per_s": len(lat) / wall if wall else 0.0,
        "p50_ms": _quantile(lat, 0.50) * 1e3, "p99_ms": _quantile(lat, 0.99) * 1e3,
        "loads": sum(r["loads"] for r in results),
        "verified_blocks": sum(r["verified"] for r in results),
        "stored_blocks": sum(r["stored"] for r in results),
        "errors": sum(r["errors"] for r in results) + sum(c.returncode != 0 for c in clients),
        "error_kinds": sorted({k for r in results for k in r["error_kinds"]}),
        "wrong_bytes": sum(r["wrong"] for r in results),
        "leaked_pins": pinned, "pin_wait_s": round(waited, 2),
        "hit_ratio": stats.hit_ratio, "dram_evictions": dram_tier.evictions,
        "ssd_blocks": ssd_tier.used_blocks, "promotions": ssd_tier.promotions,
        "rss_first_mib": samples[0].rss_mib if samples else 0.0,
        "rss_last_mib": samples[-1].rss_mib if samples else 0.0,
        "rss_max_mib": max((s.rss_mib for s in samples), default=0.0),
        "rss_slope_mib_per_min": rss.slope * 60, "rss_growth_mib": rss.growth,
        "rss_noise_mib": max(1.0, rss.noise),
        "anon_first_mib": samples[0].anon_mib if samples else 0.0,
        "anon_last_mib": samples[-1].anon_mib if samples else 0.0,
        "anon_slope_mib_per_min": anon.slope * 60,
        "fds_first": samples[0].fds if samples else 0,
        "fds_last": samples[-1].fds if samples else 0,
        "fds_max": max((s.fds for s in samples), default=0),
        "fds_slope_per_min": fds.slope * 60, "fds_growth": fds.growth,
        "samples": len(samples),
    }


def _usage(pid: int) -> tuple[float, float, int]:
    """The process's resident set and its anonymous part (MiB), and its open file
    descriptors, from /proc."""
    kib = {"VmRSS:": 0, "RssAnon:": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(maxsplit=1)[0]
            if key in kib:
                kib[key] = int(line.split()[1])
    return kib["VmRSS:"] / 1024, kib["RssAnon:"] / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _pinned_after(client: Any, limit_s: float) -> tuple[int, float]:
    """The daemon's pinned DRAM blocks, polled until 0 or ``limit_s``; (count, seconds)."""
    start = time.monotonic()
    while True:
        pinned = next(t.pinned_blocks for t in client.stats().tiers if t.tier == "dram")
        waited = time.monotonic() - start
        if pinned == 0 or waited >= limit_s:
            return pinned, waited
        time.sleep(0.1)


@dataclass(frozen=True, slots=True)
class Trend:
    slope: float      # per second, least squares over the last half
    growth: float     # slope * the last half's duration
    noise: float      # 2 sigma of the last half's samples about the fit


def _trend(points: list[tuple[float, float]]) -> Trend:
    """The least-squares line through the last half of ``points`` (after warm-up)."""
    half = points[len(points) // 2:]
    if len(half) < 3:
        return Trend(0.0, 0.0, 0.0)
    ts, ys = [p[0] for p in half], [p[1] for p in half]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0
    residuals = [y - (my + slope * (t - mt)) for t, y in zip(ts, ys)]
    return Trend(slope, slope * (ts[-1] - ts[0]), 2 * statistics.pstdev(residuals))


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {"latencies": [], "loads": 0, "verified": 0, "stored": 0, "errors": 1,
                "error_kinds": ["client wrote no result"], "wrong": 0}
    return data


def _report(f: dict[str, Any], as_json: bool) -> int:
    checks = [("errors", f["errors"], "== 0", f["errors"] == 0),
              ("wrong bytes", f["wrong_bytes"], "== 0", f["wrong_bytes"] == 0),
              ("leaked pins", f["leaked_pins"], "== 0", f["leaked_pins"] == 0),
              ("RSS growth / noise (last half)",
               round(f["rss_growth_mib"] / f["rss_noise_mib"], 2), "<= 1",
               f["rss_growth_mib"] <= f["rss_noise_mib"])]
    ok = all(good for *_, good in checks)
    if as_json:
        print(json.dumps({**f, "pass": ok}, indent=2))
        return 0 if ok else 1
    mib = 1 << 20
    print(f"tierd bench soak: {f['clients']} clients for {f['seconds']:.1f} s; working set "
          f"{f['working_set_bytes'] / mib:.0f} MiB = "
          f"{f['working_set_bytes'] / f['dram_bytes']:.1f}x"
          f" DRAM {f['dram_bytes'] / mib:.0f} MiB, blocks of {f['block_bytes'] >> 10} KiB, "
          f"lease {f['lease_seconds']:g} s")
    print(f"  ops          {f['rpcs']} RPCs = {f['ops_per_s']:.0f}/s; latency p50 "
          f"{f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms")
    print(f"  traffic      {f['loads']} loads, {f['verified_blocks']} blocks verified, "
          f"{f['stored_blocks']} stored; hit ratio {f['hit_ratio']:.2f}, {f['promotions']} SSD "
          f"promotions, {f['dram_evictions']} DRAM evictions, {f['ssd_blocks']} SSD blocks")
    print(f"  errors       {f['errors']}" + (f" ({', '.join(f['error_kinds'])})"
                                             if f["error_kinds"] else ""))
    print(f"  wrong bytes  {f['wrong_bytes']} blocks (of {f['verified_blocks']} verified)")
    print(f"  leaked pins  {f['leaked_pins']} (pinned count polled {f['pin_wait_s']:.1f} s after "
          f"the clients stopped; bound: the lease + a maintain pass)")
    print(f"  daemon RSS   {f['rss_first_mib']:.1f} -> {f['rss_last_mib']:.1f} MiB (max "
          f"{f['rss_max_mib']:.1f}); last half slope {f['rss_slope_mib_per_min']:+.2f} MiB/min, "
          f"growth {f['rss_growth_mib']:+.2f} MiB vs noise {f['rss_noise_mib']:.2f} MiB")
    print(f"  of it, heap  {f['anon_first_mib']:.1f} -> {f['anon_last_mib']:.1f} MiB (RssAnon); "
          f"last half slope {f['anon_slope_mib_per_min']:+.2f} MiB/min")
    print(f"  daemon fds   {f['fds_first']} -> {f['fds_last']} (max {f['fds_max']}); last half "
          f"slope {f['fds_slope_per_min']:+.2f}/min over {f['samples']} samples")
    for name, value, target, good in checks:
        print(f"  verdict      {name:<32} {value!s:>8}  target {target:<5} "
              f"{'ok' if good else 'MISSED'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# -- one client process ------------------------------------------------------------------------

def _client(args: argparse.Namespace) -> int:
    """Until ``--until`` (wall clock): random chains of the working set, loaded and verified,
    misses stored; results to ``--out`` as JSON. Exits 0 unless it could not start."""
    import grpc

    from tierd.checksum import block_checksum
    from tierd.types import BlockHash
    from tierd.wire.arena import ShmArena
    from tierd.wire.client import TierdClient

    layout = _layout(args.block_kib << 10)
    rng = random.Random(args.client)
    chains = [[BlockHash(hashlib.sha256(f"soak/{c}/{i}".encode()).digest())
               for i in range(CHAIN_BLOCKS)] for c in range(args.chains)]
    size = layout.block_bytes
    expected: dict[bytes, int] = {}

    def content(h: bytes) -> bytes:
        return (h * (size // len(h) + 1))[:size]

    def checksum_of(h: bytes) -> int:
        found = expected.get(h)
        if found is None:
            found = expected[h] = block_checksum(content(h))
        return found

    latencies = array.array("d")
    counts = {"loads": 0, "verified": 0, "stored": 0, "errors": 0, "wrong": 0}
    kinds: set[str] = set()
    client = TierdClient(socket_path=args.socket, timeout=30.0)
    engine = client.register_engine(layout, f"soak-{args.client}")
    arena = ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
    geometry = engine.geometry

    def timed(call: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            latencies.append(time.perf_counter() - t0)

    while time.time() < args.until:
        hashes = rng.choice(chains)
        try:
            got = timed(lambda: client.acquire(engine.engine_id, hashes, count_lookup=True))
            counts["loads"] += 1
            for h, slot, checksum in zip(hashes, got.slot_ids, got.checksums):
                view = arena.view(geometry.offset(slot), size)
                if checksum != checksum_of(h) or block_checksum(view) != checksum:
                    counts["wrong"] += 1
                counts["verified"] += 1
            if got.num_blocks:
                timed(lambda: client.release(engine.engine_id, got.lease_id))
            rest = hashes[got.num_blocks:]
            if rest:
                res = timed(lambda: client.reserve(engine.engine_id, rest))
                for h, slot in zip(rest, res.slot_ids):
                    if slot is not None:
                        arena.view(geometry.offset(slot), size)[:] = content(h)
                written = [slot is not None for slot in res.slot_ids]
                counts["stored"] += timed(lambda: client.commit(engine.engine_id, res.lease_id,
                                                                written))
        except grpc.RpcError as exc:
            counts["errors"] += 1
            kinds.add(f"{exc.code().name}: {(exc.details() or '')[:80]}")
    client.unregister_engine(engine.engine_id)
    client.close()
    arena.close()
    with open(args.out, "w") as f:
        json.dump({**counts, "error_kinds": sorted(kinds), "latencies": list(latencies)}, f)
    return 0


def _layout(block_bytes: int) -> Layout:
    """A float16 layout of 16 tokens, 2 KV heads of 64, with as many layers as make
    ``block_bytes`` (a multiple of 8 KiB)."""
    from tierd.wire.layout import Layout

    per_layer = 2 * 2 * 64 * 16 * 2
    if block_bytes % per_layer:
        raise ValueError(f"--block-kib must be a multiple of {per_layer >> 10}")
    return Layout(num_layers=block_bytes // per_layer, num_kv_heads=2, head_size=64,
                  dtype="float16", block_size=16, model_id="bench-soak@synthetic")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tierd bench soak", description=HELP)
    configure(parser)
    sys.exit(run(parser.parse_args()))
