"""Moving blocks between vLLM's per-layer paged KV tensors and tierd's DRAM arena slots.

A tierd slot holds one vLLM block of *every* layer. Its byte order (the same for save and
load, and what the stored checksum covers) is, in C order::

    slot[layer][kv][token][head][byte]      layer: registration order of ``register_kv_caches``
                                            kv: 0 = K, 1 = V
                                            token: 0..block_size-1 within the block
                                            head: 0..num_kv_heads-1 (this TP rank's heads)
                                            byte: head_size * element size, native endianness

i.e. for each layer, K then V of the block, each ``[block_size, num_kv_heads, head_size]`` as
flash-attention stores them. Everything is copied as raw bytes (``uint8`` views), so FP8 caches
move unchanged. Slot size = ``Layout.block_bytes``.

Saving copies one layer at a time (called as each layer finishes); loading stages all slots in
host memory first, verifies each block's checksum there, and only then writes the verified blocks
into the KV tensors: a block that fails is never written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
import torch

from tierd.checksum import block_checksum
from .vllm_link import KVCacheLayout
from tierd.daemon.layout import Dtype, Layout

_TORCH_DTYPES: dict[torch.dtype, Dtype] = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2",
}
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
    if tensor_dtype not in _TORCH_DTYPES:
        raise ValueError(f"KV cache dtype {tensor_dtype} is not supported by tierd: set "
                         "--kv-cache-dtype to auto (fp16/bf16/fp32 models) or fp8")
    return _TORCH_DTYPES[tensor_dtype]


@dataclass(frozen=True, slots=True)
class SlotFormat:
    """Where each registered layer's K/V lies inside a slot (see the module doc)."""

    layer_names: tuple[str, ...]
    layer_bytes: int               # K and V of one block of one layer
    block_shape: tuple[int, ...]   # [2, block_size, num_kv_heads, head_size * element size]

    @property
    def slot_bytes(self) -> int:
        return len(self.layer_names) * self.layer_bytes


def byte_view(kv_layer: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """``kv_layer`` as ``[2, num_blocks, block_size, num_kv_heads, head bytes]`` uint8, a view
    (writes go through). Needs the head dimension contiguous, as vLLM allocates it."""
    if kv_layer.dim() != 5 or kv_layer.shape[0 if layout == "flash_attn" else 1] != 2:
        want = "[2, blocks, block_size, heads, head_size]" if layout == "flash_attn" else \
            "[blocks, 2, block_size, heads, head_size]"
        raise ValueError(f"KV cache of shape {tuple(kv_layer.shape)} is not the {layout} layout "
                         f"{want}: set kv_cache_layout in kv_connector_extra_config")
    raw = kv_layer.view(torch.uint8)
    return raw if layout == "flash_attn" else raw.transpose(0, 1)


def slot_format(kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout,
                cache_dtype: str, tp_rank: int, tp_size: int) -> tuple[SlotFormat, Layout]:
    """The slot format and tierd ``Layout`` of vLLM's registered caches (all layers alike)."""
    if not kv_caches:
        raise ValueError("register_kv_caches got no layers")
    shapes = {name: tuple(byte_view(t, layout).shape[2:]) for name, t in kv_caches.items()}
    first = next(iter(kv_caches.values()))
    if len(set(shapes.values())) != 1 or len({t.dtype for t in kv_caches.values()}) != 1:
        raise ValueError(f"layers differ in shape or dtype ({shapes}): tierd needs one uniform "
                         "attention layout (hybrid and MLA models are not supported)")
    block_size, heads, head_size = (int(d) for d in (first.shape[-3], first.shape[-2],
                                                     first.shape[-1]))
    layout_ = Layout(num_layers=len(kv_caches), num_kv_heads=heads, head_size=head_size,
                     dtype=dtype_name(first.dtype, cache_dtype), block_size=block_size,
                     tp_rank=tp_rank, tp_size=tp_size)
    block_shape = (2, *next(iter(shapes.values())))
    fmt = SlotFormat(tuple(kv_caches), 2 * block_size * heads * head_size * first.element_size(),
                     block_shape)
    assert fmt.slot_bytes == layout_.block_bytes, "slot format and layout disagree on size"
    return fmt, layout_


def write_layer(arena: torch.Tensor, offsets: Sequence[int], fmt: SlotFormat, layer: int,
                kv_bytes: torch.Tensor, block_ids: Sequence[int]) -> None:
    """Copy layer ``layer`` of blocks ``block_ids`` (from ``byte_view``) into the slots at
    byte ``offsets`` of ``arena`` (uint8). One gather on the cache's device, then one host copy
    per block. Blocks until the bytes are in the arena."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_bytes.device)
    blocks = kv_bytes.index_select(1, index).transpose(0, 1).to("cpu")  # [n, 2, bs, h, hb]
    start = layer * fmt.layer_bytes
    for i, offset in enumerate(offsets):
        lo = offset + start
        arena[lo:lo + fmt.layer_bytes].view(fmt.block_shape).copy_(blocks[i])


def read_slots(arena: torch.Tensor, offsets: Sequence[int], slot_bytes: int) -> torch.Tensor:
    """A private host copy ``[len(offsets), slot_bytes]`` uint8 of the slots at ``offsets``."""
    staged = torch.empty((len(offsets), slot_bytes), dtype=torch.uint8)
    for i, offset in enumerate(offsets):
        staged[i].copy_(arena[offset:offset + slot_bytes])
    return staged


def verified_prefix(staged: torch.Tensor, checksums: Sequence[int]) -> int:
    """How many leading staged slots match their expected checksums."""
    for i, expected in enumerate(checksums):
        if block_checksum(staged[i].numpy().data) != expected:
            return i
    return len(checksums)


def slot_checksum(arena: torch.Tensor, offset: int, slot_bytes: int) -> int:
    """``block_checksum`` of the slot at ``offset`` as it lies in the arena."""
    return block_checksum(arena[offset:offset + slot_bytes].numpy().data)


def scatter_slots(staged: torch.Tensor, fmt: SlotFormat, kv_bytes: Sequence[torch.Tensor],
                  block_ids: Sequence[int]) -> None:
    """Write staged slots ``staged[i]`` into vLLM block ``block_ids[i]`` of every layer
    (``kv_bytes`` from ``byte_view``, registration order): one batched copy per layer."""
    if not block_ids:
        return
    per_layer = staged[:len(block_ids)].view(len(block_ids), len(fmt.layer_names),
                                             *fmt.block_shape)
    for layer, dst in enumerate(kv_bytes):
        index = torch.tensor(list(block_ids), dtype=torch.long, device=dst.device)
        dst.index_copy_(1, index, per_layer[:, layer].transpose(0, 1).to(dst.device))
