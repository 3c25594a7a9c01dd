"""`tierd bench daemon`: the daemon's paths, each beside its physical limit, in one run.

1. Lookup round trip of a 128-block chain over gRPC on the Unix socket, beside a gRPC echo whose
   request and reply have the same sizes, served by the same daemon process through the same
   server and interceptor (the daemon runs in a child process, as in production).
   Target: p50 <= 2x echo.
2. Engine-side copy of the acquired blocks out of the shared-memory DRAM arena, beside a plain
   memcpy of the same bytes in the same block-sized pieces between private buffers.
   Target: >= 70% of memcpy.
3. SSD tier write and read of the same blocks (``SsdStore.write_many`` / ``read_many``, as the
   daemon's demotion and promotion call them: one batch each way, from and into page-aligned
   memory like the DRAM arena's slots; crash-safe records appended to segments, checksums),
   beside raw sequential disk bandwidth for the same bytes in the same directory
   (``tierd.daemon.ssd.rawdisk.measure_raw_disk``). Target: >= 70% of raw, each direction.
4. The daemon's CPU time per saving step of a vLLM worker (a Reserve of ``SAVED_BLOCKS`` small
   blocks, the KV of a small model's step, and its share of a CommitMany carrying the Commits of
   ``WINDOW_STEPS`` steps, as ``connector.vllm.connector.commits`` sends them), read by the
   daemon process itself, beside its CPU time per gRPC echo of a Reserve's sizes (the transport
   alone). On a host where the engine's threads occupy every core this CPU is taken from them.
   Target: <= 2.5 echoes (the step makes 1.25 calls: tierd's own work at most the transport's).
   A Commit per step is printed beside it, unjudged.
5. The lane (``tierd.wire.lane``, how engines on the node call): the lookup of 1. and the
   windowed saving step of 4. over the lane, beside the same over gRPC (1. to 4. call over gRPC
   alone). Targets: lookup p50 <= 0.5x gRPC's, the saving step's daemon CPU <= 0.5x gRPC's.
6. The saving step as a vLLM worker with host KV makes it (``connector.vllm.connector.
   step_stock``), over the lane: ``STOCK_STEPS`` steps write into one stock of blank slots (a
   blank Reserve of ``STOCK_SLOTS``) named in one Commit, beside the windowed step of 5.
   Target: the daemon's CPU <= ``TARGET_STOCK`` of the windowed step's.

Noise only ever adds time, so copies keep the best of a few runs. Short by default (~10-20 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

HELP = "Daemon paths vs their limits: lookup vs gRPC echo, DRAM copy vs memcpy, SSD vs raw disk."

ECHO_METHOD = "/tierd.bench.Echo/Echo"
TARGET_LOOKUP = 2.0   # lookup p50 / echo p50 at most
TARGET_COPY = 0.70    # DRAM copy / memcpy at least
TARGET_SSD = 0.70     # SSD tier / raw disk at least
TARGET_SAVE_CPU = 2.5  # daemon CPU of a saving step / of an echo at most
TARGET_LANE = 0.5     # lane / gRPC at most: lookup p50, saving step daemon CPU
TARGET_STOCK = 0.5    # stocked / windowed saving step's daemon CPU (over the lane) at most
SAVED_BLOCKS = 3      # blocks a saving step stores
WINDOW_STEPS = 4      # saving steps whose Commits one CommitMany carries
STOCK_STEPS = 8       # saving steps that write into one stock of blank slots
STOCK_SLOTS = 32      # blank slots a stock reserves (the connector's least)
CPU_METHOD = "/tierd.bench.Echo/Cpu"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=128, help="chain length and blocks copied "
                        "(128)")
    parser.add_argument("--layers", type=int, default=32, help="layers per block (32: with 8 KV "
                        "heads of 128, fp16, 16 tokens, a 2 MiB block like Llama-3-8B)")
    parser.add_argument("--calls", type=int, default=400, help="timed lookups and echoes (400)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the copy and SSD "
                        "measurements; the best of each is kept (3)")
    parser.add_argument("--dir", default=None, help="directory for the SSD part (default: a "
                        "temporary one under the tierd cache dir, on the SSD tier's disk)")
    parser.add_argument("--save-steps", type=int, default=800, help="saving steps timed in "
                        "each form, windowed and a Commit per step (800)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--serve-echo", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--arena-bytes", type=int, default=0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.serve_echo:
        asyncio.run(_serve_with_echo(args.serve_echo, args.arena_bytes))
        return 0
    from tierd.paths import cache_dir

    layout = _layout(args.layers)
    base = args.dir or str(cache_dir() / "bench")
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tierd-bench-", dir=base)
    sock = os.path.join(tempfile.mkdtemp(prefix="tierd-b"), "d.sock")
    arena_bytes = (_arena_bytes(layout.block_bytes, args.blocks)
                   + _arena_bytes(_small_layout().block_bytes, 2 * SAVED_BLOCKS * args.save_steps))
    server = subprocess.Popen([sys.executable, "-m", "tierd.bench.daemon", "--serve-echo", sock,
                               "--arena-bytes", str(arena_bytes)])
    try:
        figures = _measure(args, layout, sock, workdir)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(sock), ignore_errors=True)
    return _report(figures, args)


def _layout(layers: int) -> Any:
    from tierd.wire.layout import Layout

    return Layout(num_layers=layers, num_kv_heads=8, head_size=128, dtype="float16",
                  block_size=16, model_id="bench-daemon@synthetic")


def _small_layout() -> Any:
    """A small model's block (32 tokens, 2 layers of 2 KV heads of 64, bf16: 32 KiB), whose
    checksums cost next to nothing: a saving step's daemon CPU is the calls' own."""
    from tierd.wire.layout import Layout

    return Layout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", block_size=32,
                  model_id="bench-daemon-small@synthetic")


def _arena_bytes(block_bytes: int, blocks: int) -> int:
    slab = 64 << 20
    per_slab = max(1, slab // block_bytes)
    return (-(-blocks // per_slab) + 1) * slab


async def _serve_with_echo(sock: str, arena_bytes: int) -> None:
    """Child process: a daemon (DRAM only) with the echo service beside Tierd, until SIGTERM.
    The echo replies with the first 4 request bytes' worth (little-endian) of the request;
    ``Cpu`` with this process's CPU seconds (a float64, little-endian)."""
    import signal

    import grpc

    from tierd.daemon.config import TierdConfig
    from tierd.daemon.server import Daemon

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request[:int.from_bytes(request[:4], "little")]

    async def cpu(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return struct.pack("<d", time.process_time())

    handler = grpc.method_handlers_generic_handler(
        "tierd.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo),
                             "Cpu": grpc.unary_unary_rpc_method_handler(cpu)})
    config = TierdConfig(socket_path=sock, dram_bytes=arena_bytes, slab_bytes=64 << 20,
                         ssd_dir="", maintain_seconds=3600.0)
    daemon = await Daemon.start(config, extra_handlers=[handler])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await daemon.stop(grace=0.5)


def _measure(args: argparse.Namespace, layout: Any, sock: str, workdir: str) -> dict[str, Any]:
    import grpc

    from tierd.types import BlockHash
    from tierd.v1 import tierd_pb2 as pb
    from tierd.wire.client import TierdClient

    hashes = [BlockHash(os.urandom(32)) for _ in range(args.blocks)]
    with TierdClient(socket_path=sock, lane=False) as client, \
            TierdClient(socket_path=sock) as lane:
        client.wait_ready(timeout=120)
        engine = client.register_engine(layout, engine_name="bench")
        from tierd.wire.arena import ShmArena

        arena = ShmArena.attach(engine.arena_name, directory=engine.arena_directory,
                                prefault=True)
        payloads = _store(client, engine, arena, hashes)
        assert client.lookup(engine.engine_id, hashes) == ["dram"] * args.blocks, \
            "every stored block must be a DRAM hit"
        request = pb.LookupRequest(engine_id=engine.engine_id, block_hashes=hashes)
        reply_len = len(pb.LookupResponse(tiers=[pb.TIER_DRAM] * args.blocks).SerializeToString())
        size = len(request.SerializeToString())
        echo_request = reply_len.to_bytes(4, "little") + os.urandom(size - 4)
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            echo = channel.unary_unary(ECHO_METHOD)
            lookup_ms, echo_ms, lane_ms = _interleaved(
                [lambda: client.lookup(engine.engine_id, hashes),
                 lambda: echo(echo_request, timeout=10),
                 lambda: lane.lookup(engine.engine_id, hashes)], args.calls)
            assert lane.on_lane and not client.on_lane, "the lane must be up, gRPC apart"
            save_cpu = _save_cpu_figures(client, lane, channel, args.save_steps)
        got = client.acquire(engine.engine_id, hashes)
        copy = _copy_figures(arena, engine.geometry, got.slot_ids, payloads, args.repeat)
        client.release(engine.engine_id, got.lease_id)
        del arena
    ssd = asyncio.run(_ssd_figures(workdir, hashes, payloads, args.repeat))
    return {"blocks": args.blocks, "block_bytes": layout.block_bytes,
            "lookup_request_bytes": size, "lookup_reply_bytes": reply_len,
            "lookup_p50_ms": _pct(lookup_ms, 50), "lookup_p99_ms": _pct(lookup_ms, 99),
            "echo_p50_ms": _pct(echo_ms, 50), "echo_p99_ms": _pct(echo_ms, 99),
            "lane_lookup_p50_ms": _pct(lane_ms, 50), "lane_lookup_p99_ms": _pct(lane_ms, 99),
            **save_cpu,
            **copy, **ssd}


def _store(client: Any, engine: Any, arena: Any, hashes: list[Any]) -> list[bytes]:
    """Store every block through reserve / copy / commit; returns the payloads."""
    n = engine.geometry.slot_bytes
    payloads = [os.urandom(64) * (n // 64) for _ in hashes]
    reserved = client.reserve(engine.engine_id, hashes)
    for slot, data in zip(reserved.slot_ids, payloads):
        assert slot is not None, "the benchmark arena must hold every block"
        arena.view(engine.geometry.offset(slot), n)[:] = data
    stored = client.commit(engine.engine_id, reserved.lease_id, [True] * len(payloads))
    assert stored == len(hashes), f"stored {stored} of {len(hashes)} blocks"
    return payloads


def _save_cpu_figures(client: Any, lane: Any, channel: Any, steps: int) -> dict[str, float]:
    """Daemon CPU microseconds per saving step, windowed (``WINDOW_STEPS`` Commits in one
    CommitMany) and with a Commit per step, per echo of a Reserve's request and reply sizes
    (``client``: over gRPC), and per windowed saving step over the lane (``lane``); the four take
    turns in rounds (so load on the machine hits all alike), after a warm-up."""
    from tierd.types import BlockHash
    from tierd.v1 import tierd_pb2 as pb

    engine = client.register_engine(_small_layout(), engine_name="bench-saves")
    eid = engine.engine_id
    probe = [BlockHash(bytes(32))] * SAVED_BLOCKS
    request = pb.ReserveRequest(engine_id=eid, block_hashes=probe).SerializeToString()
    reply = pb.ReserveResponse(lease_id="x" * 32, seconds_left=30.0, slots=[
        pb.ReservedSlot(slot_id=1 << 20)] * SAVED_BLOCKS).SerializeToString()
    echo_request = len(reply).to_bytes(4, "little") + os.urandom(len(request) - 4)
    echo, cpu = channel.unary_unary(ECHO_METHOD), channel.unary_unary(CPU_METHOD)

    def reserve(caller: Any = client) -> tuple[str, list[bool], tuple[()]]:
        got = caller.reserve(eid, [BlockHash(os.urandom(32)) for _ in range(SAVED_BLOCKS)])
        assert None not in got.slot_ids, "the benchmark arena must hold every saved block"
        return got.lease_id, [True] * SAVED_BLOCKS, ()

    def windowed(n: int, caller: Any = client) -> None:
        for _ in range(n // WINDOW_STEPS):
            stored = caller.commit_many(eid, [reserve(caller) for _ in range(WINDOW_STEPS)])
            assert stored == [SAVED_BLOCKS] * WINDOW_STEPS, f"stored {stored}"

    def on_lane(n: int) -> None:
        windowed(n, lane)

    def per_step(n: int) -> None:
        for _ in range(n):
            lease_id, written, _ = reserve()
            stored = client.commit(eid, lease_id, written)
            assert stored == SAVED_BLOCKS, f"stored {stored}"

    def stocked(n: int) -> None:
        used = STOCK_STEPS * SAVED_BLOCKS
        for _ in range(n // STOCK_STEPS):
            got = lane.reserve_blank_sent(eid, STOCK_SLOTS).result()
            assert None not in got.slot_ids[:used], "the benchmark arena must hold the stock"
            written = [True] * used + [False] * (len(got.slot_ids) - used)
            names = [BlockHash(os.urandom(32)) for _ in range(used)]
            stored = lane.commit_many(eid, [(got.lease_id, written, names)])
            assert stored == [used], f"stored {stored}"

    def echoes(n: int) -> None:
        for _ in range(n):
            echo(echo_request, timeout=10)

    def daemon_cpu() -> float:
        return float(struct.unpack("<d", cpu(b"", timeout=10))[0])

    rounds, warm = 4, STOCK_STEPS
    forms = (("windowed", windowed), ("per_step", per_step), ("echo", echoes),
             ("lane", on_lane), ("stock", stocked))
    for _, fn in forms:
        fn(warm)
    spent = {name: 0.0 for name, _ in forms}
    each = max(STOCK_STEPS, steps // rounds // STOCK_STEPS * STOCK_STEPS)
    for _ in range(rounds):
        for name, fn in forms:
            start = daemon_cpu()
            fn(each)
            spent[name] += daemon_cpu() - start
    client.unregister_engine(eid)
    calls = rounds * each
    return {"save_step_cpu_us": spent["windowed"] / calls * 1e6,
            "save_step_commit_each_cpu_us": spent["per_step"] / calls * 1e6,
            "echo_cpu_us": spent["echo"] / calls * 1e6,
            "lane_save_step_cpu_us": spent["lane"] / calls * 1e6,
            "stock_save_step_cpu_us": spent["stock"] / calls * 1e6}


def _interleaved(fns: list[Any], calls: int) -> list[list[float]]:
    """Time each of ``fns`` in turn (so load on the machine hits all alike), after a warm-up;
    milliseconds per call of each."""
    for _ in range(max(20, calls // 10)):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, out in zip(fns, times):
            start = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - start) / 1e6)
    return times


def _pct(values: list[float], q: int) -> float:
    if q >= 100:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _copy_figures(arena: Any, geometry: Any, slots: list[int], payloads: list[bytes],
                  repeat: int) -> dict[str, float]:
    """GB/s of copying the acquired slots out of the arena into a private tensor (what an engine
    does before the host-to-device copy) vs the same pieces between two private tensors."""
    import torch

    n, count = geometry.slot_bytes, len(slots)
    # One thread, as a memcpy: torch's intra-op pool only adds contention for 2 MiB pieces on a
    # loaded machine (measured: 0.6-1.1 GB/s with 2 threads, 4-5 GB/s with 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src_arena = arena.as_tensor()
    private = torch.empty(n * count, dtype=torch.uint8)
    private.copy_(torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8))
    dst = torch.zeros(n * count, dtype=torch.uint8)
    offsets = [geometry.offset(s) for s in slots]

    def from_arena() -> None:
        for i, off in enumerate(offsets):
            dst[i * n:(i + 1) * n].copy_(src_arena[off:off + n])

    def memcpy_pieces() -> None:
        for i in range(count):
            dst[i * n:(i + 1) * n].copy_(private[i * n:(i + 1) * n])

    def memcpy_whole() -> None:
        dst.copy_(private)

    total = n * count
    best = _best_interleaved({"dram_copy": from_arena, "memcpy": memcpy_pieces,
                              "memcpy_contiguous": memcpy_whole}, repeat)
    from_arena()
    assert bytes(dst[:n].numpy()) == payloads[0], "the arena copy must be bit-exact"
    del src_arena
    torch.set_num_threads(threads)
    return {f"{name}_gbps": total / seconds / 1e9 for name, seconds in best.items()}


def _best_interleaved(fns: dict[str, Any], repeat: int) -> dict[str, float]:
    """Best wall time of each function over ``repeat`` rounds, the functions taking turns within
    a round (so a burst of load on the machine hits all of them alike), after one warm-up."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


async def _ssd_figures(workdir: str, hashes: list[Any], payloads: list[bytes],
                       rounds: int) -> dict[str, float]:
    """GB/s of the SSD tier writing then reading every block, and of raw sequential disk I/O of
    the same bytes in the same directory; best of ``rounds`` rounds, each of both in turn. One
    store serves every round (its blocks removed after each), as in a running daemon: the first
    round also pays for creating a segment file, later ones append to it."""
    from tierd.checksum import block_checksum
    from tierd.daemon import ssd as ssd_module
    from tierd.daemon.ssd.rawdisk import measure_raw_disk
    from tierd.types import Namespace

    total = sum(len(p) for p in payloads)
    namespace = Namespace(bytes(16))
    checksums = [block_checksum(p) for p in payloads]
    src, dst = memoryview(mmap.mmap(-1, total)), memoryview(mmap.mmap(-1, total))  # like slots
    slots: list[memoryview] = []
    into: list[memoryview] = []
    at = 0
    for p in payloads:
        src[at:at + len(p)] = p
        slots.append(src[at:at + len(p)])
        into.append(dst[at:at + len(p)])
        at += len(p)
    best = {"ssd_write": float("inf"), "ssd_read": float("inf"), "raw_write": 0.0,
            "raw_read": 0.0}
    store = ssd_module.SsdStore(os.path.join(workdir, "ssd"), 2 * total + (64 << 20))
    store.open()
    for _ in range(rounds):
        start = time.perf_counter()
        written = await store.write_many([(namespace, h, p, c)
                                          for h, p, c in zip(hashes, slots, checksums)])
        best["ssd_write"] = min(best["ssd_write"], time.perf_counter() - start)
        assert all(e is not None for e in written), "every SSD write must succeed"
        start = time.perf_counter()
        ok = await asyncio.gather(*store.read_many([(namespace, h, b)
                                                    for h, b in zip(hashes, into)]))
        best["ssd_read"] = min(best["ssd_read"], time.perf_counter() - start)
        assert all(ok) and bytes(into[0]) == payloads[0], "every SSD read must verify"
        for h in hashes:
            store.remove(namespace, h)
        raw_write, raw_read = measure_raw_disk(workdir, total)
        best["raw_write"] = max(best["raw_write"], raw_write)
        best["raw_read"] = max(best["raw_read"], raw_read)
    store.close()
    return {"ssd_write_gbps": total / best["ssd_write"] / 1e9,
            "ssd_read_gbps": total / best["ssd_read"] / 1e9,
            "raw_write_gbps": best["raw_write"], "raw_read_gbps": best["raw_read"]}


def _report(f: dict[str, Any], args: argparse.Namespace) -> int:
    checks = [
        ("lookup p50 / echo p50", f["lookup_p50_ms"] / f["echo_p50_ms"], "<=", TARGET_LOOKUP),
        ("DRAM arena copy / memcpy", f["dram_copy_gbps"] / f["memcpy_gbps"], ">=", TARGET_COPY),
        ("SSD write / raw write", f["ssd_write_gbps"] / f["raw_write_gbps"], ">=", TARGET_SSD),
        ("SSD read / raw read", f["ssd_read_gbps"] / f["raw_read_gbps"], ">=", TARGET_SSD),
        ("saving step CPU / echo", f["save_step_cpu_us"] / f["echo_cpu_us"], "<=",
         TARGET_SAVE_CPU),
        ("lane / gRPC, lookup p50", f["lane_lookup_p50_ms"] / f["lookup_p50_ms"], "<=",
         TARGET_LANE),
        ("lane / gRPC, saving CPU", f["lane_save_step_cpu_us"] / f["save_step_cpu_us"], "<=",
         TARGET_LANE),
        ("stock / window, saving CPU", f["stock_save_step_cpu_us"] / f["lane_save_step_cpu_us"],
         "<=", TARGET_STOCK),
    ]
    ok = all(r <= t if op == "<=" else r >= t for _, r, op, t in checks)
    if args.json:
        f["checks"] = {name: {"ratio": r, "target": f"{op} {t}"} for name, r, op, t in checks}
        f["pass"] = ok
        print(json.dumps(f, indent=2))
        return 0 if ok else 1
    mib = f["block_bytes"] / (1 << 20)
    print(f"{f['blocks']} blocks of {mib:.2f} MiB; lookup request {f['lookup_request_bytes']} B, "
          f"reply {f['lookup_reply_bytes']} B")
    print(f"  lookup over gRPC          p50 {f['lookup_p50_ms']:.3f} ms  p99 "
          f"{f['lookup_p99_ms']:.3f} ms")
    print(f"  gRPC echo, same sizes     p50 {f['echo_p50_ms']:.3f} ms  "
          f"p99 {f['echo_p99_ms']:.3f} ms")
    print(f"  lookup over the lane      p50 {f['lane_lookup_p50_ms']:.3f} ms  p99 "
          f"{f['lane_lookup_p99_ms']:.3f} ms")
    print(f"  copy out of DRAM arena    {f['dram_copy_gbps']:.2f} GB/s   memcpy same pieces "
          f"{f['memcpy_gbps']:.2f} GB/s (one contiguous memcpy {f['memcpy_contiguous_gbps']:.2f})")
    print(f"  daemon CPU per saving step {f['save_step_cpu_us']:.0f} us ({WINDOW_STEPS} steps' "
          f"Commits in one CommitMany; a Commit each: {f['save_step_commit_each_cpu_us']:.0f} us)"
          f"   per echo {f['echo_cpu_us']:.0f} us; over the lane "
          f"{f['lane_save_step_cpu_us']:.0f} us, into a stock {f['stock_save_step_cpu_us']:.0f} us")
    print(f"  SSD tier write / read     {f['ssd_write_gbps']:.2f} / {f['ssd_read_gbps']:.2f} GB/s"
          f"   raw disk {f['raw_write_gbps']:.2f} / {f['raw_read_gbps']:.2f} GB/s")
    for name, ratio, op, target in checks:
        good = ratio <= target if op == "<=" else ratio >= target
        print(f"  {name:<26} {ratio:6.2f}  target {op} {target}  {'ok' if good else 'MISSED'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    configure(parser)
    sys.exit(run(parser.parse_args()))
