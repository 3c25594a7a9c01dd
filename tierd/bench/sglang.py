"""`tierd bench sglang`: tierd as SGLang HiCache's L3 storage, per 128-page batch, beside memcpy
and SGLang's own `file` backend on the same disk.

An SGLang host pool (SGLang's ``MHATokenToKVPoolHost``, ``--hicache-mem-layout`` page_first by
default) at a real model's shape (Llama-3-8B, one TP rank: 32 layers, 8 KV heads, head 128,
fp16; page 16 = 2 MiB a page, 256 MiB a batch), the batch SGLang's controller hands a storage
backend (``STORAGE_BATCH_SIZE`` = 128 pages). Interleaved repetitions of:

1. memcpy: the batch's bytes copied between two page ranges of the same host pool, the faster
   of a torch copy (all threads) and a plain memcpy (the limit), into destination pages just
   cleared, as each get below is (so the limit and the gets find the destination alike);
2. set: tierd ``batch_set_v1`` (Reserve, copy, the Commit sent: what SGLang's backup thread
   waits for) beside the `file` backend's ``batch_set`` of SGLang's flat pages (what SGLang's
   controller calls for it: one file per page, written and renamed); and, no target, tierd's
   set until the Commit landed (the daemon checksummed the pages: other engines see them);
3. get from DRAM / the page cache: ``batch_exists`` + tierd ``batch_get_v1`` (Lookup, Acquire,
   verify while copying into the host pages, Release) beside `file`'s ``batch_exists`` +
   ``batch_get`` + ``set_from_flat_data_page`` (SGLang's non-v1 path) of pages still in the page
   cache;
4. get from disk: the same from a daemon that demoted every page to its SSD tier (read with
   O_DIRECT) beside `file` with its files written back and dropped from the page cache
   (``fsync``, ``posix_fadvise``), and a raw cold read of the same bytes from the same disk
   (``measure_raw_disk``, for reference).

Every get is checked byte for byte in the first (warm-up) round. Targets: tierd's DRAM get and
its set <= 1.3x memcpy; tierd faster than `file` on every row. Needs SGLang: `make bench-sglang`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tierd.bench.tierd_serve import copy_bench_daemons

HELP = "SGLang HiCache storage: 128-page get/set through tierd vs memcpy and SGLang's file backend."

MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b-tp8": (80, 1, 128)}
"""Preset -> (layers, KV heads per rank, head size), fp16."""
TARGET = 1.3
LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b",
                        help="model shape per TP rank (llama3-8b: 2 MiB pages of 16 tokens)")
    parser.add_argument("--pages", type=int, default=128, help="pages per batch (128: SGLang's "
                        "STORAGE_BATCH_SIZE)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (16)")
    parser.add_argument("--layout", choices=LAYOUTS, default="page_first",
                        help="--hicache-mem-layout of the host pool (page_first)")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved repetitions (5)")
    parser.add_argument("--dir", default=None, help="directory on the disk both backends use "
                        "(default: under the tierd cache dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        import sglang  # noqa: F401
    except ImportError:
        raise SystemExit("tierd bench sglang needs SGLang: run `make bench-sglang`") from None
    import torch

    from tierd.daemon.config import cache_dir

    if args.pages < 1 or args.repeat < 1 or args.page_size < 16:
        raise SystemExit("need --pages >= 1, --repeat >= 1 and --page-size >= 16")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    layers, heads, head = MODELS[args.model]
    page_bytes = 2 * layers * heads * head * args.page_size * 2
    nbytes = args.pages * page_bytes
    base = args.dir or str(cache_dir() / "bench")
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tierd-bench-sglang-", dir=base)
    socks = tempfile.mkdtemp(prefix="tierd-b")
    ssd_bound = (args.repeat + 2) * nbytes + (256 << 20)
    free = shutil.disk_usage(base).free
    if ssd_bound + (args.repeat + 2) * nbytes > free:
        raise SystemExit(f"tierd's SSD tier and the file backend need {2 * ssd_bound >> 20} MiB "
                         f"on {base}, {free >> 20} MiB are free: pass a smaller --repeat or "
                         "--pages, or --dir on a larger disk")
    slab = 64 << 20
    dram = (-(-nbytes // slab) + 2) * slab
    try:
        daemons = copy_bench_daemons(workdir, socks, dram, ssd_bound)
        try:
            figures = _measure(args, (layers, heads, head), socks, workdir)
        finally:
            for daemon in daemons.values():
                daemon.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(socks, ignore_errors=True)
    import sglang as sgl

    figures.update(model=args.model, pages=args.pages, page_size=args.page_size,
                   layout=args.layout, bytes=nbytes, sglang=sgl.__version__)
    return _report(figures, args.json)


def _host_pool(shape: tuple[int, int, int], pages: int, page: int, layout: str) -> Any:
    """SGLang's MHA host pool holding two batches (source and destination pages)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    layers, heads, head = shape
    k = tuple(torch.zeros(page, heads, head, dtype=torch.float16) for _ in range(layers))
    v = tuple(torch.zeros(page, heads, head, dtype=torch.float16) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                          layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=head, v_head_dim=head, dtype=torch.float16,
        device=torch.device("cpu"))
    # SGLang's own check keeps 10 GB of the host free; the benchmark books its pool outright.
    with host_memory_budget_scope(1 << 40):
        host = MHATokenToKVPoolHost(info, 1.0, 0, page, layout, pin_memory=False,
                                    device="cpu", device_capacity_tokens=page, start_layer=0,
                                    end_layer=layers, host_token_capacity=2 * pages * page)
    host.kv_buffer.view(-1).view(torch.int16).random_()
    return host


def _storage_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name="bench",
                                extra_config=extra)


class _File:
    """SGLang's `file` backend as its controller drives it (the non-v1 page functions)."""

    def __init__(self, host: Any, directory: str) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        self.host, self.directory = host, directory
        self.storage = HiCacheFile(_storage_config({"file_storage_path": directory}))

    def set(self, keys: list[str], indices: Any) -> bool:
        page = self.host.page_size
        data = [self.host.get_data_page(indices[i * page]) for i in range(len(keys))]
        return bool(self.storage.batch_set(keys, data))

    def get(self, keys: list[str], indices: Any) -> int:
        hits = self.storage.batch_exists(keys)
        targets = [self.host.get_dummy_flat_data_page() for _ in keys[:hits]]
        pages = self.storage.batch_get(keys[:hits], targets)
        for i, data in enumerate(pages):
            if data is None:
                return i
            self.host.set_from_flat_data_page(indices[i * self.host.page_size], data)
        return len(pages)

    def drop_cache(self) -> None:
        """Evict the backend's files from the page cache: written back first (``fsync``), since
        ``POSIX_FADV_DONTNEED`` leaves dirty pages where they are."""
        for path in sorted(Path(self.directory).glob("*.bin")):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Tierd:
    """tierd's backend on one daemon, registered with the host pool."""

    def __init__(self, host: Any, sock: str) -> None:
        from tierd.connector.sglang import TierdHiCacheStorage

        self.storage = TierdHiCacheStorage(_storage_config(
            {"interface_v1": 1, "socket_path": sock, "timeout_seconds": 120.0,
             "retry_seconds": 0.0, "model_id": "bench-sglang@synthetic"}))
        self.storage.register_mem_pool_host(host)

    def set(self, keys: list[str], indices: Any) -> bool:
        return all(self.storage.batch_set_v1(keys, indices))

    def get(self, keys: list[str], indices: Any) -> int:
        hits = self.storage.batch_exists(keys)
        return sum(self.storage.batch_get_v1(keys[:hits], indices))

    def wait_on_ssd(self, keys: list[str]) -> None:
        from tierd.connector.sglang.storage import _hashes

        session = self.storage._session()
        assert session is not None, "the SSD daemon is down"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            tiers = session.client.lookup(session.engine_id, _hashes(keys))
            if tiers == ["ssd"] * len(keys):
                return
            time.sleep(0.05)
        raise SystemExit("pages did not reach the SSD tier in 300 s")


def _measure(args: argparse.Namespace, shape: tuple[int, int, int], socks: str,
             workdir: str) -> dict[str, Any]:
    import torch

    from tierd.daemon.ssd.rawdisk import measure_raw_disk

    pages, page = args.pages, args.page_size
    host = _host_pool(shape, pages, page, args.layout)
    nbytes = host.kv_buffer.numel() * host.kv_buffer.element_size() // 2
    src = torch.arange(0, pages * page, dtype=torch.int64)
    dst = torch.arange(pages * page, 2 * pages * page, dtype=torch.int64)
    dram, ssd = _Tierd(host, os.path.join(socks, "dram.sock")), _Tierd(
        host, os.path.join(socks, "ssd.sock"))
    files = _File(host, os.path.join(workdir, "file"))
    rows = ("memcpy", "tierd_set", "tierd_visible", "file_set", "tierd_get", "file_get",
            "tierd_ssd_get", "file_cold_get", "raw_read")
    out: dict[str, list[float]] = {k: [] for k in rows}

    def timed(fn: Any, *a: Any) -> tuple[float, Any]:
        start = time.perf_counter()
        result = fn(*a)
        return time.perf_counter() - start, result

    def check(name: str, got: int) -> None:
        assert got == pages, f"{name}: {got} of {pages} pages loaded"
        same = all(host.get_data_page(int(dst[i * page])).view(torch.uint8).equal(
            host.get_data_page(int(src[i * page])).view(torch.uint8)) for i in range(pages))
        assert same, f"{name} did not bring back the stored bytes"

    for rep in range(args.repeat + 1):  # round 0 warms up and checks the bytes
        figures: dict[str, float] = {}
        # The limit: the faster of torch's threaded copy and a plain memcpy (torch's threads
        # stall on a loaded host, a single-threaded memcpy is slower on an idle one), each into
        # destination pages just cleared, as every get below copies into.
        copies = []
        for use_torch in (True, False):
            _clear(host, dst)
            copies.append(timed(lambda: _memcpy(host, pages * page, use_torch=use_torch))[0])
        figures["memcpy"] = min(copies)
        keys = [os.urandom(32).hex() for _ in range(pages)]
        figures["tierd_set"], ok = timed(dram.set, keys, src)
        figures["tierd_visible"] = figures["tierd_set"] + timed(dram.storage.flush)[0]
        assert ok, "tierd did not store every page"
        _clear(host, dst)
        figures["tierd_get"], got = timed(dram.get, keys, dst)
        if rep == 0:
            check("tierd DRAM get", got)
        figures["file_set"], ok = timed(files.set, keys, src)
        assert ok, "the file backend did not store every page"
        _clear(host, dst)
        figures["file_get"], got = timed(files.get, keys, dst)
        if rep == 0:
            check("file get", got)
        cold = [os.urandom(32).hex() for _ in range(pages)]
        assert ssd.set(cold, src), "tierd (SSD daemon) did not store every page"
        ssd.wait_on_ssd(cold)
        _clear(host, dst)
        figures["tierd_ssd_get"], got = timed(ssd.get, cold, dst)
        if rep == 0:
            check("tierd SSD get", got)
        files.drop_cache()
        _clear(host, dst)
        figures["file_cold_get"], got = timed(files.get, keys, dst)
        if rep == 0:
            check("file cold get", got)
            continue
        _, read_gbs = measure_raw_disk(workdir, nbytes)  # the disk's limit, for the SSD rows
        figures["raw_read"] = nbytes / (read_gbs * 1e9)
        for key, value in figures.items():
            out[key].append(value * 1e3)
    result: dict[str, Any] = {}
    for key, values in out.items():
        result[f"{key}_ms"] = statistics.median(values)
        result[f"{key}_range_ms"] = [min(values), max(values)]
    return result


def _memcpy(host: Any, tokens: int, *, use_torch: bool) -> None:
    """The batch's bytes from the first ``tokens`` host slots to the next ``tokens``, one copy
    per contiguous byte range of the layout (K and V; and per layer for layer_first): a torch
    copy (all threads) or a plain memcpy (numpy, one thread)."""
    import torch

    buf = host.kv_buffer
    flat = buf.view(-1).view(torch.uint8)
    if host.layout == "layer_first":  # [2, L, size, H, D]: a range per (K/V, layer)
        ranges, row = buf.shape[0] * buf.shape[1], buf[0, 0].numel() * buf.element_size()
        chunk = tokens * buf[0, 0, 0].numel() * buf.element_size()
    else:  # [2, size or pages, ...]: a range for K, one for V
        ranges, row = 2, buf[0].numel() * buf.element_size()
        chunk = row // 2
    data = flat if use_torch else flat.numpy()
    for r in range(ranges):
        at = r * row
        if use_torch:
            data[at + chunk:at + 2 * chunk].copy_(data[at:at + chunk])
        else:
            data[at + chunk:at + 2 * chunk] = data[at:at + chunk]


def _clear(host: Any, indices: Any) -> None:
    """Zero the destination pages (so a get that copied nothing cannot pass the check)."""
    page = host.page_size
    zero = host.get_dummy_flat_data_page()
    for i in range(0, len(indices), page):
        host.set_from_flat_data_page(int(indices[i]), zero)


def _report(f: dict[str, Any], as_json: bool) -> int:
    memcpy = f["memcpy_ms"]
    ratios = {"tierd DRAM get / memcpy": f["tierd_get_ms"] / memcpy,
              "tierd set / memcpy": f["tierd_set_ms"] / memcpy}
    versus = {"set": (f["tierd_set_ms"], f["file_set_ms"]),
              "get (DRAM / page cache)": (f["tierd_get_ms"], f["file_get_ms"]),
              "get (disk, page cache dropped)": (f["tierd_ssd_get_ms"], f["file_cold_get_ms"])}
    ok = all(r <= TARGET for r in ratios.values()) and all(t < b for t, b in versus.values())
    if as_json:
        print(json.dumps({**f, "ok": ok}, indent=2))
        return 0 if ok else 1
    mib = f["bytes"] / (1 << 20)

    def line(name: str, key: str) -> str:
        lo, hi = f[f"{key}_range_ms"]
        return f"  {name:<40} {f[f'{key}_ms']:8.1f} ms  ({lo:.1f}-{hi:.1f})"

    print(f"SGLang {f['sglang']} host pool {f['layout']}, {f['model']}, {f['pages']} pages of "
          f"{f['page_size']} tokens = {mib:.0f} MiB per batch; medians (ranges)")
    print(line("memcpy of the same bytes", "memcpy"))
    print(line("tierd set (reserve, copy, commit sent)", "tierd_set"))
    print(line("  ... until visible (commit landed)", "tierd_visible"))
    print(line("file set (one file per page)", "file_set"))
    print(line("tierd get from DRAM (exists, get)", "tierd_get"))
    print(line("file get from the page cache", "file_get"))
    print(line("raw cold read of the same bytes", "raw_read"))
    print(line("tierd get from SSD (O_DIRECT)", "tierd_ssd_get"))
    print(line("file get, page cache dropped", "file_cold_get"))
    for name, ratio in ratios.items():
        verdict = "met" if ratio <= TARGET else "MISSED"
        print(f"  {name:<40} {ratio:6.2f}x  (target <= {TARGET}x: {verdict})")
    for name, (tierd, file) in versus.items():
        verdict = "met" if tierd < file else "MISSED"
        print(f"  {'tierd / file, ' + name:<40} {tierd / file:6.2f}x  (target < 1: {verdict})")
    return 0 if ok else 1
