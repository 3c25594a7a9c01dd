"""`tierd plan`: size the KV pool the way vLLM will, and say what to do about it.

Prints vLLM's start-up figures (bytes per token and per block, ``GPU KV cache size: N tokens``,
``Maximum concurrency for L tokens per request: X.XXx``), the advice for that concurrency
band, and with ``--trace`` the KV memory contiguous allocation would waste compared
with paged allocation. All computation lives in :mod:`tierd.planner`; this module parses flags
and renders text or JSON. It never imports torch, so it answers instantly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from pathlib import Path

from tierd import planner
from tierd.planner import Plan, PlanInputs, TraceWaste

HELP = ("Plan KV-cache memory: vLLM's start-up figures, concurrency advice, "
        "paged-vs-contiguous waste.")

_BUNDLED_TRACE = Path(__file__).resolve().parents[2] / "examples" / "chat_trace.jsonl"


def configure(parser: argparse.ArgumentParser) -> None:
    presets = ", ".join(s.name for s in planner.PRESETS.values())
    gpus = ", ".join(s.name for s in planner.GPUS.values())
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="Llama-3-8B", metavar="PRESET",
                       help=f"model preset, case-insensitive: {presets}; or custom, with the three "
                            "shape flags below (default: %(default)s)")
    model.add_argument("--layers", type=int, metavar="N",
                       help="number of transformer layers (overrides the preset)")
    model.add_argument("--kv-heads", type=int, metavar="N",
                       help="number of KV heads per layer, after GQA (overrides the preset)")
    model.add_argument("--head-dim", type=int, metavar="N",
                       help="dimension of one attention head (overrides the preset)")
    model.add_argument("--weights-gib", type=float, metavar="GIB",
                       help="weight memory of the whole model in GiB, split over the TP group "
                            "(default: the preset's parameters at 2 bytes each; needed for a "
                            "custom shape planned from GPU memory)")
    kv = parser.add_argument_group("KV cache (vLLM's flags)")
    kv.add_argument("--kv-cache-dtype", "--kv-dtype", default="auto",
                    choices=list(planner.KV_DTYPE_BYTES), metavar="DTYPE",
                    help="KV element type: auto/fp16/bf16 take 2 bytes, fp8/fp8_e4m3/fp8_e5m2 "
                         "take 1 (default: %(default)s)")
    kv.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                    help="tokens per KV block: 8, 16, 32, 64 or 128 (default: %(default)s)")
    kv.add_argument("--max-model-len", type=int, default=8192, metavar="TOKENS",
                    help="longest request (prompt + output) the engine accepts; the concurrency "
                         "figure assumes every request uses it all (default: %(default)s)")
    kv.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                    help="GPUs sharing the model; each holds 1/N of the weights and KV heads "
                         "(default: %(default)s)")
    mem = parser.add_argument_group("memory: give --kv-pool-gib, or a GPU budget")
    mem.add_argument("--kv-pool-gib", type=float, metavar="GIB",
                     help="KV pool per GPU in GiB, as vLLM would find it (skips the budget)")
    mem.add_argument("--gpu-memory-gib", type=float, metavar="GIB",
                     help="memory of one GPU in GiB (default: the --gpu model's nominal size)")
    mem.add_argument("--gpu", metavar="NAME",
                     help=f"GPU model, for the fp8 caveat and a default memory size: {gpus}")
    mem.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                     help="share of GPU memory vLLM may use, in (0, 1] (default: %(default)s)")
    mem.add_argument("--overhead-gib", type=float, default=4.0, metavar="GIB",
                     help="per-GPU allowance for peak activations, CUDA graphs and non-torch "
                          "memory, which vLLM profiles at start-up (default: %(default)s)")
    out = parser.add_argument_group("output")
    out.add_argument("--trace", type=Path, metavar="FILE",
                     help='JSON lines, one request each: {"prompt_len": P, "output_len": O}; '
                          "reports KV wasted by contiguous vs paged allocation "
                          f"(a realistic mix: {Path('examples') / _BUNDLED_TRACE.name})")
    out.add_argument("--json", action="store_true", help="print every figure as JSON")


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Build the planner's inputs from parsed flags; raises ValueError naming the fix.

    ``--model custom`` takes its shape from ``--layers``/``--kv-heads``/``--head-dim`` alone;
    any of them on a preset overrides that field and drops the preset's parameter count."""
    given = {field: value for field, value in (
        ("num_layers", args.layers), ("num_kv_heads", args.kv_heads), ("head_dim", args.head_dim),
    ) if value is not None}
    if args.model.lower() == "custom":
        if len(given) < 3:
            raise ValueError("--model custom needs --layers, --kv-heads and --head-dim")
        shape = planner.ModelShape("custom", **given)
    else:
        shape = planner.preset(args.model)
        if given:
            shape = dataclasses.replace(shape, name=f"{shape.name} (custom shape)",
                                        num_params=None, **given)
    return PlanInputs(
        model=shape,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_pool_gib=args.kv_pool_gib,
        gpu_memory_gib=args.gpu_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weights_gib=args.weights_gib,
        overhead_gib=args.overhead_gib,
        gpu=planner.gpu(args.gpu) if args.gpu else None,
    )


def run(args: argparse.Namespace) -> int:
    result = planner.plan(inputs_from_args(args))
    waste = None
    if args.trace is not None:
        if not args.trace.is_file():
            raise ValueError(f"trace file {args.trace} does not exist; fix --trace")
        trace = planner.parse_trace(args.trace.read_text().splitlines(), source=str(args.trace))
        waste = planner.trace_waste(result, trace)
    if args.json:
        doc = {"plan": result.to_dict(),
               "trace": None if waste is None else dataclasses.asdict(waste)}
        print(json.dumps(doc, indent=2))
    else:
        print(render_plan(result))
        if waste is not None:
            print()
            print(render_waste(waste, result, str(args.trace)))
    return 0


def size(num_bytes: float) -> str:
    """Binary size with at most two decimals: ``128 KiB``, ``2 MiB``, ``2.25 MiB``."""
    value, unit = float(num_bytes), "bytes"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{value:.2f}".rstrip("0").rstrip(".") + f" {unit}"


_BAND_TEXT = {
    "under_10x": "under 10x: memory is badly short. Try, in order:",
    "10_to_50x": "10-50x: workable, but traffic peaks will trigger preemption. Try, in order:",
    "50x_and_up": "50x or more: memory is enough; the bottleneck is elsewhere:",
}


def render_plan(p: Plan) -> str:
    """The plan as text: shape, per-token and per-block bytes, pool, vLLM's lines, advice."""
    i, m = p.inputs, p.inputs.model
    tp = i.tensor_parallel_size
    lines = [
        f"{m.name}: {m.num_layers} layers x {m.num_kv_heads} KV heads x head dim {m.head_dim}, "
        f"KV dtype {i.kv_cache_dtype} ({i.kv_dtype_bytes} byte{'s' * (i.kv_dtype_bytes > 1)}), "
        f"block size {i.block_size}, tensor parallel {tp}",
    ]

    def split(total: int, per_gpu: int, note: str = "") -> str:
        return size(total) + note + (f", {size(per_gpu)} on each of {tp} GPUs" if tp > 1 else "")

    lines.append(f"KV bytes per token: {split(p.kv_bytes_per_token, p.kv_bytes_per_token_per_gpu)}")
    lines.append("KV bytes per block: " + split(
        p.kv_bytes_per_block, p.kv_bytes_per_block_per_gpu, f" ({i.block_size} tokens)"))
    memory, weights = i.memory_gib, i.weights
    if memory is None or weights is None:
        lines.append(f"KV pool: {size(p.kv_pool_bytes_per_gpu)} per GPU (given)")
    else:
        lines.append(
            f"KV pool: {memory:g} GiB x {i.gpu_memory_utilization:g} - weights "
            f"{weights / tp:.2f} GiB - overhead {i.overhead_gib:g} GiB = "
            f"{size(p.kv_pool_bytes_per_gpu)} per GPU")
    lines.append(f"KV blocks: {p.num_blocks:,} per GPU, {p.blocks_per_request:,} per "
                 f"{i.max_model_len:,}-token request")
    lines.extend(p.startup_lines())
    lines.append("")
    lines.append(f"Concurrency {p.max_concurrency:.2f}x is {_BAND_TEXT[p.band]}")
    for n, step in enumerate(p.advice, start=1):
        after = "" if step.concurrency_after is None else f" -> {step.concurrency_after:.2f}x"
        lines.extend(_wrap(f"{n}. {step.action}{after}: {step.why}", first="  ", rest="     "))
    for caveat in p.caveats:
        lines.extend(_wrap(f"Caveat: {caveat}", first="", rest="  "))
    return "\n".join(lines)


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, width=96, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False)


def render_waste(w: TraceWaste, p: Plan, source: str) -> str:
    """The trace comparison as text."""
    i = p.inputs
    return "\n".join([
        f"Trace {source}: {w.requests:,} requests, mean {w.mean_tokens:,.0f} tokens, "
        f"longest {w.longest_tokens:,}",
        f"  contiguous (each reserves {i.max_model_len:,} tokens): "
        f"{size(w.contiguous_wasted_bytes)} wasted, {w.contiguous_waste_fraction:.1%} of what "
        f"it reserves; {w.contiguous_fit:,} requests fit at once",
        f"  paged ({i.block_size}-token blocks, only last blocks partly empty): "
        f"{size(w.paged_wasted_bytes)} wasted, {w.paged_waste_fraction:.2%} of what it "
        f"reserves; {w.paged_fit:,.0f} such requests fit at once",
    ])


def _indent(text: str) -> str:
    return "\n".join(("   " + line) if line else "" for line in text.splitlines())


def walkthrough() -> int:
    """`tierd demo` until the daemon exists: a narrated tour of a few plans and a trace."""
    llama = planner.preset("Llama-3-8B")
    tours: list[tuple[str, str, PlanInputs]] = [
        ("Llama-3-8B with fp16 KV in a 48 GiB pool.",
         "--model Llama-3-8B --kv-pool-gib 48",
         PlanInputs(llama, kv_pool_gib=48)),
        ("The same pool with fp8 KV: half the bytes per token, so twice the tokens and "
         "twice the concurrency.",
         "--model Llama-3-8B --kv-pool-gib 48 --kv-cache-dtype fp8",
         PlanInputs(llama, kv_cache_dtype="fp8", kv_pool_gib=48)),
        ("Budgeting from the GPU instead: Qwen3-8B on one L40S at 0.92 utilization "
         "(a chatbot).",
         "--model Qwen3-8B --gpu L40S --gpu-memory-utilization 0.92 --overhead-gib 6",
         PlanInputs(planner.preset("Qwen3-8B"), gpu=planner.gpu("L40S"),
                    gpu_memory_utilization=0.92, overhead_gib=6)),
        ("Long context on Ampere: Qwen3-32B on 2x A100 at 131,072 tokens. "
         "Under 10x, and no native fp8.",
         "--model Qwen3-32B --gpu A100 -tp 2 --gpu-memory-utilization 0.95 "
         "--max-model-len 131072",
         PlanInputs(planner.preset("Qwen3-32B"), gpu=planner.gpu("A100"),
                    tensor_parallel_size=2, gpu_memory_utilization=0.95,
                    max_model_len=131072)),
    ]
    print("tierd plan walk-through: what vLLM will print at start-up, and what to do about it.")
    for n, (story, flags, inputs) in enumerate(tours, start=1):
        print(f"\n{n}. {story}\n   $ tierd plan {flags}")
        print(_indent(render_plan(planner.plan(inputs))))
    base = planner.plan(tours[0][2])
    if _BUNDLED_TRACE.is_file():
        source = str(Path("examples") / _BUNDLED_TRACE.name)
        trace = planner.parse_trace(_BUNDLED_TRACE.read_text().splitlines(), source=source)
    else:  # an installed wheel carries no examples/: the same mix, generated in memory
        source, trace = "tierd.planner.chat_trace()", planner.chat_trace()
    print(f"\n{len(tours) + 1}. Why paging: the bundled chat mix in the first plan's pool. "
          "Contiguous allocation reserves the maximum length for every request; paging wastes "
          "only each request's last partial block.\n   $ tierd plan --model Llama-3-8B "
          "--kv-pool-gib 48 --trace examples/chat_trace.jsonl")
    print(_indent(render_waste(planner.trace_waste(base, trace), base, source)))
    print("\nSee docs/planning.md for the formulas and every flag (`tierd plan --help`).")
    return 0
