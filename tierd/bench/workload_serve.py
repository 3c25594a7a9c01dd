"""vLLM's own `vllm bench serve --dataset-name prefix_repetition` against one `vllm serve` of
`tierd bench workload`, run in this process through the entry point the CLI calls (vLLM's
argument parser and ``main``, so the flags are exactly a user's), its printout kept in a log
beside the servers' and its result read back from ``--save-result``'s JSON."""

from __future__ import annotations

import contextlib
import json
import os
import shlex

from tierd.bench.serve_stack import VllmServe
from tierd.bench.workload_output import Output
from tierd.bench.workload_report import Timing, from_bench_serve


def bench_serve_argv(server: VllmServe, model: str, result: str, *, seed: int,
                     concurrency: int, prefix_len: int, suffix_len: int, output: Output,
                     prefixes: int, prompts: int) -> list[str]:
    """The words after `vllm bench serve` for one run: every request sent at once and at most
    ``concurrency`` in flight, greedy, as many tokens out as ``output`` says (its stop tokens
    and least length go in every request's body), the local model directory as tokenizer (no
    hub), no warm-up request (it would fill the cache before the run), TTFT percentiles
    50/90/99, the result saved to ``result``."""
    body = output.sampling()
    return ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}",
            "--model", model, "--served-model-name", server.name, "--tokenizer", model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(suffix_len),
            "--prefix-repetition-num-prefixes", str(prefixes),
            "--prefix-repetition-output-len", str(output.most),
            "--num-prompts", str(prompts), "--seed", str(seed),
            "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--temperature", "0", "--ignore-eos", "--ready-check-timeout-sec", "0",
            "--num-warmups", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", os.path.dirname(result),
            "--result-filename", os.path.basename(result)] + \
        (["--extra-body", json.dumps(body)] if body else [])


def prefix_repetition(server: VllmServe, model: str, workdir: str, *, seed: int,
                      concurrency: int, prefix_len: int, suffix_len: int, output: Output,
                      prefixes: int, prompts: int) -> Timing:
    """Run `vllm bench serve` once against ``server``; its figures. Its printout is appended
    to ``workdir/bench-serve-ENGINE.log`` after the command line a user would type."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    result = os.path.join(workdir, f"bench-serve-{server.engine}.json")
    argv = bench_serve_argv(server, model, result, seed=seed, concurrency=concurrency,
                            prefix_len=prefix_len, suffix_len=suffix_len, output=output,
                            prefixes=prefixes, prompts=prompts)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with open(os.path.join(workdir, f"bench-serve-{server.engine}.log"), "a") as log:
        log.write(f"$ vllm bench serve {shlex.join(argv)}\n")
        log.flush()
        with contextlib.redirect_stdout(log):
            main(args)
    with open(result) as f:
        return from_bench_serve(json.load(f))
