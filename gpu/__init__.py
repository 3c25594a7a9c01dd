"""Paged KV layout and paged attention on the hot tier (Torch everywhere, CuPy on CUDA).

Entry points for an engine (see docs/kv-layout.md for the byte layout):

- ``allocate_kv_cache(num_layers, num_blocks, num_kv_heads, head_size, block_size, dtype,
  device="cpu", kv_cache_dtype="auto") -> KVCache``: one zeroed byte pool whose row ``b`` is
  block ``b`` of every layer (K then V per layer), with per-layer views ``k_caches[i]``
  ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` and ``v_caches[i]``
  ``[num_blocks, num_kv_heads, head_size, block_size]``, and per-layer FP8 scales
  ``k_scales[i]`` / ``v_scales[i]``. ``KVCache.spec.block_bytes`` is the size of one daemon slot.
- ``reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, *, k_scale, v_scale)``: write
  new tokens ``[num_tokens, num_kv_heads, head_size]`` into their slots (slot ``-1`` = padding).
- ``paged_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, *,
  query_start_loc=None, k_scale=1.0, v_scale=1.0, out=None, backend="auto")``: decode when
  ``query_start_loc`` is None (one token per sequence), else varlen prefill / chunked prefill /
  mixed batches: flattened tokens with ``query_start_loc`` ``[num_seqs + 1]`` as in vLLM, and
  ``seq_lens`` counting cached + new tokens.
- ``copy_blocks(kv_cache, pairs)``: copy-on-write, every layer at once.
- ``gather_blocks(kv_cache, block_ids, out_flat)`` / ``scatter_blocks(kv_cache, block_ids, flat)``:
  between pool blocks and ``[n, block_bytes]`` rows (uint8 or a typed view), one batched copy.
- ``kv_cache_dtype``: ``"auto"`` (model dtype), ``"fp8"`` (= ``"fp8_e4m3"``), ``"fp8_e5m2"``;
  FP8 stores ``saturate(x / scale)`` and reads ``x * scale``.

Everything raises ValueError on bad arguments before touching memory or launching a kernel.
"""

from .attention import AttentionBatch, paged_attention, validate_attention_args
from .cache_ops import copy_blocks, gather_blocks, reshape_and_cache, scatter_blocks
from .fp8 import KV_CACHE_DTYPES, KVCacheDtype, resolve_cache_dtype
from .layout import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    KVCache,
    KVCacheSpec,
    allocate_kv_cache,
    kv_cache_from_pool,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "AttentionBatch",
    "KVCache",
    "KVCacheDtype",
    "KVCacheSpec",
    "allocate_kv_cache",
    "copy_blocks",
    "gather_blocks",
    "kv_cache_from_pool",
    "paged_attention",
    "reshape_and_cache",
    "resolve_cache_dtype",
    "scatter_blocks",
    "validate_attention_args",
]
