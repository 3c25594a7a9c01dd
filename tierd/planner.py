"""KV-cache memory planning: vLLM's start-up figures, advice for the band, trace waste.

Pure computation, no I/O and no torch, so ``tierd plan`` answers instantly. From a model's shape
(:class:`ModelShape`), a KV dtype, a block size and either an explicit per-GPU KV pool or a GPU's
memory budget (:class:`PlanInputs`), :func:`plan` computes what vLLM prints at start-up::

    GPU KV cache size: 393,216 tokens
    Maximum concurrency for 8,192 tokens per request: 48.00x

with ``X = num_blocks / ceil(max_model_len / block_size)``, then the advice for the concurrency
band it falls in (docs/planning.md). :func:`trace_waste` compares the KV bytes a
trace of requests wastes under contiguous allocation (every request reserves ``max_model_len``)
with paged allocation (only each request's last partial block). Sizes are binary: 1 GiB = 2**30.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

GIB = 1 << 30
BLOCK_SIZES = (8, 16, 32, 64, 128)

KvCacheDtype = Literal["auto", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_DTYPE_BYTES: Mapping[str, int] = MappingProxyType(
    {"auto": 2, "fp16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
)

Band = Literal["under_10x", "10_to_50x", "50x_and_up"]
Architecture = Literal["volta", "turing", "ampere", "ada", "hopper", "blackwell"]
NATIVE_FP8: frozenset[str] = frozenset({"ada", "hopper", "blackwell"})


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's KV cache: per token, ``2 (K and V) x layers x KV heads x head dim``
    elements. ``num_params`` only gives the default weight size (2 bytes per parameter); a
    custom shape has None there and needs an explicit weight size to plan from GPU memory."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int | None = None

    def __post_init__(self) -> None:
        for field, flag in (("num_layers", "--layers"), ("num_kv_heads", "--kv-heads"),
                            ("head_dim", "--head-dim")):
            if getattr(self, field) < 1:
                raise ValueError(f"model {field} must be a positive integer; fix {flag}")

    def kv_heads_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV heads each tensor-parallel rank holds (vLLM replicates heads when TP > heads)."""
        return max(1, self.num_kv_heads // tensor_parallel_size)


# Shapes from each model's config.json; parameter counts summed from the same shapes
# (embeddings and LM head untied, norms included), e.g. Llama-3-8B 8,030,261,248.
PRESETS: Mapping[str, ModelShape] = MappingProxyType(
    {
        shape.name.lower(): shape
        for shape in (
            ModelShape("Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128,
                       num_params=8_030_261_248),
            ModelShape("Llama-3-70B", num_layers=80, num_kv_heads=8, head_dim=128,
                       num_params=70_553_706_496),
            ModelShape("Qwen3-8B", num_layers=36, num_kv_heads=8, head_dim=128,
                       num_params=8_190_735_360),
            ModelShape("Qwen3-32B", num_layers=64, num_kv_heads=8, head_dim=128,
                       num_params=32_762_123_264),
        )
    }
)


def preset(name: str) -> ModelShape:
    """The preset model shape called ``name`` (case-insensitive)."""
    shape = PRESETS.get(name.lower())
    if shape is None:
        known = ", ".join(s.name for s in PRESETS.values())
        raise ValueError(
            f"unknown model preset {name!r}; use one of {known}, or --model custom "
            "with --layers, --kv-heads and --head-dim"
        )
    return shape


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: its architecture decides native fp8 support; ``memory_gib`` is nominal."""

    name: str
    architecture: Architecture
    memory_gib: float

    @property
    def native_fp8(self) -> bool:
        return self.architecture in NATIVE_FP8


GPUS: Mapping[str, GpuSpec] = MappingProxyType(
    {
        spec.name.lower().replace(" ", "").replace("-", ""): spec
        for spec in (
            GpuSpec("V100", "volta", 32), GpuSpec("T4", "turing", 16),
            GpuSpec("A100", "ampere", 80), GpuSpec("A100-40GB", "ampere", 40),
            GpuSpec("A10", "ampere", 24), GpuSpec("A10G", "ampere", 24),
            GpuSpec("A40", "ampere", 48), GpuSpec("RTX A6000", "ampere", 48),
            GpuSpec("RTX 3090", "ampere", 24), GpuSpec("L4", "ada", 24),
            GpuSpec("L40", "ada", 48), GpuSpec("L40S", "ada", 48),
            GpuSpec("RTX 4090", "ada", 24), GpuSpec("H100", "hopper", 80),
            GpuSpec("H200", "hopper", 141), GpuSpec("H20", "hopper", 96),
            GpuSpec("B200", "blackwell", 180),
        )
    }
)


def gpu(name: str) -> GpuSpec:
    """The GPU called ``name``; case, spaces, dashes and an ``NVIDIA`` prefix are ignored."""
    key = name.lower().replace(" ", "").replace("-", "").removeprefix("nvidia")
    spec = GPUS.get(key)
    if spec is None:
        known = ", ".join(s.name for s in GPUS.values())
        raise ValueError(f"unknown GPU {name!r}; use one of {known}, or leave --gpu out")
    return spec


def _check_tp(model: ModelShape, tp: int) -> str | None:
    """Why ``tp`` cannot split ``model``'s KV heads, or None when it can (vLLM's rule)."""
    if tp < 1:
        return f"tensor-parallel size must be >= 1, not {tp}"
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        return (f"tensor-parallel size {tp} neither divides nor is a multiple of "
                f"{model.num_kv_heads} KV heads; pick a size that does")
    return None


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on. Give either ``kv_pool_gib`` (KV memory per GPU) or a GPU
    budget (``gpu_memory_gib`` or a ``gpu`` with nominal memory): then the pool per GPU is
    ``gpu_memory_gib x gpu_memory_utilization - weights_gib / TP - overhead_gib``.
    ``weights_gib`` (whole model) defaults to 2 bytes per parameter; ``overhead_gib`` stands in
    for what vLLM profiles: peak activations, CUDA graphs, non-torch allocations."""

    model: ModelShape
    kv_cache_dtype: KvCacheDtype = "auto"
    block_size: int = 16
    max_model_len: int = 8192
    tensor_parallel_size: int = 1
    kv_pool_gib: float | None = None
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    weights_gib: float | None = None
    overhead_gib: float = 4.0
    gpu: GpuSpec | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"unknown KV cache dtype {self.kv_cache_dtype!r}; "
                             f"use one of {', '.join(KV_DTYPE_BYTES)}")
        bs = self.block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"block size {bs} is not a power of two; use one of "
                             f"{', '.join(map(str, BLOCK_SIZES))} (16 is vLLM's default)")
        if bs not in BLOCK_SIZES:
            raise ValueError(f"block size {bs} is outside vLLM's choices; "
                             f"use one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.max_model_len < 1:
            raise ValueError(f"max model length must be >= 1 token, not {self.max_model_len}")
        tp_problem = _check_tp(self.model, self.tensor_parallel_size)
        if tp_problem is not None:
            raise ValueError(tp_problem)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"GPU memory utilization {self.gpu_memory_utilization} is outside "
                             "(0, 1]; give a fraction such as 0.9 (vLLM's default)")
        if self.kv_pool_gib is not None and self.gpu_memory_gib is not None:
            raise ValueError("give either --kv-pool-gib or --gpu-memory-gib, not both")
        if self.kv_pool_gib is None and self.gpu_memory_gib is None and self.gpu is None:
            raise ValueError("give --kv-pool-gib (KV memory per GPU) or --gpu-memory-gib "
                             "(or --gpu NAME for its nominal memory)")
        for field in ("kv_pool_gib", "gpu_memory_gib", "weights_gib", "overhead_gib"):
            value = getattr(self, field)
            if value is not None and value < 0:
                raise ValueError(f"{field} must not be negative; fix --{field.replace('_', '-')}")
        if self.kv_pool_gib is None and self.weights_gib is None and self.model.num_params is None:
            raise ValueError(f"{self.model.name} has no known weight size: give --weights-gib "
                             "to plan from GPU memory, or give --kv-pool-gib")

    @property
    def kv_dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_cache_dtype]

    @property
    def fp8_kv(self) -> bool:
        return self.kv_dtype_bytes == 1

    @property
    def weights(self) -> float | None:
        """Weight size in GiB for the whole model: the given one, else 2 bytes per parameter;
        None for a custom shape without ``weights_gib`` (then the pool is given directly)."""
        if self.weights_gib is not None:
            return self.weights_gib
        return None if self.model.num_params is None else self.model.num_params * 2 / GIB

    @property
    def memory_gib(self) -> float | None:
        """GPU memory per GPU in GiB for the budget, or None when the pool is given directly."""
        if self.kv_pool_gib is not None:
            return None
        if self.gpu_memory_gib is not None:
            return self.gpu_memory_gib
        assert self.gpu is not None, "__post_init__ requires a pool, a memory size or a GPU"
        return self.gpu.memory_gib


@dataclass(frozen=True)
class Advice:
    """One step to try, with the concurrency it would give when that can be computed."""

    action: str
    why: str
    concurrency_after: float | None


@dataclass(frozen=True)
class Plan:
    """vLLM's start-up figures for ``inputs``. ``*_per_gpu`` is one tensor-parallel rank; the
    unqualified byte counts cover the whole TP group. Tokens and blocks are per rank, as vLLM
    reports them (every rank holds the same blocks, each with its share of the heads)."""

    inputs: PlanInputs
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_block: int
    kv_bytes_per_block_per_gpu: int
    kv_pool_bytes_per_gpu: int
    num_blocks: int
    kv_cache_tokens: int
    blocks_per_request: int
    max_concurrency: float
    band: Band
    advice: tuple[Advice, ...]
    caveats: tuple[str, ...]

    def startup_lines(self) -> tuple[str, str]:
        """The two lines vLLM logs at start-up, formatted the way vLLM formats them."""
        return (
            f"GPU KV cache size: {self.kv_cache_tokens:,} tokens",
            f"Maximum concurrency for {self.inputs.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x",
        )

    def to_dict(self) -> dict[str, Any]:
        """Every figure, JSON-ready, plus the derived weight size and the start-up lines."""
        out = dataclasses.asdict(self)
        out["inputs"]["weights_gib_used"] = self.inputs.weights
        out["startup_lines"] = list(self.startup_lines())
        return out


def _measure(inputs: PlanInputs) -> Plan:
    """The figures alone (no advice); raises ValueError when the pool holds no block."""
    model, tp, bs = inputs.model, inputs.tensor_parallel_size, inputs.block_size
    per_gpu_token = 2 * model.num_layers * model.kv_heads_per_gpu(tp) * model.head_dim \
        * inputs.kv_dtype_bytes
    memory = inputs.memory_gib
    if memory is None:
        assert inputs.kv_pool_gib is not None, "no memory budget means an explicit pool"
        pool_gib = inputs.kv_pool_gib
    else:
        weights = inputs.weights
        assert weights is not None, "__post_init__ requires a weight size for a memory budget"
        pool_gib = memory * inputs.gpu_memory_utilization - weights / tp - inputs.overhead_gib
        if pool_gib <= 0:
            raise ValueError(
                f"weights ({weights / tp:.2f} GiB per GPU) plus overhead "
                f"({inputs.overhead_gib:g} GiB) leave no KV memory in {memory:g} GiB x "
                f"{inputs.gpu_memory_utilization:g}; raise --gpu-memory-utilization, quantize "
                "the weights (--weights-gib), raise --tensor-parallel-size or use a larger GPU"
            )
    pool_bytes = int(pool_gib * GIB)
    num_blocks = pool_bytes // (per_gpu_token * bs)
    if num_blocks < 1:
        raise ValueError(
            f"a KV pool of {pool_bytes:,} bytes per GPU is smaller than one {bs}-token block "
            f"({per_gpu_token * bs:,} bytes); give a larger --kv-pool-gib or GPU memory budget"
        )
    blocks_per_request = math.ceil(inputs.max_model_len / bs)
    concurrency = num_blocks / blocks_per_request
    band: Band = ("under_10x" if concurrency < 10
                  else "10_to_50x" if concurrency < 50 else "50x_and_up")
    return Plan(
        inputs=inputs,
        kv_bytes_per_token=per_gpu_token * tp,
        kv_bytes_per_token_per_gpu=per_gpu_token,
        kv_bytes_per_block=per_gpu_token * tp * bs,
        kv_bytes_per_block_per_gpu=per_gpu_token * bs,
        kv_pool_bytes_per_gpu=pool_bytes,
        num_blocks=num_blocks,
        kv_cache_tokens=num_blocks * bs,
        blocks_per_request=blocks_per_request,
        max_concurrency=concurrency,
        band=band,
        advice=(),
        caveats=(),
    )


def _what_if(inputs: PlanInputs, **changes: Any) -> float:
    return _measure(dataclasses.replace(inputs, **changes)).max_concurrency


def _advice(measured: Plan) -> tuple[Advice, ...]:
    """The advice for the plan's band, in order, skipping steps already taken."""
    inputs, steps = measured.inputs, []
    budgeted = inputs.memory_gib is not None
    no_fp8 = inputs.gpu is not None and not inputs.gpu.native_fp8
    if measured.band == "50x_and_up":
        return (
            Advice("check CPU cores", "the scheduler, tokenizer and detokenizer share them; "
                   "a starved CPU leaves the GPU waiting between steps", None),
            Advice("check tokenization cost", "long prompts tokenized on the request path "
                   "delay every step behind them", None),
            Advice("check whether --max-num-batched-tokens is too small",
                   "it caps the prefill tokens per step; long prompts need it raised", None),
        )
    if not inputs.fp8_kv:
        steps.append(Advice(
            "--kv-cache-dtype fp8",
            "halves KV bytes per token, doubling concurrency; check quality on your own "
            "evaluation set (long-context exact recall degrades slightly)",
            _what_if(inputs, kv_cache_dtype="fp8")))
    if measured.band == "10_to_50x":
        if inputs.gpu_memory_utilization < 0.93:
            steps.append(Advice(
                "raise --gpu-memory-utilization to 0.93-0.95",
                "every extra GiB of the budget goes to the KV pool",
                _what_if(inputs, gpu_memory_utilization=0.95) if budgeted else None))
        steps.append(Advice(
            "watch preemption metrics",
            "traffic peaks beyond the pool preempt requests: a rising "
            "vllm:num_preemptions_total means the pool is too small at peak", None))
        return tuple(steps)
    half = inputs.max_model_len // 2
    steps.append(Advice(
        f"lower --max-model-len (half is {half:,})",
        "the worst case each request reserves shrinks with it",
        _what_if(inputs, max_model_len=half) if half >= 1 else None))
    shrink = 4 if no_fp8 else 2  # AWQ 4-bit without native fp8 (Ampere), FP8 elsewhere
    steps.append(Advice(
        "quantize the weights (AWQ)" if no_fp8 else "quantize the weights (FP8 or AWQ)",
        f"the figure assumes {'AWQ 4-bit (a quarter' if no_fp8 else 'FP8 (half'} of the "
        "weight memory); the freed memory joins the KV pool",
        _what_if(inputs, weights_gib=inputs.weights / shrink)
        if budgeted and inputs.weights is not None else None))
    tp = inputs.tensor_parallel_size * 2
    steps.append(Advice(
        f"raise --tensor-parallel-size to {tp}",
        "each GPU holds a share of the weights and of every token's KV heads",
        _what_if(inputs, tensor_parallel_size=tp)
        if _check_tp(inputs.model, tp) is None else None))
    steps.append(Advice(
        "switch to a GQA model with fewer KV heads",
        f"KV bytes scale with KV heads ({inputs.model.num_kv_heads} here); grouped-query "
        "attention shares each KV head among several query heads", None))
    return tuple(steps)


def _caveats(measured: Plan) -> tuple[str, ...]:
    inputs, out = measured.inputs, []
    fp8_in_play = inputs.fp8_kv or any(a.action.startswith("--kv-cache-dtype fp8")
                                       for a in measured.advice)
    if fp8_in_play and inputs.gpu is None:
        out.append("fp8 KV needs Ada (L40S, RTX 4090) or Hopper (H100, H200) or newer; Ampere "
                   "(A100) has no native fp8 and software conversion gives back part of the gain")
    elif fp8_in_play and inputs.gpu is not None and not inputs.gpu.native_fp8:
        out.append(f"{inputs.gpu.name} is {inputs.gpu.architecture.capitalize()}: no native fp8, "
                   "so fp8 KV runs through software conversion and gives back part of the gain; "
                   "fp8 needs Ada (L40S, RTX 4090) or Hopper (H100, H200) or newer")
    if inputs.fp8_kv and measured.max_concurrency > 100:
        out.append("above 100x, memory is not the bottleneck: fp16/bf16 KV (--kv-cache-dtype "
                   "auto) keeps its quality margin at no capacity cost that matters")
    return tuple(out)


def plan(inputs: PlanInputs) -> Plan:
    """vLLM's start-up figures for ``inputs``, the advice for their band, and caveats.

    Raises ValueError naming the fix when the budget leaves less than one block."""
    measured = _measure(inputs)
    with_advice = dataclasses.replace(measured, advice=_advice(measured))
    return dataclasses.replace(with_advice, caveats=_caveats(with_advice))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its 1-based line number in the file and its lengths in tokens."""

    line: int
    prompt_len: int
    output_len: int


_FIELD_ALIASES = (("prompt_len", "prompt_tokens"), ("output_len", "completion_tokens"))
_TRACE_FIX = 'write one JSON object per line, e.g. {"prompt_len": 512, "output_len": 128}'


def parse_trace(lines: Iterable[str], source: str = "trace") -> tuple[TraceRequest, ...]:
    """Parse JSON lines, each an object with ``prompt_len`` and ``output_len`` (OpenAI usage
    names ``prompt_tokens``/``completion_tokens`` also accepted). Blank lines are skipped.
    Raises ValueError naming the file, line number and fix for a bad line or an empty trace."""
    out: list[TraceRequest] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{source} line {number}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON ({exc.msg}); {_TRACE_FIX}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where} is not a JSON object; {_TRACE_FIX}")
        values: list[int] = []
        for name, alias in _FIELD_ALIASES:
            value = obj.get(name, obj.get(alias))
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {name} must be a non-negative integer, "
                                 f"got {value!r}; {_TRACE_FIX}")
            values.append(value)
        if values[0] + values[1] < 1:
            raise ValueError(f"{where}: the request has no tokens; {_TRACE_FIX}")
        out.append(TraceRequest(number, values[0], values[1]))
    if not out:
        raise ValueError(f"{source} holds no requests; {_TRACE_FIX}")
    return tuple(out)


@dataclass(frozen=True)
class TraceWaste:
    """KV memory a trace reserves and wastes (reserved but never written), in tokens and bytes
    (whole TP group), under contiguous allocation at max length and under paged allocation.
    ``*_fit`` is how many such requests the plan's pool holds at once."""

    requests: int
    tokens_used: int
    mean_tokens: float
    longest_tokens: int
    contiguous_reserved_tokens: int
    contiguous_wasted_tokens: int
    contiguous_wasted_bytes: int
    contiguous_waste_fraction: float
    paged_reserved_tokens: int
    paged_wasted_tokens: int
    paged_wasted_bytes: int
    paged_waste_fraction: float
    contiguous_fit: int
    paged_fit: float


def trace_waste(measured: Plan, trace: Iterable[TraceRequest]) -> TraceWaste:
    """Compare contiguous and paged allocation of ``trace`` under ``measured``'s figures.

    Raises ValueError naming the line of a request longer than the max model length."""
    inputs = measured.inputs
    bs, limit = inputs.block_size, inputs.max_model_len
    lengths: list[int] = []
    for req in trace:
        total = req.prompt_len + req.output_len
        if total > limit:
            raise ValueError(f"trace line {req.line}: {total:,} tokens exceed --max-model-len "
                             f"{limit:,}; raise --max-model-len or drop the line")
        lengths.append(total)
    assert lengths, "parse_trace never returns an empty trace"
    used = sum(lengths)
    contiguous = limit * len(lengths)
    paged = sum(math.ceil(n / bs) * bs for n in lengths)
    per_token = measured.kv_bytes_per_token
    return TraceWaste(
        requests=len(lengths),
        tokens_used=used,
        mean_tokens=used / len(lengths),
        longest_tokens=max(lengths),
        contiguous_reserved_tokens=contiguous,
        contiguous_wasted_tokens=contiguous - used,
        contiguous_wasted_bytes=(contiguous - used) * per_token,
        contiguous_waste_fraction=(contiguous - used) / contiguous,
        paged_reserved_tokens=paged,
        paged_wasted_tokens=paged - used,
        paged_wasted_bytes=(paged - used) * per_token,
        paged_waste_fraction=(paged - used) / paged,
        contiguous_fit=measured.kv_cache_tokens // limit,
        paged_fit=measured.num_blocks / (paged / bs / len(lengths)),
    )


def chat_trace(
    count: int = 300, seed: int = 2, max_model_len: int = 8192
) -> tuple[TraceRequest, ...]:
    """A deterministic, realistic chat mix (the bundled ``examples/chat_trace.jsonl``):
    60% single turns (prompt median ~300 tokens), 30% multi-turn with history (~1,500),
    10% document questions (~4,000); answers median ~250 tokens, at most a quarter of
    ``max_model_len``; long documents are truncated so every request fits ``max_model_len``.
    Lengths are log-normal draws from ``random.Random(seed)``; mean ~1.5K tokens."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for line in range(1, count + 1):
        kind = rng.random()
        prompt_median = 300 if kind < 0.6 else 1500 if kind < 0.9 else 4000
        prompt = max(8, int(rng.lognormvariate(math.log(prompt_median), 0.6)))
        output = max(1, int(rng.lognormvariate(math.log(250), 0.8)))
        output = min(output, max_model_len // 4)
        out.append(TraceRequest(line, min(prompt, max_model_len - output), output))
    return tuple(out)


def trace_line(req: TraceRequest) -> str:
    """``req`` as one line of the trace format (no newline)."""
    return json.dumps({"prompt_len": req.prompt_len, "output_len": req.output_len})
