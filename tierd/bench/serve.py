"""`tierd bench serve`: time to first token through real `vllm serve`, cold against every hit.

The stack of ``tests/vllm_serve`` (``tierd.bench.serve_stack``): a `tierd serve` and two `vllm
serve` processes of vLLM's CPU build with TierdConnector, serving a small seeded Llama
(``tierd.bench.tiny_llama``), driven by a streaming client. For each of ``--prompts`` prompts of
``--tokens`` tokens (4,096 by default):

- **cold**: instance A computes it (and stores it through tierd);
- **vLLM prefix cache**: A again (vLLM's own GPU-pool cache, the upper bound of a hit);
- **tierd DRAM**: instance B (vLLM's prefix cache off, so every hit is tierd's) loads it;
- **tierd SSD**: after `tierd serve` restarts (SIGTERM writes DRAM to SSD), B again.

Every hit must give the cold run's greedy text. It prints the median TTFT of each and the ratios
cold / DRAM hit and cold / SSD hit against ``--limit`` (10 and 5), and the
DRAM hit / vLLM's own cache (how close a tierd hit comes to never having left the engine).
Run it with vLLM's CPU build: ``make bench-serve`` (``ARGS="--tokens 8192"``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HELP = "TTFT through real vllm serve: cold vs vLLM's prefix cache vs tierd DRAM and SSD hits."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (4096)")
    parser.add_argument("--prompts", type=int, default=5, help="prompts timed (5)")
    parser.add_argument("--limit-dram", type=float, default=10.0,
                        help="least cold / DRAM-hit TTFT ratio (10)")
    parser.add_argument("--limit-ssd", type=float, default=5.0,
                        help="least cold / SSD-hit TTFT ratio (5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("tierd bench serve needs vLLM's CPU build in this Python: run it with "
                         "`make bench-serve`")
    from tierd.bench.serve_stack import VllmServe, stack_daemon
    from tierd.bench.tiny_llama import build, prompt

    if args.tokens < 64 or args.prompts < 1:
        raise ValueError("need --tokens >= 64 and --prompts >= 1")
    workdir = tempfile.mkdtemp(prefix="tierd-bs-")
    model = build(os.path.expanduser("~/.cache/tierd/test-models"), "tiny-llama-v2-seed0",
                  seed=0)
    daemon = stack_daemon(workdir)
    sock = daemon.socket_path
    length = min(32768, 2 * args.tokens + 64)  # vLLM bounds a prompt by 5 characters a token
    a = VllmServe(sys.executable, workdir, model, "tiny", "bench-a", sock, max_model_len=length)
    b = VllmServe(sys.executable, workdir, model, "tiny", "bench-b", sock, prefix_caching=False,
                  max_model_len=length)
    times: dict[str, list[float]] = {"cold": [], "vllm_prefix_cache": [], "tierd_dram": [],
                                     "tierd_ssd": []}
    failed = True
    try:
        daemon.start()
        for server in (a, b):
            server.start()
        for server in (a, b):
            server.wait_ready()
        a.complete(prompt(args.tokens, seed=10_000), 4)  # warm both up: first requests compile
        b.complete(prompt(args.tokens, seed=10_001), 4)
        prompts = [prompt(args.tokens, seed=i) for i in range(args.prompts)]
        want = []
        for text in prompts:
            seconds, cold = a.timed(text)
            times["cold"].append(seconds)
            want.append(cold)
            for name, server in (("vllm_prefix_cache", a), ("tierd_dram", b)):
                seconds, got = server.timed(text)
                assert got == cold, f"{name} hit gave other text than the cold run"
                times[name].append(seconds)
        daemon.stop()
        daemon.start()
        for text, cold in zip(prompts, want):
            seconds, got = b.timed(text)
            assert got == cold, "SSD hit gave other text than the cold run"
            times["tierd_ssd"].append(seconds)
        failed = False
    finally:
        for server in (a, b):
            server.stop()
        daemon.stop()
        if failed:
            print(f"tierd bench serve: logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    figures = {"tokens": args.tokens, "prompts": args.prompts,
               "median_ttft_s": med, "cold_over_dram": med["cold"] / med["tierd_dram"],
               "cold_over_ssd": med["cold"] / med["tierd_ssd"],
               "dram_over_vllm_cache": med["tierd_dram"] / med["vllm_prefix_cache"]}
    ok = (figures["cold_over_dram"] >= args.limit_dram
          and figures["cold_over_ssd"] >= args.limit_ssd)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0 if ok else 1
    print(f"real vllm serve (vLLM's CPU build), {args.tokens}-token prompts, "
          f"median of {args.prompts}:")
    for name, seconds in med.items():
        print(f"  TTFT {name:<18} {seconds * 1e3:8.1f} ms")
    print(f"cold / tierd DRAM hit {figures['cold_over_dram']:.1f} (limit >= {args.limit_dram}); "
          f"cold / tierd SSD hit {figures['cold_over_ssd']:.1f} (limit >= {args.limit_ssd}); "
          f"tierd DRAM hit / vLLM's own prefix cache {figures['dram_over_vllm_cache']:.2f}"
          f" -> {'ok' if ok else 'OVER'}")
    return 0 if ok else 1
