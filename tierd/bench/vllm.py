"""`tierd bench vllm`: the vLLM connector's data path at model scale, beside its physical limits.

The connector's two halves as vLLM drives them (``SchedulerSide`` pins at lookup,
``WorkerSide`` copies), with KV tensors laid out as vLLM 0.33 allocates them (vLLM's own
``compute_layout_strides`` and ``create_kv_cache_views`` when vLLM is installed, else the same
per-layer ``[B, H, N, 2*head]`` views of one buffer built here), at a real model's shape
(Llama-3-8B by default: 32 layers, 8 KV heads, head 128, fp16, block 16) and a 2,048-token
prefix (256 MiB). Two real `tierd serve` processes: one keeps blocks in DRAM, one demotes every
committed block to SSD at once. Interleaved repetitions of:

1. memcpy: the same bytes copied between two ranges of the same KV tensors (the limit);
2. store: Reserve (``save_kv_layer`` x L), then ``wait_for_save``, which copies every layer
   into the slots and hands the Commit to the committer thread: the engine's part; and
   the time until the Commit has landed (the daemon checksums the slots): until visible;
3. DRAM load, end to end as the engine sees it: lookup + pin (scheduler side), Acquire, verify,
   copy into vLLM's tensors, Release, unpin;
4. SSD load of blocks only on SSD (page cache dropped first when allowed), as vLLM runs it on
   host KV: the lookup answers at once with an asynchronous load, the worker acquires the hit
   in 32 MiB chunks and copies each chunk as soon as the daemon has read it (``streaming``),
   until ``get_finished`` reports it; beside a raw cold read of the same bytes from the same
   disk (``measure_raw_disk``).

Prints medians and ranges, and the ratios against the targets: DRAM load <= 1.5x memcpy, the
engine's part of a store <= 1.5x memcpy (the rest is off its critical path; the time until
visible is printed beside it), SSD load <= 1.3x the raw cold read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any

from tierd.bench.page_cache import drop_page_cache
from tierd.bench.tierd_serve import copy_bench_daemons

HELP = "vLLM connector at model scale: store, DRAM and SSD loads vs memcpy and raw disk."

MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b": (80, 8, 128)}
"""Preset -> (layers, KV heads per rank, head size), fp16, GQA."""
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.33's ``KVCacheLayout`` names."""
TARGET_DRAM, TARGET_STORE, TARGET_SSD = 1.5, 1.5, 1.3
BLOCK = 16


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b",
                        help="model shape (llama3-8b: 2 MiB blocks; llama3-70b: 5 MiB)")
    parser.add_argument("--tokens", type=int, default=2048, help="prefix length (2048; "
                        "32768 for a long prompt: 4 GiB on llama3-8b, ~17 GiB RAM at peak)")
    parser.add_argument("--layout", default="LBHNC", choices=LAYOUTS,
                        help="vLLM KVCacheLayout of the engine's tensors (LBHNC: vLLM's CPU "
                        "backend; LBNHC: FlashAttention; without vLLM only these two)")
    parser.add_argument("--repeat", type=int, default=6, help="interleaved repetitions (6)")
    parser.add_argument("--dir", default=None, help="directory on the SSD tier's disk (default: "
                        "under the tierd cache dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def kv_tensors(layers: int, heads: int, head: int, num_blocks: int,
               layout_name: str) -> tuple[dict[str, Any], str]:
    """Per-layer KV views of one buffer as vLLM 0.33's worker allocates them; (views, source)."""
    import torch

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    try:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheTensor,
            compute_layout_strides,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return _own_views(names, heads, head, num_blocks, layout_name), "tierd (no vLLM)"
    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head,
                             dtype=torch.float16)
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, layers, layout, fixed_strides=(None, None, None, None, None))
    size = spec.page_size_bytes * layers * num_blocks
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.empty(size, dtype=torch.int8)
    raw.view(torch.uint8).random_()
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return dict(zip(names, views)), f"vLLM {_vllm_version()} create_kv_cache_views"


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _own_views(names: list[str], heads: int, head: int, num_blocks: int,
               layout_name: str) -> dict[str, Any]:
    import torch

    if layout_name not in ("LBHNC", "LBNHC"):
        raise SystemExit(f"without vLLM only LBHNC and LBNHC are built here, not {layout_name}")
    raw = torch.empty(len(names) * num_blocks * heads * BLOCK * 2 * head, dtype=torch.float16)
    raw.view(torch.int16).random_()
    if layout_name == "LBHNC":
        full = raw.view(len(names), num_blocks, heads, BLOCK, 2 * head)
    else:
        full = raw.view(len(names), num_blocks, BLOCK, heads, 2 * head).transpose(2, 3)
    return {name: full[i] for i, name in enumerate(names)}


def run(args: argparse.Namespace) -> int:
    import torch

    from tierd.paths import cache_dir

    if args.tokens < BLOCK or args.repeat < 1:
        raise SystemExit(f"need --tokens >= {BLOCK} (one full block) and --repeat >= 1")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    layers, heads, head = MODELS[args.model]
    blocks = -(-args.tokens // BLOCK)
    kv, source = kv_tensors(layers, heads, head, 2 * blocks + 1, args.layout)
    block_bytes = 2 * layers * heads * head * BLOCK * 2
    nbytes = blocks * block_bytes
    base = args.dir or str(cache_dir() / "bench")
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tierd-bench-vllm-", dir=base)
    socks = tempfile.mkdtemp(prefix="tierd-b")
    slab = 64 << 20
    dram = (-(-nbytes // slab) + 2) * slab
    # Room on SSD for every repetition's prefix: a full tier would evict and compact in the
    # background, beside the next repetition's measurements.
    ssd_bound = (args.repeat + 2) * nbytes + (256 << 20)
    free = shutil.disk_usage(base).free
    if ssd_bound + nbytes > free:
        raise SystemExit(f"the SSD tier needs {ssd_bound >> 20} MiB (+ the raw read's "
                         f"{nbytes >> 20} MiB) on {base}, {free >> 20} MiB are free: pass a "
                         "smaller --repeat or --tokens, or --dir on a larger disk")
    try:
        daemons = copy_bench_daemons(workdir, socks, dram, ssd_bound)
        try:
            figures = _measure(args, kv, blocks, nbytes, socks, workdir)
        finally:
            for daemon in daemons.values():
                daemon.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(socks, ignore_errors=True)
    figures.update(model=args.model, tokens=args.tokens, layout=args.layout, tensors=source,
                   bytes=nbytes)
    return _report(figures, args.json)


class _Side:
    """The connector's scheduler and worker halves on one daemon, over the engine's tensors."""

    def __init__(self, sock: str, kv: dict[str, Any]) -> None:
        from tierd.connector.core.link import DaemonLink
        from tierd.connector.vllm.config import TierdVllmConfig
        from tierd.connector.vllm.connector.scheduler import SchedulerSide
        from tierd.connector.vllm.connector.worker import WorkerSide

        config = TierdVllmConfig(socket_path=sock, timeout_seconds=60.0, retry_seconds=0.0,
                                 model_id="bench-vllm@synthetic")
        self.worker = WorkerSide(config, kv, BLOCK, "auto", 0, 1)
        link = DaemonLink(config, self.worker.link.layout, "bench-scheduler", attach=False)
        link.connect()
        self.scheduler = SchedulerSide([link], load=True, save=True, stream=True)  # host KV
        self.sock = sock

    def store(self, hashes: list[bytes], block_ids: list[int]) -> tuple[float, float]:
        """Save ``block_ids`` under ``hashes`` as vLLM's save_kv_layer x L + wait_for_save
        would; (seconds until the engine may go on, seconds until the blocks are visible)."""
        from tierd.connector.vllm.connector.metadata import SaveSpec

        saves = [SaveSpec("bench", block_ids, hashes)]
        start = time.perf_counter()
        for name in self.worker.format.layer_names:
            self.worker.save_layer(name, saves)
        self.worker.finish_save()
        copied = time.perf_counter()  # the engine's part: it may reuse its blocks now
        self.worker.flush()
        done = time.perf_counter()
        assert self.worker.take_report() is None
        return copied - start, done - start

    def load(self, hashes: list[bytes], block_ids: list[int]) -> float:
        """Lookup (+ pin for a DRAM hit), then the worker's load into ``block_ids`` (streamed
        for an SSD hit), report, unpin; seconds."""
        from tierd.connector.vllm.connector.metadata import LoadSpec, TierdConnectorMetadata

        request = SimpleNamespace(request_id="bench", num_tokens=len(hashes) * BLOCK + 1,
                                  block_hashes=hashes, num_computed_tokens=0)
        start = time.perf_counter()
        tokens = self.scheduler.num_new_matched_tokens(request, 0)
        while tokens is None:  # staged from SSD: vLLM asks again at its next step
            time.sleep(0.0005)
            tokens = self.scheduler.num_new_matched_tokens(request, 0)
        assert tokens == len(hashes) * BLOCK, f"only {tokens} tokens were a hit"
        stream = self.scheduler.streams("bench")  # an SSD hit on host KV: asynchronous
        self.worker.load(TierdConnectorMetadata(
            loads=[LoadSpec("bench", block_ids, hashes, stream=stream)]))
        while stream and "bench" not in self.worker.finished_loads(()):
            time.sleep(0.0005)  # vLLM's get_finished, polled every step
        report = self.worker.take_report()
        assert report is not None
        self.scheduler.on_worker_report(report)
        self.scheduler.finished(request)
        elapsed = time.perf_counter() - start
        assert not self.worker.take_load_errors(), "the benchmark's load failed"
        return elapsed


def _wait_on_ssd(sock: str, side: _Side, hashes: list[bytes]) -> None:
    from tierd.types import BlockHash
    from tierd.wire.client import TierdClient

    with TierdClient(socket_path=sock, timeout=30) as client:
        engine = side.worker.link.engine.engine_id
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            tiers = client.lookup(engine, [BlockHash(h) for h in hashes])
            if tiers == ["ssd"] * len(hashes):
                return
            time.sleep(0.05)
    raise SystemExit("blocks did not reach the SSD tier in 300 s")


def _measure(args: argparse.Namespace, kv: dict[str, Any], blocks: int, nbytes: int,
             socks: str, workdir: str) -> dict[str, Any]:
    import torch

    from tierd.daemon.ssd.rawdisk import measure_raw_disk

    src, dst = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    views = list(kv.values())
    dram, ssd = _Side(os.path.join(socks, "dram.sock"), kv), _Side(os.path.join(socks, "ssd.sock"),
                                                                   kv)
    out: dict[str, list[float]] = {k: [] for k in ("memcpy", "store_engine", "store", "dram_load",
                                                   "ssd_load", "raw_read")}
    dropped = False
    for rep in range(args.repeat + 1):  # round 0 warms up and checks the bytes
        start = time.perf_counter()
        for view in views:
            view[dst[0]:dst[-1] + 1].copy_(view[src[0]:src[-1] + 1])
        memcpy = time.perf_counter() - start
        hashes = [os.urandom(32) for _ in range(blocks)]
        engine_s, store_s = dram.store(hashes, src)
        for view in views:
            view[dst[0]:dst[-1] + 1].zero_()
        dram_s = dram.load(hashes, dst)
        if rep == 0:
            for view in views:
                raw = view.view(torch.uint8)  # bytes: random fp16 bits hold NaNs
                assert raw[dst[0]:dst[-1] + 1].equal(raw[src[0]:src[-1] + 1]), \
                    "a DRAM load did not bring back the stored bytes"
        cold = [os.urandom(32) for _ in range(blocks)]
        ssd.store(cold, src)
        _wait_on_ssd(ssd.sock, ssd, cold)
        dropped = drop_page_cache()
        ssd_s = ssd.load(cold, dst)
        if rep == 0:
            for view in views:
                raw = view.view(torch.uint8)
                assert raw[dst[0]:dst[-1] + 1].equal(raw[src[0]:src[-1] + 1]), \
                    "an SSD load did not bring back the stored bytes"
            continue
        drop_page_cache()
        _, read_gbs = measure_raw_disk(workdir, nbytes)
        for key, value in (("memcpy", memcpy), ("store_engine", engine_s), ("store", store_s),
                           ("dram_load", dram_s), ("ssd_load", ssd_s),
                           ("raw_read", nbytes / (read_gbs * 1e9))):
            out[key].append(value * 1e3)
    figures: dict[str, Any] = {"page_cache_dropped": dropped}
    for key, values in out.items():
        figures[f"{key}_ms"] = statistics.median(values)
        figures[f"{key}_range_ms"] = [min(values), max(values)]
    memcpy_ms = figures["memcpy_ms"]
    figures["dram_ratio"] = figures["dram_load_ms"] / memcpy_ms
    figures["store_ratio"] = figures["store_ms"] / memcpy_ms
    figures["store_engine_ratio"] = figures["store_engine_ms"] / memcpy_ms
    figures["ssd_ratio"] = figures["ssd_load_ms"] / figures["raw_read_ms"]
    return figures


def _report(f: dict[str, Any], as_json: bool) -> int:
    ok = (f["dram_ratio"] <= TARGET_DRAM and f["store_engine_ratio"] <= TARGET_STORE
          and f["ssd_ratio"] <= TARGET_SSD)
    if as_json:
        print(json.dumps({**f, "ok": ok}, indent=2))
        return 0 if ok else 1
    mib = f["bytes"] / (1 << 20)

    def line(name: str, key: str) -> str:
        lo, hi = f[f"{key}_range_ms"]
        return f"  {name:<34} {f[f'{key}_ms']:8.1f} ms  ({lo:.1f}-{hi:.1f})"

    print(f"{f['model']}, {f['tokens']} tokens = {mib:.0f} MiB, layout {f['layout']}, tensors "
          f"from {f['tensors']}; medians (ranges)")
    print(line("memcpy of the same bytes", "memcpy"))
    print(line("store, the engine's part", "store_engine"))
    print(line("store, until visible (daemon checksums)", "store"))
    print(line("DRAM load (lookup, pin, copy, verify)", "dram_load"))
    print(line("raw cold read of the same bytes", "raw_read"))
    print(line("SSD load (lookup, pin, copy, verify)", "ssd_load"))
    if not f["page_cache_dropped"]:
        print("  (page cache not dropped: not root; the SSD tier reads with O_DIRECT anyway)")
    for name, ratio, target in (("DRAM load / memcpy", f["dram_ratio"], TARGET_DRAM),
                                ("store, engine's part / memcpy", f["store_engine_ratio"],
                                 TARGET_STORE),
                                ("SSD load / raw cold read", f["ssd_ratio"], TARGET_SSD)):
        verdict = "met" if ratio <= target else "MISSED"
        print(f"  {name:<34} {ratio:6.2f}x  (target <= {target}x: {verdict})")
    print(f"  {'store until visible / memcpy':<34} {f['store_ratio']:6.2f}x  (no target: off "
          "the engine's critical path)")
    return 0 if ok else 1
