"""`tierd bench workload`'s command line for `vllm bench serve`, read by vLLM's own argument
parser (the one the CLI uses): every flag exists in this vLLM and means what the bench needs.
No server is started."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: run `make test-vllm-serve`")

from tierd.bench.serve_stack import VllmServe  # noqa: E402
from tierd.bench.workload_output import Output  # noqa: E402
from tierd.bench.workload_serve import bench_serve_argv  # noqa: E402

pytestmark = [pytest.mark.vllm_serve]


def _parsed(output: Output) -> Any:
    """`vllm bench serve`'s parse of one run's argv: 4 clients, 24 prefixes of 1,024 tokens with
    64-token suffixes, 96 requests, seed 1100, on port 8123."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    server = VllmServe("python", "/tmp", "/models/tiny", "tiny", "vllm-small", None, port=8123)
    argv = bench_serve_argv(server, "/models/tiny", "/tmp/out/run.json", seed=1100,
                            concurrency=4, prefix_len=1024, suffix_len=64, output=output,
                            prefixes=24, prompts=96)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


def test_vllms_parser_reads_the_prefix_repetition_run() -> None:
    """The argv of one run parses with `vllm bench serve`'s parser into a prefix_repetition run
    of the local model, at most 4 requests in flight, TTFT percentiles 50/90/99 saved to the
    named file, no warm-up and no ready-check request; every request at most 16 tokens out,
    ended early by a stop token once it has 4."""
    args = _parsed(Output(most=16, least=4, stop_every=8))
    assert (args.dataset_name, args.num_prompts, args.seed) == ("prefix_repetition", 96, 1100)
    assert (args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len) == (
        1024, 64, 24, 16)
    assert (args.base_url, args.model, args.tokenizer, args.served_model_name) == (
        "http://127.0.0.1:8123", "/models/tiny", "/models/tiny", "tiny")
    assert args.max_concurrency == 4 and args.ignore_eos and args.temperature == 0
    assert (args.metric_percentiles, args.save_result) == ("50,90,99", True)
    assert (args.result_dir, args.result_filename) == ("/tmp/out", "run.json")
    assert args.num_warmups == 0 and args.ready_check_timeout_sec == 0
    stops = args.extra_body["stop_token_ids"]
    assert args.extra_body["min_tokens"] == 4 and stops == list(range(3, 2048, 8))
    assert args.extra_body["include_stop_str_in_output"]


def test_fixed_output_lengths_add_no_request_body() -> None:
    """With no stop tokens (``--stop-every 0``) every request generates exactly its most."""
    args = _parsed(Output(most=16, least=4, stop_every=0))
    assert args.extra_body is None and args.prefix_repetition_output_len == 16


@pytest.mark.parametrize("most,least,every", [(0, 0, 8), (16, 17, 8), (16, 4, -1)])
def test_output_lengths_that_cannot_work_name_the_flags(most: int, least: int,
                                                         every: int) -> None:
    with pytest.raises(ValueError, match="--output-min"):
        Output(most, least, every)
