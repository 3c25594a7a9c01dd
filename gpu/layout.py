"""The paged KV cache: per-layer K/V views over one pool whose rows are whole tier blocks.

Per layer, in vLLM's original PagedAttention layout (``x = 16 bytes / element size``)::

    K: [num_blocks, num_kv_heads, head_size // x, block_size, x]
    V: [num_blocks, num_kv_heads, head_size, block_size]

All layers share one byte pool ``[num_blocks, block_bytes]``: row ``b`` holds layer 0's K and V of
block ``b``, then layer 1's, and so on. That row is exactly what a daemon DRAM slot holds, so tier
transfers move one contiguous unit per block and one batched index op per transfer
(``cache_ops.gather_blocks`` / ``scatter_blocks``). Each layer's K/V is a strided view into the
pool (block stride = ``block_bytes``, inner dimensions contiguous); see docs/kv-layout.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierd.wire.layout import Dtype

from .fp8 import KVCacheDtype, is_fp8, resolve_cache_dtype

SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 112, 128, 256)
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)
MODEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES: dict[torch.dtype, Dtype] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2",
}
"""tierd's name (``Layout.dtype``) of each KV element type an engine may store."""
VECTOR_BYTES = 16  # one 128-bit load: the unit K's innermost dimension is sized to


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of a paged KV cache; everything a tier needs to size and tag its slots."""

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype  # the model's activation dtype (queries, outputs)
    kv_cache_dtype: KVCacheDtype = "auto"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_geometry(self.head_size, self.block_size, self.dtype)
        resolve_cache_dtype(self.kv_cache_dtype, self.dtype)  # raises on an unknown name

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype K/V are stored in (the model dtype, or an FP8 dtype)."""
        return resolve_cache_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.cache_dtype).element_size()

    @property
    def x(self) -> int:
        """Elements per 16-byte vector: K's innermost dimension."""
        return VECTOR_BYTES // self.element_size

    @property
    def layer_block_elems(self) -> int:
        """Elements of one layer's K (or V) in one block."""
        return self.num_kv_heads * self.head_size * self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V: one daemon slot."""
        return self.num_layers * 2 * self.layer_block_elems * self.element_size

    @property
    def k_shape(self) -> tuple[int, int, int, int, int]:
        h, d, b, x = self.num_kv_heads, self.head_size, self.block_size, self.x
        return (self.num_blocks, h, d // x, b, x)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.head_size, self.block_size)

    @property
    def layout_tag(self) -> str:
        """Names the byte layout of a slot; two engines may share slots only if tags match."""
        dt = str(self.cache_dtype).removeprefix("torch.")
        return (
            f"tierd-paged-v1/L{self.num_layers}/H{self.num_kv_heads}/D{self.head_size}"
            f"/B{self.block_size}/{dt}"
        )


def check_geometry(head_size: int, block_size: int, dtype: torch.dtype) -> None:
    """Raise ValueError unless head size, block size and model dtype are supported."""
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head_size {head_size} is unsupported; use one of {SUPPORTED_HEAD_SIZES}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size} is unsupported; use one of {SUPPORTED_BLOCK_SIZES}"
        )
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"model dtype {dtype} is unsupported; use one of {MODEL_DTYPES}")


@dataclass(slots=True)
class KVCache:
    """All layers' paged K/V caches as views over one ``[num_blocks, block_bytes]`` byte pool.

    ``k_caches[i]`` / ``v_caches[i]`` alias ``pool``; writing either changes the pool's rows and
    vice versa. ``k_scales`` / ``v_scales`` are the per-layer, per-tensor FP8 scales (1.0 and
    unused for non-FP8 caches); an engine may set them after calibration, before storing.
    Blocks start zeroed; attention reads whole blocks, so a slot past a sequence's length must
    hold a finite value (zeros or anything written earlier), never uninitialised memory.
    """

    spec: KVCacheSpec
    pool: torch.Tensor  # uint8 [num_blocks, block_bytes], contiguous
    k_caches: list[torch.Tensor] = field(default_factory=list)
    v_caches: list[torch.Tensor] = field(default_factory=list)
    k_scales: list[float] = field(default_factory=list)
    v_scales: list[float] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def check_integrity(self) -> None:
        """Assert every layer view aliases the pool at its documented offset and shape."""
        spec = self.spec
        assert self.pool.dtype == torch.uint8 and self.pool.is_contiguous(), "pool must be bytes"
        assert tuple(self.pool.shape) == (spec.num_blocks, spec.block_bytes), "pool shape drifted"
        assert len(self.k_caches) == len(self.v_caches) == spec.num_layers, "one K and V per layer"
        assert len(self.k_scales) == len(self.v_scales) == spec.num_layers, "one scale per layer"
        unit = spec.layer_block_elems * spec.element_size
        base = self.pool.data_ptr()
        row = spec.block_bytes // spec.element_size
        for i, (k, v) in enumerate(zip(self.k_caches, self.v_caches)):
            assert tuple(k.shape) == spec.k_shape and tuple(v.shape) == spec.v_shape, f"layer {i}"
            assert k.dtype == v.dtype == spec.cache_dtype, f"layer {i} dtype drifted"
            assert k.data_ptr() == base + 2 * i * unit, f"layer {i} K is not at its offset"
            assert v.data_ptr() == base + (2 * i + 1) * unit, f"layer {i} V is not at its offset"
            assert k.stride(0) == v.stride(0) == row, f"layer {i} block stride is not a pool row"
        for s in (*self.k_scales, *self.v_scales):
            assert s > 0.0, "FP8 scales must be positive"


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_cache_dtype: KVCacheDtype = "auto",
) -> KVCache:
    """Allocate a zeroed pool and carve per-layer K/V views out of it.

    Blocks until the memory is zeroed (on CPU this is the first touch of every page: allocate
    once at start-up). The pool lives until the returned ``KVCache`` is dropped.
    """
    spec = KVCacheSpec(
        num_layers, num_blocks, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype
    )
    pool = torch.zeros(num_blocks, spec.block_bytes, dtype=torch.uint8, device=device)
    return kv_cache_from_pool(spec, pool)


def kv_cache_from_pool(spec: KVCacheSpec, pool: torch.Tensor) -> KVCache:
    """Wrap an existing byte pool (e.g. one the caller allocated or mapped) as a ``KVCache``."""
    if pool.dtype != torch.uint8 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous uint8 tensor")
    if tuple(pool.shape) != (spec.num_blocks, spec.block_bytes):
        raise ValueError(
            f"pool shape {tuple(pool.shape)} != (num_blocks, block_bytes) "
            f"{(spec.num_blocks, spec.block_bytes)}"
        )
    unit = spec.layer_block_elems * spec.element_size
    k_caches: list[torch.Tensor] = []
    v_caches: list[torch.Tensor] = []
    h, d, b, x = spec.num_kv_heads, spec.head_size, spec.block_size, spec.x
    for layer in range(spec.num_layers):
        k_bytes = pool[:, 2 * layer * unit : (2 * layer + 1) * unit]
        v_bytes = pool[:, (2 * layer + 1) * unit : (2 * layer + 2) * unit]
        # Split the contiguous last dimension in place: the block stride stays one pool row.
        k_caches.append(k_bytes.view(spec.cache_dtype).view(-1, h, d // x, b, x))
        v_caches.append(v_bytes.view(spec.cache_dtype).view(-1, h, d, b))
    ones = [1.0] * spec.num_layers
    return KVCache(spec, pool, k_caches, v_caches, list(ones), list(ones))


def cache_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, num_kv_heads, head_size, block_size)`` of one layer's K/V, validated."""
    if k_cache.dim() != 5 or v_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, num_kv_heads, head_size // x, block_size, x] and "
            f"v_cache [num_blocks, num_kv_heads, head_size, block_size]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    n, h, d_over_x, b, x = k_cache.shape
    if x * k_cache.element_size() != VECTOR_BYTES:
        want = VECTOR_BYTES // k_cache.element_size()
        raise ValueError(f"K's last dimension must be x = 16 bytes = {want} elements, got {x}")
    if tuple(v_cache.shape) != (n, h, d_over_x * x, b):
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)}"
        )
    if not (is_fp8(k_cache.dtype) or k_cache.dtype in MODEL_DTYPES):
        raise ValueError(f"cache dtype {k_cache.dtype} is unsupported")
    return n, h, d_over_x * x, b
