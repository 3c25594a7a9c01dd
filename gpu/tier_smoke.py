"""GPU check of ``TierdTier`` under vLLM's native tiered offloading, for a GPU host
with vLLM (0.32+) and tierd installed. Not run yet: no GPU host with vLLM was available.

A `tierd serve` on a temporary socket, then two engines in turn (each a fresh process, so the
second has an empty GPU cache and an empty primary tier): ``vllm.LLM`` with
``OffloadingConnector`` + ``TieringOffloadingSpec`` and ``TierdTier`` as its only secondary tier,
greedy generation of one long prompt. The second engine must load the prefix from tierd: the
same text, the daemon's hit tokens > 0, a shorter time to the answer; `tierd stats --json` is
printed after each.

    python gpu/tier_smoke.py --model /models/Qwen2.5-0.5B-Instruct   # any small local model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def engine(model: str, socket_path: str, prompt: str) -> tuple[str, float]:
    """One engine (this process): the greedy answer to ``prompt`` and its wall time."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    tier = {"type": "TierdTier", "module_path": "tierd.connector.vllm.tier",
            "socket_path": socket_path}
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"spec_name": "TieringOffloadingSpec",
                                   "cpu_bytes_to_use": 2 << 30, "secondary_tiers": [tier]})
    llm = LLM(model=model, kv_transfer_config=transfer, gpu_memory_utilization=0.3,
              max_model_len=8192, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    start = time.perf_counter()
    text = llm.generate([prompt], params)[0].outputs[0].text
    return text, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description="GPU check of TierdTier under vLLM's native tiered offloading: a cold "
                    "engine, then one loading from tierd")
    parser.add_argument("--model", required=True, help="a small local model directory")
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(900))  # ~6k tokens
    if args.engine:
        text, seconds = engine(args.model, args.socket_path, prompt)
        print(json.dumps({"text": text, "seconds": seconds}))
        return 0
    work = tempfile.mkdtemp(prefix="tierd-gpu-tier-")
    sock = os.path.join(work, "tierd.sock")
    daemon = subprocess.Popen([sys.executable, "-m", "tierd.cli", "serve", "--socket-path", sock,
                               "--dram-bytes", "4GiB", "--ssd-dir", os.path.join(work, "ssd")])
    try:
        time.sleep(5)
        runs = []
        for _ in range(2):
            out = subprocess.run([sys.executable, __file__, "--engine", "--model", args.model,
                                  "--socket-path", sock], capture_output=True, text=True,
                                 check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            stats = subprocess.run([sys.executable, "-m", "tierd.cli", "stats", "--json",
                                    "--socket-path", sock], capture_output=True, text=True,
                                   check=True)
            print(stats.stdout)
        same = runs[0]["text"] == runs[1]["text"]
        hit = json.loads(stats.stdout)["hit_tokens"] > 0
        print(f"cold {runs[0]['seconds']:.3f} s, from tierd {runs[1]['seconds']:.3f} s, "
              f"same text: {same}, tierd hit tokens > 0: {hit}")
        return 0 if same and hit else 1
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
