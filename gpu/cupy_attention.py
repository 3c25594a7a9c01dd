"""The CUDA decode kernel (``paged_attention.cu``) compiled by CuPy at run time and launched on
torch CUDA tensors.

CuPy is optional (the ``gpu`` extra) and imported only here, lazily: :func:`available` is False
without CuPy or without a CUDA device, and ``attention.paged_attention`` then stays on Torch.
Each (query dtype, cache dtype, head size, block size) compiles once per process through NVRTC,
selected by a template name expression; CuPy also caches the binary on disk.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from .attention import validate_attention_args
from .layout import VECTOR_BYTES

SOURCE = Path(__file__).with_name("paged_attention.cu")
NUM_THREADS = 128
DEFAULT_SHARED_BYTES = 48 << 10  # usable without opting in

TYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}
# Same-size views CuPy understands (it has no bfloat16 or float8); the kernel sees raw bits.
_CUPY_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


@functools.cache
def available() -> bool:
    """True when CuPy imports and sees a CUDA device (the kernel can run here)."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


def kernel_name(query_dtype: torch.dtype, cache_dtype: torch.dtype, head: int, block: int) -> str:
    """The template name expression of one kernel configuration."""
    q, c = TYPE_CODES[query_dtype], TYPE_CODES[cache_dtype]
    return f"paged_attention_decode<{q}, {c}, {head}, {block}, {NUM_THREADS}>"


def shared_mem_bytes(max_seq_len: int, head_size: int, block_size: int) -> int:
    """Dynamic shared memory of one launch: the logits, or the cross-warp output buffer."""
    logits = -(-max_seq_len // block_size) * block_size
    reduction = (NUM_THREADS // 64) * head_size
    return 4 * max(logits, reduction)


@functools.cache
def _kernel(name: str) -> Any:
    import cupy

    module = cupy.RawModule(
        code=SOURCE.read_text(), options=("--std=c++17",), name_expressions=(name,)
    )
    return module.get_function(name)


def _cupy(t: torch.Tensor) -> Any:
    import cupy

    return cupy.asarray(t.view(_CUPY_VIEW.get(t.dtype, t.dtype)))


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (one query token per sequence) with the CUDA kernel.

    Same arguments and result as ``attention.paged_attention`` without ``query_start_loc``.
    Launches asynchronously on torch's current stream; raises ValueError (before compiling or
    launching) on bad arguments, on a layout the kernel cannot read (inner cache dimensions not
    contiguous, pointers not 16-byte aligned) or on a context too long for shared memory.
    """
    import cupy
    import numpy as np

    batch = validate_attention_args(
        query, k_cache, v_cache, block_tables, seq_lens, None, out
    )
    if not query.is_cuda:
        raise ValueError("the CuPy kernel needs CUDA tensors; use backend='torch' on CPU")
    num_seqs, num_heads, head_size = query.shape
    _, num_kv_heads, d_over_x, block_size, x = k_cache.shape
    if k_cache.stride()[1:] != (d_over_x * block_size * x, block_size * x, x, 1):
        raise ValueError("k_cache's per-block dimensions must be contiguous (allocate_kv_cache)")
    if v_cache.stride()[1:] != (head_size * block_size, block_size, 1):
        raise ValueError("v_cache's per-block dimensions must be contiguous (allocate_kv_cache)")
    if v_cache.stride(0) != k_cache.stride(0):
        raise ValueError("k_cache and v_cache must share one block stride")
    if query.stride()[1:] != (head_size, 1):
        raise ValueError("query rows must be contiguous [num_heads, head_size]")
    if k_cache.data_ptr() % VECTOR_BYTES or v_cache.data_ptr() % VECTOR_BYTES:
        raise ValueError("cache pointers must be 16-byte aligned for vector loads")
    result = torch.empty_like(query) if out is None else out
    if not result.is_contiguous():
        raise ValueError("out must be contiguous")
    shared = shared_mem_bytes(max(batch.seq_lens), head_size, block_size)
    device = cupy.cuda.Device(query.device.index)
    limit = int(device.attributes["MaxSharedMemoryPerBlockOptin"]) - 4 * (head_size + 16)
    if shared > limit:
        raise ValueError(
            f"context of {max(batch.seq_lens)} tokens needs {shared} B of shared memory "
            f"(> {limit}); use backend='torch' for it"
        )
    kernel = _kernel(kernel_name(query.dtype, k_cache.dtype, head_size, block_size))
    if shared > DEFAULT_SHARED_BYTES:
        kernel.max_dynamic_shared_size_bytes = shared
    tables = block_tables.to(device=query.device, dtype=torch.int32).contiguous()
    lens = seq_lens.to(device=query.device, dtype=torch.int32).contiguous()
    args = (
        _cupy(result), _cupy(query), _cupy(k_cache), _cupy(v_cache), _cupy(tables), _cupy(lens),
        np.int32(num_kv_heads), np.float32(scale), np.int32(tables.shape[1]),
        np.int64(query.stride(0)), np.int64(k_cache.stride(0)), np.int64(k_cache.stride(1)),
        np.float32(k_scale), np.float32(v_scale),
    )  # fmt: skip
    with device, cupy.cuda.ExternalStream(torch.cuda.current_stream(query.device).cuda_stream):
        kernel((num_heads, num_seqs), (NUM_THREADS,), args, shared_mem=shared)
    return result
