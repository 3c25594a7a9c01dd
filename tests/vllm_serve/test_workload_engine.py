"""`tierd bench workload --in-process` on vLLM's CPU build: each arm's engine runs in a process of
the bench's own (``tierd.bench.workload_engine``), the workloads sent as token ids."""

from __future__ import annotations

import argparse
import os

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: run `make test-vllm-serve`")

from tierd.bench.tiny_llama import build  # noqa: E402
from tierd.bench.workload import _cases, _check, arm_config, configure  # noqa: E402
from tierd.bench.workload_cores import plan  # noqa: E402
from tierd.bench.workload_engine import run_in_process  # noqa: E402

pytestmark = [pytest.mark.vllm_serve]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["--repeats", "1", "--concurrency", "2", "--prefix-len", "128",
                              "--suffix-len", "16", "--gain-prefix-lens", "128",
                              "--output-len", "4", "--output-min", "4", "--stop-every", "0",
                              "--prefixes", "8", "--prompts-per-prefix", "3", "--chat-users", "3",
                              "--chat-turns", "2", "--chat-system", "64",
                              "--chat-message", "32", *argv])


def test_in_process_arms_serve_every_request_and_tierd_loads_what_the_small_cache_lost(
        ) -> None:
    """Four arms, two cases: every request of every arm completes with its 4 tokens; vLLM alone
    and tierd with the cache that fits run the same steps and compute the same prompt tokens
    (nothing to load: the prefix cache holds it all); with the small cache, vLLM alone
    recomputes prefixes it evicted while tierd loads them (fewer prompt tokens computed, and
    its daemon counts hits)."""
    args = _args("--arms", "vllm-small,tierd-small,vllm-big,tierd-big", "--kv-small", "16")
    model = build(os.environ.get("TIERD_TEST_MODELS", os.path.expanduser(
        "~/.cache/tierd/test-models")), "tiny-llama-v2-seed0", seed=0)
    max_len = _check(args)
    cores = plan(None, None)
    cases = _cases(args, model, "")
    samples = run_in_process(args, cases, model, max_len, cores, arm_config({}))
    runs = {(s.case, s.arm): s for s in samples}
    assert set(runs) == {(c.name, arm) for c in cases for arm in c.arms}
    for (case, arm), sample in runs.items():
        expected = 24 if case.startswith("prefix") else 6
        assert (sample.timing.completed, sample.timing.failed) == (expected, 0), (case, arm)
        assert sample.timing.output_throughput * sample.timing.duration_s == \
            pytest.approx(4 * expected)
    for case in ("prefix 128 c2", "chat c2"):
        big, tierd = runs[case, "vllm-big"].timing, runs[case, "tierd-big"].timing
        assert (tierd.steps_per_request, tierd.computed_tokens) == \
            (big.steps_per_request, big.computed_tokens)
    small, tierd_small = runs["prefix 128 c2", "vllm-small"], runs["prefix 128 c2", "tierd-small"]
    assert tierd_small.timing.computed_tokens < small.timing.computed_tokens
    assert tierd_small.hits.tierd is not None and tierd_small.hits.tierd > 0
