"""`tierd bench NAME`: benchmarks that print ratios against a limit measured in the same run.

Each benchmark is a module ``tierd.bench.NAME`` exposing ``HELP``, ``configure(parser)`` and
``run(args) -> int``. They are programs, not tests: targets are judged by the ratios they print.
"""

from __future__ import annotations

import argparse
import importlib

HELP = ("Run a benchmark (hash, attention, daemon, e2e, cluster, soak, tenants, insight, vllm, "
        "identity, serve, workload, vllm-tier, sglang, or all).")

# Benchmark name -> module under tierd.bench.
BENCHMARKS: dict[str, str] = {
    "hash": "hashing",
    "attention": "attention",
    "daemon": "daemon",
    "e2e": "e2e",
    "cluster": "cluster",
    "soak": "soak",
    "tenants": "tenants",
    "insight": "insight",
    "vllm": "vllm",
    "identity": "identity",
    "serve": "serve",
    "workload": "workload",
    "vllm-tier": "vllm_tier",
    "sglang": "sglang",
}
NOT_IN_ALL = {"serve": "needs vLLM's CPU build and ~2 min of vllm serve starts: `make bench-serve`",
              "workload": "needs vLLM's CPU build, 10-20 min: `make bench-workload`",
              "vllm-tier": "needs real vLLM 0.33: `make bench-vllm-tier`",
              "sglang": "needs SGLang: `make bench-sglang`"}
"""Benchmarks ``all`` leaves out, and how to run each."""


def _load(name: str):  # type: ignore[no-untyped-def]
    try:
        return importlib.import_module(f"tierd.bench.{BENCHMARKS[name]}")
    except ModuleNotFoundError as exc:
        if exc.name == f"tierd.bench.{BENCHMARKS[name]}":
            return None
        raise


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name in BENCHMARKS:
        module = _load(name)
        if module is None:
            continue
        child = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(child)
        child.set_defaults(_bench_run=module.run)
    everything = sub.add_parser("all", help="Run every benchmark with its default flags, in turn, "
                                            "but those that need an engine's venv (serve, "
                                            "vllm-tier, sglang).")
    everything.set_defaults(_bench_run=None)


def run(args: argparse.Namespace) -> int:
    if args._bench_run is not None:
        return int(args._bench_run(args))
    status = 0
    for name in BENCHMARKS:
        module = _load(name)
        if name in NOT_IN_ALL:
            print(f"== tierd bench {name}: not run by all ({NOT_IN_ALL[name]})")
            continue
        if module is None:
            continue
        parser = argparse.ArgumentParser()
        module.configure(parser)
        print(f"== tierd bench {name}")
        status |= int(module.run(parser.parse_args([])))
    return status
