"""`tierd bench attention`: paged attention beside dense SDPA on the same shapes and data.

Decode: batch 32, 32 query / 8 KV heads, head 128, context 2048. Prefill: one 2048-token prompt
whose first 1024 tokens are cached, so 1024 new query tokens attend causally over 2048 keys.
The dense side runs ``scaled_dot_product_attention`` on the same K/V laid out contiguously (the
prefill with the same causal-offset mask). Paged and dense runs alternate, so machine noise hits
both alike; the verdict is the ratio of medians against the target (CPU: decode <= 2x,
prefill <= 1.25x). Where the paged path computes half precision in fp32 (a CPU without
native half-precision matmuls, ``tierd.gpu.attention.compute_dtype``), dense SDPA runs in both
dtypes and the faster is the baseline. The CuPy kernel runs only on a CUDA machine with CuPy
installed.
``--threads N`` pins both sides to N intra-op threads: on a small shared host another
process's load stalls every parallel region of the many-op paged path far more than the
single-op dense SDPA, so ``--threads 1`` gives the steadier ratio there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Literal

HELP = "Paged attention (Torch, and CuPy on CUDA) beside dense SDPA: decode and prefill ratios."

DECODE_TARGET = 2.0
PREFILL_TARGET = 1.25


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 repetitions instead of --reps")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per case")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
        help="query/KV compute dtype of both sides",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8", "fp8_e5m2"), default="auto",
        help="paged cache storage dtype (fp8 stores scaled values, upcast on load)",
    )
    parser.add_argument(
        "--block-size", type=int, choices=(8, 16, 32), default=16, help="tokens per KV block"
    )
    # Resolved in run(): configure() must not import torch (`tierd --help` stays instant).
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="torch intra-op threads for both sides (default: torch's own); on a shared host, "
        "1 keeps other processes' load from stalling every parallel region",
    )  # fmt: skip


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _time_alternating(
    fns: list[Callable[[], object]], reps: int, sync: Callable[[], None]
) -> list[float]:
    """Median seconds of each of ``fns``, measured in turn after one warm-up call of each."""
    for fn in fns:
        fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from tierd.gpu import allocate_kv_cache, paged_attention
    from tierd.gpu.attention import compute_dtype, gather_k, gather_v

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    reps = 3 if args.quick else args.reps
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device or ("cuda" if _cuda() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    heads, kv_heads, head, block = 32, 8, 128, args.block_size
    scale = head**-0.5
    gen = torch.Generator().manual_seed(0)

    def make_cache(num_seqs: int, context: int):  # type: ignore[no-untyped-def]
        per_seq = context // block
        cache = allocate_kv_cache(
            1, num_seqs * per_seq + 8, kv_heads, head, block, dtype, device, args.kv_cache_dtype
        )
        for t in (cache.k_caches[0], cache.v_caches[0]):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
        perm = torch.randperm(num_seqs * per_seq + 8, generator=gen)[: num_seqs * per_seq]
        table = perm.view(num_seqs, per_seq).to(device=device, dtype=torch.int32)
        k = gather_k(cache.k_caches[0], table.long(), dtype, 1.0)  # [n, Hk, L, D], same data
        v = gather_v(cache.v_caches[0], table.long(), dtype, 1.0).transpose(-1, -2).contiguous()
        return cache, table, k, v

    print(f"tierd bench attention: device={device} dtype={args.dtype} "
          f"kv_cache_dtype={args.kv_cache_dtype} block={block} reps={reps} "
          f"threads={torch.get_num_threads()}")  # fmt: skip
    verdicts = []

    # Decode: batch 32, context 2048.
    batch, context = 32, 2048
    cache, table, k, v = make_cache(batch, context)
    q = torch.randn(batch, heads, head, generator=gen).to(device=device, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    kc, vc = cache.k_caches[0], cache.v_caches[0]
    backends: list[Literal["torch", "cupy"]] = ["torch"]
    if device.type == "cuda":
        backends.append("cupy")
    # Where the paged path computes in fp32 (half precision on a CPU without native
    # half-precision matmuls), dense SDPA runs in fp32 too and the faster dense run is the
    # baseline: the paged side must not win by racing a slow dense kernel.
    upcast = compute_dtype(q) != dtype
    dense_args = [(q, k, v)] + ([(q.float(), k.float(), v.float())] if upcast else [])
    dense_fns = [
        lambda a=a: F.scaled_dot_product_attention(a[0].unsqueeze(2), a[1], a[2], scale=scale,
                                                   enable_gqa=True)
        for a in dense_args
    ]  # fmt: skip
    for backend in backends:
        paged_s, *dense_s = _time_alternating(
            [lambda: paged_attention(q, kc, vc, table, lens, scale, backend=backend), *dense_fns],
            reps, sync,
        )  # fmt: skip
        if upcast:
            print(f"decode  {backend:5s}: paged computes in fp32 on this CPU (no native "
                  f"{args.dtype} matmul); dense SDPA {args.dtype} {dense_s[0] * 1e3:.2f} ms, "
                  f"fp32 {dense_s[1] * 1e3:.2f} ms: the faster is the baseline")  # fmt: skip
        verdicts.append(_report(f"decode  {backend:5s}", paged_s, min(dense_s), DECODE_TARGET))
    del cache, k, v, dense_args, dense_fns

    # Prefill: 2048-token prompt, first 1024 cached, 1024 new tokens.
    context, new = 2048, 1024
    cache, table, k, v = make_cache(1, context)
    q = torch.randn(new, heads, head, generator=gen).to(device=device, dtype=dtype)
    lens = torch.tensor([context], dtype=torch.int32, device=device)
    loc = torch.tensor([0, new], dtype=torch.int32, device=device)
    mask = (torch.arange(context, device=device)
            <= torch.arange(new, device=device).view(-1, 1) + (context - new))
    qd = q.transpose(0, 1).unsqueeze(0)
    kc, vc = cache.k_caches[0], cache.v_caches[0]
    dense_args = [(qd, k, v)] + ([(qd.float(), k.float(), v.float())] if upcast else [])
    dense_fns = [
        lambda a=a: F.scaled_dot_product_attention(a[0], a[1], a[2], attn_mask=mask, scale=scale,
                                                   enable_gqa=True)
        for a in dense_args
    ]  # fmt: skip
    paged_s, *dense_times = _time_alternating(
        [
            lambda: paged_attention(q, kc, vc, table, lens, scale, query_start_loc=loc,
                                    backend="torch"),
            *dense_fns,
        ],
        reps, sync,
    )  # fmt: skip
    if upcast:
        print(f"prefill torch: dense SDPA {args.dtype} {dense_times[0] * 1e3:.2f} ms, "
              f"fp32 {dense_times[1] * 1e3:.2f} ms: the faster is the baseline")  # fmt: skip
    verdicts.append(_report("prefill torch", paged_s, min(dense_times), PREFILL_TARGET))
    if device.type != "cuda":
        print("cupy kernel: unmeasured (no CUDA device here)")
    print("verdict:", "all within target" if all(verdicts) else "some ratios over target")
    return 0


def _report(name: str, paged_s: float, dense_s: float, target: float) -> bool:
    ratio = paged_s / dense_s
    ok = ratio <= target
    print(
        f"{name}: paged {paged_s * 1e3:8.2f} ms  dense SDPA {dense_s * 1e3:8.2f} ms  "
        f"ratio {ratio:5.2f}x  (target <= {target}x) {'OK' if ok else 'OVER'}"
    )
    return ok
