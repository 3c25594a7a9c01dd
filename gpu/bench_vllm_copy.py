"""GPU check of the connector's device path: H2D and D2H GB/s of ``DeviceTransfer``
between a registered tierd arena and GPU KV tensors laid out as vLLM 0.33 allocates them (per-
layer ``[B, H, N, K|V]`` views of one buffer), beside a pinned torch tensor's copy of the same
bytes measured in the same run (target: >= 0.80 of it). Also checks the bytes: a save, then a
load into a second buffer, round-trips bit-exact and matches the CPU path's slot bytes.

    python gpu/bench_vllm_copy.py                 # Llama-3-8B, 2,048-token prefix, LBNHC
    python gpu/bench_vllm_copy.py --layers 80     # 70B shape (GQA 8 heads)
    python gpu/bench_vllm_copy.py --dry-run       # tiny, on CPU: checks the script only

Prints medians (and ranges) of interleaved repetitions; no assertion on time.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from tierd.connector.vllm.connector.cuda_copy import (
    DeviceTransfer,
    Layerwise,
    register_host_memory,
    unregister_host_memory,
)
from tierd.connector.vllm.connector.kv_tensors import (
    Run,
    byte_view,
    runs,
    save_layer,
    slot_format,
)
from tierd.daemon.arena import OwnedArena


def kv_caches(order: str, layers: int, blocks: int, heads: int, block: int, head: int,
              device: str) -> dict[str, torch.Tensor]:
    """vLLM 0.33's per-layer ``[B, H, N, 2*head]`` views of one buffer in physical ``order``."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": block, "C": 2 * head}
    strides: dict[str, int] = {}
    total = 1
    for axis in reversed(order):
        strides[axis], total = total, total * sizes[axis]
    buffer = torch.randn(total, dtype=torch.float16, device=device)
    shape, stride = tuple(sizes[a] for a in "BHNC"), tuple(strides[a] for a in "BHNC")
    return {f"model.layers.{i}.self_attn.attn":
            torch.as_strided(buffer, shape, stride, i * strides["L"]) for i in range(layers)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--order", default="LBNHC")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        args.layers, args.heads, args.head, args.tokens, args.reps = 3, 2, 8, 64, 2
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing measured (use --dry-run to check the script on CPU)")
        return 2
    device = "cpu" if args.dry_run else "cuda"
    sync: Callable[[], None] = (lambda: None) if args.dry_run else torch.cuda.synchronize
    n = args.tokens // args.block
    kv = kv_caches(args.order, args.layers, 2 * n, args.heads, args.block, args.head, device)
    fmt, _ = slot_format(kv, args.block, "auto", 0, 1, "bench@synthetic")
    kv_bytes = [byte_view(t) for t in kv.values()]
    nbytes = n * fmt.slot_bytes
    directory = tempfile.mkdtemp(prefix="tierd-bench", dir="/dev/shm")
    shm = OwnedArena.create("arena", 2 * n * fmt.slot_bytes, directory=directory)
    arena = shm.as_tensor()
    pinned_arena = register_host_memory(arena) if not args.dry_run else False
    transfer = DeviceTransfer(arena, fmt, kv_bytes, pinned=pinned_arena,
                              max_staging_bytes=nbytes)
    dst_kv = kv_caches(args.order, args.layers, 2 * n, args.heads, args.block, args.head,
                       device)
    dst_bytes = [byte_view(t) for t in dst_kv.values()]
    loader = {mode: DeviceTransfer(arena, fmt, dst_bytes, pinned=pinned_arena,
                                   max_staging_bytes=nbytes,
                                   layerwise=mode) for mode in ("auto", "never")}
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name() if not args.dry_run else 'CPU (dry run)'}; "
          f"{args.layers} layers x {args.heads} heads x {args.head}, block {args.block}, "
          f"{n} blocks = {nbytes / 2**20:.0f} MiB, {args.order}; arena registered: "
          f"{pinned_arena}")

    gen = torch.Generator().manual_seed(0)
    perm_blocks = torch.randperm(2 * n, generator=gen)[:n].tolist()
    perm_slots = torch.randperm(2 * n, generator=gen)[:n].tolist()
    patterns: dict[str, list[Run]] = {
        "one run": runs(list(range(n)), [i * fmt.slot_bytes for i in range(n)],
                        fmt.slot_bytes),
        "scattered": runs(perm_blocks, [s * fmt.slot_bytes for s in perm_slots],
                          fmt.slot_bytes)}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=not args.dry_run)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(fn: Callable[[], None]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def save(block_runs: list[Run]) -> None:
        transfer.open_save(block_runs)
        for layer in range(args.layers):
            transfer.save_layer(layer)
        ticket = transfer.finish_save()
        assert ticket is not None
        transfer.wait_save(ticket)

    def load(mode: Layerwise, block_runs: list[Run]) -> None:
        loader[mode].start_load(block_runs)
        loader[mode].wait_load()

    def h2d() -> None:
        dev.copy_(pinned, non_blocking=True)

    def d2h() -> None:
        pinned.copy_(dev, non_blocking=True)

    cases: dict[str, Callable[[], None]] = {"H2D pinned torch copy": h2d,
                                            "D2H pinned torch copy": d2h}
    for name, block_runs in patterns.items():
        cases[f"H2D load, {name}, auto"] = functools.partial(load, "auto", block_runs)
        cases[f"H2D load, {name}, by run"] = functools.partial(load, "never", block_runs)
        cases[f"D2H save, {name}"] = functools.partial(save, block_runs)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.reps + 1):  # the first round warms up
        for name, fn in cases.items():
            times[name].append(timed(fn))

    print(f"{'path':34} {'median ms':>10} {'range ms':>16} {'GB/s':>7} {'vs pinned':>9}")
    for name, samples in times.items():
        samples = samples[1:]
        median = statistics.median(samples)
        ref = statistics.median(times[f"{name[:3]} pinned torch copy"][1:])
        verdict = "" if "pinned" in name else ("  ok" if ref / median >= 0.8 else "  < 0.80")
        print(f"{name:34} {median * 1e3:10.2f} {min(samples) * 1e3:7.2f}-"
              f"{max(samples) * 1e3:<8.2f} {nbytes / median / 1e9:7.1f} "
              f"{ref / median:9.2f}{verdict}")

    # layer 0 ready vs all layers, as the forward pass's stream sees it (layer-wise overlap)
    if not args.dry_run:
        for name, block_runs in patterns.items():
            events: list[Any] = [getattr(torch.cuda, "Event")(enable_timing=True)
                                 for _ in range(3)]
            torch.cuda.synchronize()
            events[0].record()
            loader["auto"].start_load(block_runs)
            loader["auto"].wait_layer(0)
            events[1].record()
            loader["auto"].wait_layer(args.layers - 1)
            events[2].record()
            torch.cuda.synchronize()
            print(f"load {name}: layer 0 ready at {events[0].elapsed_time(events[1]):.2f} ms, "
                  f"all at {events[0].elapsed_time(events[2]):.2f} ms")

    ok = True
    for name, block_runs in patterns.items():
        arena.zero_()
        save(block_runs)
        ref_arena = torch.zeros_like(arena)
        cpu_kv = [t.cpu() for t in kv_bytes]
        for layer in range(args.layers):
            save_layer(ref_arena, fmt, layer, cpu_kv[layer], block_runs)
        same_bytes = torch.equal(arena, ref_arena)
        for kv_layer in dst_bytes:
            kv_layer.zero_()
        load("auto", block_runs)
        ids = [r.block_id + k for r in block_runs for k in range(r.count)]
        same_blocks = all(torch.equal(a[ids], b[ids]) for a, b in zip(kv_bytes, dst_bytes))
        print(f"{name}: slot bytes as the CPU path's: {same_bytes}; round trip bit-exact: "
              f"{same_blocks}")
        ok = ok and same_bytes and same_blocks
    for each in (transfer, *loader.values()):
        each.close()
    if pinned_arena:
        unregister_host_memory(arena)
    del arena, transfer, loader
    shm.close()
    shm.unlink()
    os.rmdir(directory)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
