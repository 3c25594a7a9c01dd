"""Paged KV layout and paged attention on the hot tier (Torch everywhere, CuPy on CUDA): the KV
pool and its per-layer views (``layout``), writes and block copies (``cache_ops``), decode and
prefill attention (``attention``, ``cupy_attention``), FP8 storage (``fp8``). The entry points
are listed in docs/kv-layout.md; everything raises ValueError on bad arguments first.
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
