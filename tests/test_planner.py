"""tierd.planner: vLLM's start-up figures, the advice bands, trace waste."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierd.planner import (
    GIB,
    PlanInputs,
    TraceRequest,
    chat_trace,
    gpu,
    parse_trace,
    plan,
    preset,
    trace_line,
    trace_waste,
)

BUNDLED = Path(__file__).resolve().parents[1] / "examples" / "chat_trace.jsonl"
LLAMA = preset("Llama-3-8B")


def test_llama3_8b_fp16_48gib_matches_vllm() -> None:
    """Llama-3-8B fp16 in a 48 GiB pool: 128 KiB/token, 2 MiB/block, 393,216 tokens, 48.00x."""
    p = plan(PlanInputs(LLAMA, kv_pool_gib=48))
    assert p.kv_bytes_per_token == 128 * 1024
    assert p.kv_bytes_per_block == 2 * 1024 * 1024
    assert p.num_blocks == 24_576
    assert p.blocks_per_request == 512
    assert p.kv_cache_tokens == 393_216
    assert p.max_concurrency == 48.0
    assert p.startup_lines() == (
        "GPU KV cache size: 393,216 tokens",
        "Maximum concurrency for 8,192 tokens per request: 48.00x",
    )


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_halves_bytes_and_doubles_tokens(dtype: str) -> None:
    """Every fp8 variant: 64 KiB/token, 1 MiB/block, 786,432 tokens, 96.00x."""
    p = plan(PlanInputs(LLAMA, kv_cache_dtype=dtype, kv_pool_gib=48))  # type: ignore[arg-type]
    assert (p.kv_bytes_per_token, p.kv_bytes_per_block) == (64 * 1024, 1024 * 1024)
    assert p.startup_lines() == (
        "GPU KV cache size: 786,432 tokens",
        "Maximum concurrency for 8,192 tokens per request: 96.00x",
    )


@pytest.mark.parametrize(
    ("name", "layers", "per_token"),
    [("Llama-3-8B", 32, 131_072), ("llama-3-70b", 80, 327_680),
     ("QWEN3-8B", 36, 147_456), ("Qwen3-32B", 64, 262_144)],
)
def test_presets_have_real_shapes(name: str, layers: int, per_token: int) -> None:
    """Every preset has 8 KV heads of dim 128; bytes per token = 2 x layers x 8 x 128 x 2."""
    shape = preset(name)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (layers, 8, 128)
    assert plan(PlanInputs(shape, kv_pool_gib=100)).kv_bytes_per_token == per_token


def test_tensor_parallel_splits_heads_and_replicates_past_them() -> None:
    """70B at TP 4: 80 KiB per GPU of 320 KiB; at TP 16 (> 8 heads) each GPU keeps 1 head."""
    shape = preset("Llama-3-70B")
    p4 = plan(PlanInputs(shape, tensor_parallel_size=4, kv_pool_gib=40))
    assert (p4.kv_bytes_per_token_per_gpu, p4.kv_bytes_per_token) == (81_920, 327_680)
    assert p4.num_blocks == 40 * GIB // (81_920 * 16) == 32_768
    p16 = plan(PlanInputs(shape, tensor_parallel_size=16, kv_pool_gib=40))
    assert p16.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2
    with pytest.raises(ValueError, match="tensor-parallel size 3 neither divides"):
        PlanInputs(shape, tensor_parallel_size=3, kv_pool_gib=40)


def test_pool_from_gpu_budget() -> None:
    """80 GiB x 0.9 - 16 GiB weights - 4 GiB overhead = 52 GiB: 26,624 blocks, 52.00x."""
    p = plan(PlanInputs(LLAMA, gpu_memory_gib=80, weights_gib=16))
    assert p.kv_pool_bytes_per_gpu == 52 * GIB
    assert (p.num_blocks, p.kv_cache_tokens, p.max_concurrency) == (26_624, 425_984, 52.0)
    default_weights = PlanInputs(LLAMA, gpu_memory_gib=80).weights
    assert default_weights == 8_030_261_248 * 2 / GIB  # 14.96 GiB at 2 bytes per parameter
    h100 = plan(PlanInputs(LLAMA, gpu=gpu("NVIDIA H100"), weights_gib=16))
    assert h100.num_blocks == 26_624  # the GPU's nominal 80 GiB


def test_band_boundaries() -> None:
    """10.00x is the 10-50x band and 50.00x is 50x-and-up; 9.99x is under 10x."""
    assert plan(PlanInputs(LLAMA, kv_pool_gib=10)).band == "10_to_50x"
    assert plan(PlanInputs(LLAMA, kv_pool_gib=50)).band == "50x_and_up"
    assert plan(PlanInputs(LLAMA, kv_pool_gib=9.99)).band == "under_10x"


def test_under_10x_advice_in_order() -> None:
    """4 GiB budget pool at 8,192: fp8, lower length, quantize, TP, GQA, with what-ifs."""
    p = plan(PlanInputs(LLAMA, gpu_memory_gib=24, weights_gib=16, overhead_gib=4,
                        gpu_memory_utilization=1.0))
    assert (p.band, p.max_concurrency) == ("under_10x", 4.0)
    assert [a.action for a in p.advice] == [
        "--kv-cache-dtype fp8",
        "lower --max-model-len (half is 4,096)",
        "quantize the weights (FP8 or AWQ)",
        "raise --tensor-parallel-size to 2",
        "switch to a GQA model with fewer KV heads",
    ]
    # fp8: 8.00x; half length: 8.00x; 8 GiB weights -> 12 GiB pool: 12.00x;
    # TP 2: 24 - 8 - 4 = 12 GiB per GPU at 64 KiB per token per GPU: 24.00x.
    assert [a.concurrency_after for a in p.advice] == [8.0, 8.0, 12.0, 24.0, None]
    assert p.caveats == (
        "fp8 KV needs Ada (L40S, RTX 4090) or Hopper (H100, H200) or newer; Ampere (A100) has "
        "no native fp8 and software conversion gives back part of the gain",
    )


def test_10_to_50x_advice_and_fp8_step_skipped_when_on() -> None:
    """48 GiB fp16: fp8, raise utilization, watch preemption; at fp8 already, fp8 is skipped."""
    p = plan(PlanInputs(LLAMA, kv_pool_gib=48))
    assert [a.action for a in p.advice] == [
        "--kv-cache-dtype fp8",
        "raise --gpu-memory-utilization to 0.93-0.95",
        "watch preemption metrics",
    ]
    assert [a.concurrency_after for a in p.advice] == [96.0, None, None]
    on_fp8 = plan(PlanInputs(LLAMA, kv_cache_dtype="fp8", gpu=gpu("H100"), kv_pool_gib=12,
                             gpu_memory_utilization=0.95))
    assert on_fp8.max_concurrency == 24.0
    assert [a.action for a in on_fp8.advice] == ["watch preemption metrics"]
    assert on_fp8.caveats == ()  # Hopper has native fp8


def test_50x_and_up_looks_elsewhere() -> None:
    """96.00x: memory is enough; check CPU cores, tokenization, max_num_batched_tokens."""
    p = plan(PlanInputs(LLAMA, kv_cache_dtype="fp8", kv_pool_gib=48, gpu=gpu("L40S")))
    assert [a.action for a in p.advice] == [
        "check CPU cores",
        "check tokenization cost",
        "check whether --max-num-batched-tokens is too small",
    ]
    assert p.caveats == ()
    roomy = plan(PlanInputs(LLAMA, kv_cache_dtype="fp8", kv_pool_gib=64, gpu=gpu("H100")))
    assert roomy.max_concurrency == 128.0
    assert roomy.caveats[0].startswith("above 100x, memory is not the bottleneck")


def test_ampere_caveat_and_awq() -> None:
    """On an A100 the caveat names it as Ampere and weight advice is AWQ (4-bit)."""
    p = plan(PlanInputs(preset("Qwen3-32B"), gpu=gpu("a100"), tensor_parallel_size=2,
                        gpu_memory_utilization=0.95, max_model_len=131_072))
    assert p.band == "under_10x"
    assert p.advice[2].action == "quantize the weights (AWQ)"
    assert p.caveats[0].startswith("A100 is Ampere: no native fp8")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "block size 12 is not a power of two; use one of 8, 16, 32"),
        ({"block_size": 256}, "block size 256 is outside vLLM's choices"),
        ({"gpu_memory_utilization": 0.0}, r"outside \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, r"outside \(0, 1\]"),
        ({"max_model_len": 0}, "max model length must be >= 1"),
        ({"kv_cache_dtype": "int4"}, "unknown KV cache dtype 'int4'; use one of auto"),
        ({"gpu_memory_gib": 80}, "either --kv-pool-gib or --gpu-memory-gib, not both"),
        ({"kv_pool_gib": None}, "give --kv-pool-gib"),
        ({"kv_pool_gib": -1.0}, "kv_pool_gib must not be negative"),
    ],
)
def test_bad_inputs_name_the_fix(kwargs: dict[str, object], message: str) -> None:
    """Each bad input raises ValueError whose message says what to change."""
    base: dict[str, object] = {"kv_pool_gib": 48.0}
    with pytest.raises(ValueError, match=message):
        PlanInputs(LLAMA, **{**base, **kwargs})  # type: ignore[arg-type]


def test_pool_too_small_and_unknown_names() -> None:
    """A pool under one block, weights over budget, unknown preset or GPU: ValueError."""
    with pytest.raises(ValueError, match="smaller than one 16-token block"):
        plan(PlanInputs(LLAMA, kv_pool_gib=0.001))
    with pytest.raises(ValueError, match="leave no KV memory"):
        plan(PlanInputs(LLAMA, gpu_memory_gib=16))
    with pytest.raises(ValueError, match="unknown model preset 'Llama-2'; use one of Llama-3-8B"):
        preset("Llama-2")
    with pytest.raises(ValueError, match="unknown GPU 'X9'; use one of"):
        gpu("X9")
    assert gpu("rtx-4090").architecture == "ada"


def test_parse_trace_accepts_both_field_names_and_skips_blanks() -> None:
    """prompt_len/output_len and prompt_tokens/completion_tokens both parse; blanks skip."""
    lines = ['{"prompt_len": 100, "output_len": 20}', "",
             '{"prompt_tokens": 7, "completion_tokens": 0}']
    assert parse_trace(lines) == (TraceRequest(1, 100, 20), TraceRequest(3, 7, 0))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("not json", "t.jsonl line 2 is not JSON"),
        ("[1, 2]", "t.jsonl line 2 is not a JSON object"),
        ('{"prompt_len": 5}', "t.jsonl line 2: output_len must be a non-negative integer"),
        ('{"prompt_len": -1, "output_len": 1}', "line 2: prompt_len must be a non-negative"),
        ('{"prompt_len": true, "output_len": 1}', "line 2: prompt_len must be a non-negative"),
        ('{"prompt_len": 0, "output_len": 0}', "line 2: the request has no tokens"),
    ],
)
def test_bad_trace_lines_name_line_and_fix(bad: str, message: str) -> None:
    """A bad second line raises ValueError with its line number and the expected format."""
    with pytest.raises(ValueError, match=message) as info:
        parse_trace(['{"prompt_len": 1, "output_len": 1}', bad], source="t.jsonl")
    assert '{"prompt_len": 512, "output_len": 128}' in str(info.value)


def test_empty_trace_is_an_error() -> None:
    """A trace of blank lines only raises ValueError."""
    with pytest.raises(ValueError, match="holds no requests"):
        parse_trace(["", "  "])


def test_trace_waste_exact() -> None:
    """Lengths 1, 16, 17 at block 16, max 64: contiguous wastes 158 of 192, paged 30 of 64."""
    p = plan(PlanInputs(LLAMA, kv_pool_gib=1, max_model_len=64))
    w = trace_waste(p, [TraceRequest(1, 1, 0), TraceRequest(2, 10, 6), TraceRequest(3, 16, 1)])
    assert (w.tokens_used, w.longest_tokens) == (34, 17)
    assert (w.contiguous_reserved_tokens, w.contiguous_wasted_tokens) == (192, 158)
    assert (w.paged_reserved_tokens, w.paged_wasted_tokens) == (64, 30)
    assert w.paged_wasted_bytes == 30 * 131_072
    assert w.contiguous_fit == 8192 // 64  # 512 blocks = 8,192 tokens in 1 GiB
    assert w.paged_fit == 512 / (4 / 3)


def test_trace_request_over_max_len_names_line() -> None:
    """A request longer than the max model length names its line and the fix."""
    p = plan(PlanInputs(LLAMA, kv_pool_gib=1, max_model_len=64))
    with pytest.raises(ValueError, match="trace line 9: 65 tokens exceed --max-model-len 64"):
        trace_waste(p, [TraceRequest(9, 60, 5)])


def test_bundled_trace_paged_waste_under_4_percent() -> None:
    """The bundled chat mix: paged waste 0.48% (< 4%), contiguous 81.2% at 8,192."""
    trace = parse_trace(BUNDLED.read_text().splitlines())
    w = trace_waste(plan(PlanInputs(LLAMA, kv_pool_gib=48)), trace)
    assert (w.requests, w.tokens_used, w.paged_wasted_tokens) == (300, 461_355, 2_245)
    assert w.paged_waste_fraction < 0.04
    assert w.contiguous_waste_fraction > 0.6
    assert (w.contiguous_fit, round(w.paged_fit)) == (48, 254)


def test_bundled_trace_is_chat_trace_output() -> None:
    """examples/chat_trace.jsonl is exactly what chat_trace() generates (reproducible)."""
    expected = "".join(trace_line(r) + "\n" for r in chat_trace())
    assert BUNDLED.read_text() == expected


def test_plan_to_dict_is_json() -> None:
    """to_dict carries every figure and survives JSON."""
    doc = json.loads(json.dumps(plan(PlanInputs(LLAMA, kv_pool_gib=48)).to_dict()))
    assert doc["kv_cache_tokens"] == 393_216
    assert doc["inputs"]["model"]["num_layers"] == 32
    assert doc["advice"][0]["concurrency_after"] == 96.0
    assert doc["startup_lines"][1].endswith("48.00x")
