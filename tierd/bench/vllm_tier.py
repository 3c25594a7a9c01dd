"""`tierd bench vllm-tier`: TierdTier beside vLLM's own ``fs`` tier, inside vLLM's native tiered
offloading, on the same disk, in one run.

Both tiers run under vLLM 0.33's real ``TieringOffloadingSpec(...).get_manager()`` (its CPU
primary tier in ``/dev/shm``), driven as vLLM's scheduler drives it (``prepare_store`` /
``complete_store``; per step a prefix lookup of every chunk, then ``on_schedule_end``, polled
every 0.5 ms). A Llama-3-8B-shaped prefix: 2,048 tokens, 128 chunks of 2 MiB (256 MiB). Engine A
stores, engine B (another manager, its own primary region) loads. Interleaved repetitions of:

1. memcpy: the same 128 rows copied between two ranges of A's primary region (the limit);
   and, no target, the floor of any tier in vLLM's manager: a store and a DRAM load through
   ``MemcpyTier`` (``vllm_memcpy_tier``: one memcpy on vLLM's scheduler thread, nothing else);
2. store: ``complete_store`` until the tier's job is reported done (the primary rows are free);
   for TierdTier also until the daemon can serve the blocks (its Commit landed), no target.
   Engine A has stored one prefix before (unmeasured), as a running engine has: TierdTier's
   first store Reserves its slots, later ones copy into blank slots reserved after the last;
3. DRAM load: B's lookups and promotion until every chunk is a primary-tier HIT (tierd: from
   its DRAM arena; fs: whatever its files cost right after the store). Rows 2 and 3 use a
   daemon without an SSD tier, as ``tierd bench vllm`` does: on 2 cores the write-behind of
   earlier repetitions would otherwise share the CPU with the copy measured;
4. cold load: blocks only on disk (tierd: a second `tierd serve` that demotes every block to
   SSD at once), a fresh engine B per tier, the page cache dropped once, then the two tiers'
   loads back to back, which goes first alternating (a shared disk's speed swings within
   minutes; adjacent loads see the same disk);
5. load after a restart: that daemon restarted (SIGTERM, then a new one on the same SSD
   directory), the same blocks, a fresh engine; fs: a fresh engine on the same directory
   (alternating as in 4);
6. the raw cold read of the same bytes from the same disk (``measure_raw_disk``).

Then the footprint after writing 3x tierd's bound (DRAM + SSD bytes of a third daemon) through
each tier. Targets: store and DRAM load <= 1.2x memcpy, cold load <= 1.3x the raw read, and
TierdTier no worse than fs on any row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

from tierd.bench.page_cache import drop_page_cache
from tierd.bench.tierd_serve import TierdServe

HELP = ("TierdTier vs vLLM's fs tier under vLLM's native offloading: store, loads, footprint; "
        "the floor of any tier (one memcpy) beside them.")

LAYERS, HEADS, HEAD, BLOCK = 32, 8, 128, 16  # Llama-3-8B, fp16: 2 MiB per 16-token block
CHUNK = 2 * LAYERS * HEADS * HEAD * BLOCK * 2
TARGET_COPY, TARGET_COLD = 1.2, 1.3
ROWS = ("store", "dram_load", "cold_load", "restart_load")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=128, help="chunks of 2 MiB (128: 2k tokens)")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved repetitions (5)")
    parser.add_argument("--dir", default=None, help="directory on the disk both tiers use "
                        "(default: under the tierd cache dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    from tierd.daemon.config import cache_dir

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    base = args.dir or str(cache_dir() / "bench")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tierd-bench-tier-", dir=base)
    socks = tempfile.mkdtemp(prefix="tierd-t")
    nbytes = args.chunks * CHUNK
    slab = 64 << 20
    dram = (-(-4 * nbytes // slab) + 2) * slab  # room for 4 prefixes: A's stock is <= 1/4 of it
    need = (args.repeat + 3) * nbytes * 3 + (2 << 30)
    if need > shutil.disk_usage(base).free:
        raise SystemExit(f"need ~{need >> 20} MiB free on {base}: pass --dir, fewer --repeat")
    daemons = {"dram": _daemon(work, socks, "dram", dram, "", 0, demote=False),
               "ssd": _daemon(work, socks, "ssd", dram, os.path.join(work, "ssd-cold"),
                              (args.repeat + 3) * nbytes, demote=True),
               "bound": _daemon(work, socks, "bound", 2 * slab, os.path.join(work, "ssd-bound"),
                                4 * slab, demote=False)}
    try:
        for d in daemons.values():
            d.start(timeout=300)
        figures = _measure(args, daemons, work, nbytes)
    finally:
        for d in daemons.values():
            d.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(socks, ignore_errors=True)
    figures.update(chunks=args.chunks, bytes=nbytes)
    return _report(figures, args.json)


def _daemon(work: str, socks: str, name: str, dram: int, ssd: str, ssd_bytes: int,
            demote: bool) -> TierdServe:
    """A `tierd serve` on a socket of its own; ``restart`` stops it with SIGTERM (DRAM blocks
    go to SSD) and starts it again on the same SSD directory (``demote``: every committed block
    goes to SSD, leaving DRAM, at the next 50 ms pass)."""
    flags = ["--dram-bytes", str(dram), "--slab-bytes", "64MiB", "--ssd-dir", ssd]
    if ssd:
        flags += ["--ssd-bytes", str(ssd_bytes)]
    if demote:
        flags += ["--dram-high-watermark", "1e-9", "--dram-low-watermark", "1e-9",
                  "--maintain-seconds", "0.05"]
    return TierdServe(work, flags, socket_path=os.path.join(socks, f"{name}.sock"))


class _Engine:
    """One engine's offloading manager with one secondary tier, driven as vLLM's scheduler."""

    def __init__(self, tier: dict[str, Any], chunks: int) -> None:
        import numpy as np
        import torch
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=names,
                                          group_id=0),),
            worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": (2 * chunks + 8) * CHUNK,
                          "secondary_tiers": [tier]},
            engine_id=f"tierd-bench-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name="bench-llama3-8b", dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False))
        self.manager = TieringOffloadingSpec(config).get_manager()
        self.tier = self.manager.secondary_tiers[0]
        if hasattr(self.tier, "connect"):  # TierdTier: registered and mapped before requests,
            assert self.tier.connect(), "no tierd daemon"  # as a long-running engine is
        self.rows = torch.from_numpy(
            np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8))
        self.rows[:chunks].random_()  # what the stores carry (incompressible, like fp16 KV)
        self._n = 0

    def _ctx(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._n += 1
        return ReqContext(req_id=f"r{self._n}")

    def _step(self) -> bool:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
            return bool(self.manager.has_pending_work())

    def store(self, keys: list[bytes]) -> float:
        """Seconds from ``complete_store`` until the manager has the tier's job result (the
        primary rows are free again; TierdTier's Commit may still be on its way)."""
        ctx = self._ctx()
        with self.manager.lock:
            self.manager.on_new_request(ctx)
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None and len(out.keys_to_store) == len(keys)
            start = time.perf_counter()
            self.manager.complete_store(keys, ctx, True)
            self.manager.on_request_finished(ctx)
        while True:
            self._step()
            with self.manager.lock:
                if not self.manager._jobs:  # the manager's in-flight transfer jobs
                    break
            time.sleep(0.0005)
        elapsed = time.perf_counter() - start
        while self._step():
            time.sleep(0.0005)
        return elapsed

    def load(self, keys: list[bytes]) -> float:
        """Seconds from a new request's first lookup until every chunk is a primary HIT."""
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self._ctx()
        start = time.perf_counter()
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        while True:
            hits = 0
            with self.manager.lock:
                for key in keys:
                    result = self.manager.lookup(key, ctx)
                    if result is LookupResult.MISS:
                        break
                    hits += result is LookupResult.HIT
            if hits == len(keys):
                break
            assert result is not LookupResult.MISS, f"chunk {hits} missed"
            self._step()
            time.sleep(0.0005)
        elapsed = time.perf_counter() - start
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        while self._step():
            time.sleep(0.0005)
        return elapsed

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()


def _tierd(sock: str) -> dict[str, Any]:
    return {"type": "TierdTier", "module_path": "tierd.connector.vllm.tier", "socket_path": sock,
            "retry_seconds": 0.0, "timeout_seconds": 60.0, "model_id": "bench-llama3-8b@synthetic"}


def _cold_tier(name: str, daemons: dict[str, TierdServe], fs_root: str) -> dict[str, Any]:
    """The tier of the cold rows: TierdTier on the daemon that demotes everything to SSD, or fs."""
    return _tierd(daemons["ssd"].socket_path) if name == "tierd" else _fs(fs_root)


def _floor() -> dict[str, Any]:
    return {"type": "MemcpyTier", "module_path": "tierd.bench.vllm_memcpy_tier"}


def _clear_floor() -> None:
    from tierd.bench.vllm_memcpy_tier import CHUNKS

    CHUNKS.clear()


def _fs(root: str) -> dict[str, Any]:
    return {"type": "fs", "root_dir": root}


def _keys(n: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(os.urandom(32), 0) for _ in range(n)]


def wait_on_ssd(layout: Any, sock: str, keys: list[bytes]) -> None:
    """Until the daemon on ``sock`` holds every one of a tier's ``keys`` (its ``layout``) on
    SSD and no longer in DRAM (a daemon that demotes everything)."""
    from tierd.connector.vllm.tier.layout import daemon_hash
    from tierd.wire.client import TierdClient

    with TierdClient(socket_path=sock, timeout=30) as client:
        probe = client.register_engine(layout, "bench-probe").engine_id
        hashes = [daemon_hash(k) for k in keys]
        deadline = time.monotonic() + 300
        while client.lookup(probe, hashes) != ["ssd"] * len(keys):
            assert time.monotonic() < deadline, "blocks did not reach SSD in 300 s"
            time.sleep(0.05)
        client.unregister_engine(probe)


def _wait_visible(engine: _Engine, sock: str, keys: list[bytes], start: float) -> float:
    from tierd.connector.vllm.tier.layout import daemon_hash
    from tierd.wire.client import TierdClient

    with TierdClient(socket_path=sock, timeout=30) as client:
        probe = client.register_engine(engine.tier._layout, "bench-probe").engine_id
        hashes = [daemon_hash(k) for k in keys]
        while len(client.lookup(probe, hashes)) < len(keys):
            time.sleep(0.0005)
        seconds = time.perf_counter() - start
        client.unregister_engine(probe)
    return seconds


def _measure(args: argparse.Namespace, daemons: dict[str, TierdServe], work: str,
             nbytes: int) -> dict[str, Any]:
    from tierd.daemon.ssd.rawdisk import measure_raw_disk

    n = args.chunks
    fs_root = os.path.join(work, "fs")
    out: dict[str, list[float]] = {}

    def put(key: str, seconds: float) -> None:
        out.setdefault(key, []).append(seconds * 1e3)

    for rep in range(args.repeat + 1):  # round 0 warms up
        record = put if rep else (lambda key, seconds: None)
        a, b = _Engine(_floor(), n), _Engine(_floor(), n)  # vLLM's manager + one memcpy
        a.store(_keys(n))  # A has stored before, as a running engine has
        keys = _keys(n)
        record("floor_store", a.store(keys))
        record("floor_dram_load", b.load(keys))
        a.close()
        b.close()
        _clear_floor()
        for name in ("tierd", "fs"):
            tier = _tierd(daemons["dram"].socket_path) if name == "tierd" else _fs(fs_root)
            a, b = _Engine(tier, n), _Engine(tier, n)
            start = time.perf_counter()
            a.rows[n:2 * n].copy_(a.rows[:n])
            record("memcpy", time.perf_counter() - start)
            a.store(_keys(n))  # A has stored before, as a running engine has
            keys = _keys(n)
            start = time.perf_counter()
            record(f"{name}_store", a.store(keys))
            if name == "tierd":
                record("tierd_visible",
                       _wait_visible(a, daemons["dram"].socket_path, keys, start))
            record(f"{name}_dram_load", b.load(keys))
            a.close()
            b.close()
        # cold loads: both tiers' blocks on disk, one drop of the page cache, then the two
        # loads back to back, which goes first alternating, so that a shared disk slowing down
        # for a while (seen here: 0.7-2.7 GB/s within minutes) slows both
        cold, fresh = {}, {}
        for name in ("tierd", "fs"):
            a = _Engine(_cold_tier(name, daemons, fs_root), n)
            cold[name] = _keys(n)
            a.store(cold[name])
            if name == "tierd":
                wait_on_ssd(a.tier._layout, daemons["ssd"].socket_path, cold[name])
            a.close()
            fresh[name] = _Engine(_cold_tier(name, daemons, fs_root), n)
        drop_page_cache()
        for name in ("tierd", "fs")[::1 if rep % 2 else -1]:
            record(f"{name}_cold_load", fresh[name].load(cold[name]))
            fresh[name].close()
        daemons["ssd"].restart()
        for name in ("tierd", "fs")[::1 if rep % 2 else -1]:
            engine = _Engine(_cold_tier(name, daemons, fs_root), n)
            record(f"{name}_restart_load", engine.load(cold[name]))
            engine.close()
        drop_page_cache()
        _, read_gbs = measure_raw_disk(work, nbytes)
        record("raw_read", nbytes / (read_gbs * 1e9))
    figures: dict[str, Any] = {"page_cache_dropped": drop_page_cache()}
    for key, values in out.items():
        figures[f"{key}_ms"] = statistics.median(values)
        figures[f"{key}_range_ms"] = [min(values), max(values)]
    figures.update(_footprint(daemons["bound"], os.path.join(work, "ssd-bound"),
                              os.path.join(work, "fs-bound")))
    return figures


def _footprint(daemon: TierdServe, ssd_dir: str, fs_root: str) -> dict[str, Any]:
    """Write 3x the bound daemon's DRAM + SSD bytes through each tier; bytes each then holds."""
    from tierd.wire.client import TierdClient

    with TierdClient(socket_path=daemon.socket_path, timeout=30) as client:
        bound = sum(t.capacity_bytes for t in client.stats().tiers if t.tier in ("dram", "ssd"))
    batch = 32
    for name in ("tierd", "fs"):
        engine = _Engine(_tierd(daemon.socket_path) if name == "tierd" else _fs(fs_root), batch)
        for _ in range(-(-3 * bound // (batch * CHUNK))):
            engine.store(_keys(batch))
        engine.close()
    time.sleep(1.0)  # the write-behind and demotion settle
    with TierdClient(socket_path=daemon.socket_path, timeout=30) as client:
        held = sum(t.used_bytes for t in client.stats().tiers if t.tier in ("dram", "ssd"))
    return {"bound_bytes": bound, "written_bytes": 3 * bound, "tierd_footprint_bytes": held,
            "tierd_disk_bytes": _du(ssd_dir), "fs_footprint_bytes": _du(fs_root)}


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _report(f: dict[str, Any], as_json: bool) -> int:
    memcpy, raw = f["memcpy_ms"], f["raw_read_ms"]
    limits = {"store": (memcpy, TARGET_COPY), "dram_load": (memcpy, TARGET_COPY),
              "cold_load": (raw, TARGET_COLD), "restart_load": (raw, TARGET_COLD)}
    ok = f["tierd_footprint_bytes"] <= f["bound_bytes"]
    for row in ROWS:
        base, target = limits[row]
        f[f"tierd_{row}_ratio"] = f[f"tierd_{row}_ms"] / base
        f[f"fs_{row}_ratio"] = f[f"fs_{row}_ms"] / base
        ok &= f[f"tierd_{row}_ms"] <= f[f"fs_{row}_ms"]
        if row != "restart_load":
            ok &= f[f"tierd_{row}_ratio"] <= target
    if as_json:
        print(json.dumps({**f, "ok": ok}, indent=2))
        return 0 if ok else 1
    print(f"{f['chunks']} chunks of 2 MiB = {f['bytes'] >> 20} MiB (Llama-3-8B, 2k tokens), "
          "vLLM 0.33 TieringOffloadingSpec; medians (ranges), shared 2-core host")
    print(f"  memcpy of the same bytes        {memcpy:8.1f} ms  raw cold read {raw:8.1f} ms")
    print(f"  {'row':<14} {'TierdTier':>22} {'fs tier':>22}   target")
    for row in ROWS:
        base, target = limits[row]
        cells = []
        for name in ("tierd", "fs"):
            lo, hi = f[f"{name}_{row}_range_ms"]
            cells.append(f"{f[f'{name}_{row}_ms']:7.1f} ({f[f'{name}_{row}_ratio']:.2f}x)")
        what = "memcpy" if base is memcpy else "raw read"
        limit = f"<= {target}x {what}" if row != "restart_load" else "(no target)"
        print(f"  {row:<14} {cells[0]:>22} {cells[1]:>22}   {limit}; tierd <= fs")
    print(f"  tierd store until servable (Commit landed): {f['tierd_visible_ms']:.1f} ms")
    floor = {row: f[f"floor_{row}_ms"] for row in ("store", "dram_load")}
    print(f"  floor (vLLM's manager + one memcpy, MemcpyTier): store {floor['store']:.1f} ms "
          f"({floor['store'] / memcpy:.2f}x), DRAM load {floor['dram_load']:.1f} ms "
          f"({floor['dram_load'] / memcpy:.2f}x); TierdTier / floor: store "
          f"{f['tierd_store_ms'] / floor['store']:.2f}x, DRAM load "
          f"{f['tierd_dram_load_ms'] / floor['dram_load']:.2f}x (no target)")
    print(f"  footprint after writing {f['written_bytes'] >> 20} MiB (3x tierd's bound of "
          f"{f['bound_bytes'] >> 20} MiB): tierd {f['tierd_footprint_bytes'] >> 20} MiB "
          f"(SSD files {f['tierd_disk_bytes'] >> 20} MiB), fs {f['fs_footprint_bytes'] >> 20} MiB")
    if not f["page_cache_dropped"]:
        print("  (page cache not dropped: not root)")
    print("ok" if ok else "MISSED a target")
    return 0 if ok else 1
