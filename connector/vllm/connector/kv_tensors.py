"""vLLM 0.33's KV tensors and tierd's slot byte order: validation and batched copies.

vLLM hands ``register_kv_caches`` (and ``save_kv_layer``) one 4-D view per layer of a single
backing buffer, logical shape ``[B, H, N, C]``: block, KV head of this TP rank, token in the
block, ``C = 2 * head_size`` (K then V of that head and token, side by side). The physical order
of the axes comes from vLLM's ``KVCacheLayout`` (LBNHC for FlashAttention, LBHNC for the CPU
backend, block-major BLHNC/BLNHC/BHLNC and LHBNC exist); only strides differ, never the
logical shape, and ``C`` is always innermost.

A tierd slot holds one vLLM block of every layer in one *canonical* order, whatever the
engine's physical layout, so engines with different attention backends share blocks::

    slot[layer][head][token][c]      layer: registration order (vLLM's layer order)
                                     head:  0..H-1, token: 0..N-1
                                     c:     C elements (K | V), raw bytes, native endianness

i.e. the LBHNC order of one block. Bytes are copied raw (``uint8`` views), so FP8 moves
unchanged; the stored checksum covers exactly these bytes. Why HND and not NHD: on a CPU engine
(vLLM's CPU backend is LBHNC) a load or store is then a plain memcpy per layer and run; on a
GPU, a layout that differs is reordered in device memory after the DMA, at HBM speed.

Copies are batched per *run*: blocks consecutive both in vLLM's block ids and in arena slots
are one strided ``copy_`` per layer (vLLM's block-id view and the arena's slot view line up).
vLLM's per-layer views are views of one buffer at a fixed layer stride; ``stack_layers``
recovers the ``[L, B, H, N, C]`` view over all of them, so a load is one ``copy_`` per run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tierd.gpu.layout import DTYPE_NAMES
from tierd.wire.layout import Dtype, Layout

KV_FORMAT = "vllm-hnc-v1"
"""``Layout.kv_format`` of slots in the order above: engines that lay a block out differently
(tierd's reference engine) never share a namespace with vLLM's, so they cannot read each
other's bytes as their own."""

_CACHE_DTYPES: dict[str, Dtype] = {
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "float16": "float16",
    "half": "float16", "bfloat16": "bfloat16", "float32": "float32", "float": "float32",
}


def dtype_name(tensor_dtype: torch.dtype, cache_dtype: str = "auto") -> Dtype:
    """tierd's name for a KV element type: vLLM's ``cache_dtype`` unless ``auto``, else the
    tensor's (or model's) dtype. ``uint8`` tensors (vLLM's FP8 storage) need an fp8 cache_dtype."""
    if cache_dtype != "auto":
        if cache_dtype not in _CACHE_DTYPES:
            raise ValueError(f"kv cache dtype {cache_dtype!r} is not supported by tierd; use "
                             f"one of {sorted(_CACHE_DTYPES)} or 'auto'")
        return _CACHE_DTYPES[cache_dtype]
    if tensor_dtype not in DTYPE_NAMES:
        raise ValueError(f"KV cache dtype {tensor_dtype} is not supported by tierd: set "
                         "--kv-cache-dtype to auto (fp16/bf16/fp32 models) or fp8")
    return DTYPE_NAMES[tensor_dtype]


@dataclass(frozen=True, slots=True)
class SlotFormat:
    """Where each registered layer's part of a block lies inside a slot."""

    layer_names: tuple[str, ...]
    block_shape: tuple[int, int, int]  # [H, N, C bytes] of one layer's block
    layer_bytes: int = field(init=False, repr=False, compare=False)  # one layer's block
    slot_bytes: int = field(init=False, repr=False, compare=False)   # every layer's

    def __post_init__(self) -> None:
        heads, tokens, width = self.block_shape
        object.__setattr__(self, "layer_bytes", heads * tokens * width)
        object.__setattr__(self, "slot_bytes", len(self.layer_names) * self.layer_bytes)


def byte_view(kv_layer: torch.Tensor) -> torch.Tensor:
    """``kv_layer`` (vLLM's ``[B, H, N, C]`` view, any ``KVCacheLayout``) as uint8
    ``[B, H, N, C * element size]``, a view: writes go through to vLLM's buffer."""
    if kv_layer.dim() != 4 or kv_layer.stride(-1) != 1 or kv_layer.shape[-1] % 2:
        raise ValueError(
            f"KV cache tensor of shape {tuple(kv_layer.shape)}, strides {kv_layer.stride()} is "
            "not vLLM 0.33's [blocks, kv_heads, block_size, 2*head_size] view with K|V "
            "innermost: tierd speaks vLLM 0.33's unified KV layout (see docs/vllm.md)")
    return kv_layer.view(torch.uint8)


def stack_layers(kv_bytes: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[L, B, H, N, C bytes]`` view over the per-layer byte views, if they are views of
    one storage with equal shapes and strides at a constant layer stride (as vLLM 0.33 allocates
    them); else None (each layer is then copied on its own)."""
    first = kv_bytes[0]
    offsets = [t.storage_offset() for t in kv_bytes]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    same = all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and t.shape == first.shape and t.stride() == first.stride() for t in kv_bytes)
    if not same or (len(offsets) > 1 and step <= 0) or any(
            b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    return first.as_strided((len(kv_bytes), *first.shape), (step, *first.stride()),
                            first.storage_offset())


def slot_format(kv_caches: Mapping[str, torch.Tensor], block_size: int, cache_dtype: str,
                tp_rank: int, tp_size: int, model_id: str) -> tuple[SlotFormat, Layout]:
    """The slot format and tierd ``Layout`` of vLLM's registered caches (all layers alike) of
    model ``model_id``. ``ValueError`` naming the fix for caches tierd cannot store."""
    if not kv_caches:
        raise ValueError("register_kv_caches got no layers")
    shapes = {name: tuple(byte_view(t).shape[1:]) for name, t in kv_caches.items()}
    first = next(iter(kv_caches.values()))
    if len(set(shapes.values())) != 1 or len({t.dtype for t in kv_caches.values()}) != 1:
        raise ValueError(f"layers differ in shape or dtype ({shapes}): tierd needs one uniform "
                         "attention layout (hybrid and MLA models are not supported)")
    heads, tokens, width = (int(d) for d in first.shape[1:])
    if tokens != block_size:
        raise ValueError(f"vLLM splits each {block_size}-token block into kernel blocks of "
                         f"{tokens} tokens; tierd stores whole blocks: set --block-size "
                         f"{tokens}")
    layout = Layout(num_layers=len(kv_caches), num_kv_heads=heads, head_size=width // 2,
                    dtype=dtype_name(first.dtype, cache_dtype), block_size=block_size,
                    tp_rank=tp_rank, tp_size=tp_size, kv_format=KV_FORMAT, model_id=model_id)
    fmt = SlotFormat(tuple(kv_caches), (heads, tokens, width * first.element_size()))
    assert fmt.slot_bytes == layout.block_bytes, "slot format and layout disagree on size"
    return fmt, layout


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` blocks that are consecutive both in vLLM (from ``block_id``) and in the arena
    (slots back to back from byte ``offset``); ``first`` is the index of the run's first block
    in the caller's list."""

    first: int
    block_id: int
    offset: int
    count: int


def runs(block_ids: Sequence[int], offsets: Sequence[int], slot_bytes: int) -> list[Run]:
    """Split parallel lists of vLLM block ids and slot byte offsets into maximal runs."""
    out: list[Run] = []
    count = min(len(block_ids), len(offsets))
    start = 0
    for i in range(1, count + 1):
        if (i == count or block_ids[i] != block_ids[i - 1] + 1
                or offsets[i] != offsets[i - 1] + slot_bytes):
            out.append(Run(start, block_ids[start], offsets[start], i - start))
            start = i
    return out


def _slots(arena: torch.Tensor, fmt: SlotFormat, run: Run) -> torch.Tensor:
    """The run's slots in the arena as ``[count, layers, H, N, C bytes]`` (a view)."""
    flat = arena[run.offset:run.offset + run.count * fmt.slot_bytes]
    return flat.view(run.count, len(fmt.layer_names), *fmt.block_shape)


def save_layer(arena: torch.Tensor, fmt: SlotFormat, layer: int, kv_bytes: torch.Tensor,
               block_runs: Sequence[Run]) -> None:
    """Copy layer ``layer`` of each run's vLLM blocks (``kv_bytes`` from ``byte_view``) into
    its slots: one strided copy per run. Blocks until the bytes are in the arena."""
    for run in block_runs:
        src = kv_bytes[run.block_id:run.block_id + run.count]
        _slots(arena, fmt, run)[:, layer].copy_(src)


def load_blocks(arena: torch.Tensor, fmt: SlotFormat, kv_bytes: Sequence[torch.Tensor],
                block_runs: Sequence[Run], stacked: torch.Tensor | None = None) -> None:
    """Copy each run's slots into its vLLM blocks of every layer (``kv_bytes`` from
    ``byte_view``, registration order): one strided copy per run over ``stacked`` (from
    ``stack_layers``) if given, else one per layer and run."""
    for run in block_runs:
        slots = _slots(arena, fmt, run)
        if stacked is not None:
            stacked[:, run.block_id:run.block_id + run.count].copy_(slots.transpose(0, 1))
            continue
        for layer, dst in enumerate(kv_bytes):
            dst[run.block_id:run.block_id + run.count].copy_(slots[:, layer])
