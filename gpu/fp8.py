"""FP8 KV cache: dtype names, per-tensor scaled quantization, and the error bound it implies.

A cache stored in FP8 keeps ``saturate(x / scale)`` and is read back as ``x8 * scale`` in the
model's dtype. Torch's float8 tensors on CPU can be created, cast, indexed and viewed but not used
in arithmetic, so every reader upcasts before doing math.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

# Explicit mantissa bits: a value in the normal range is rounded to within 2**-(bits + 1).
_MANTISSA_BITS: dict[torch.dtype, int] = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of ``kv_cache_dtype`` stores ("auto" = the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x / scale)`` cast to ``dtype``; values beyond the format's range clamp to it."""
    assert is_fp8(dtype), f"quantize is for FP8 caches, got {dtype}"
    if not scale > 0.0:
        raise ValueError(f"FP8 scale must be positive, got {scale}")
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x8: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x8 * scale`` in ``dtype`` (upcast first: float8 tensors have no arithmetic on CPU)."""
    out = x8.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def scale_for(x: torch.Tensor, dtype: torch.dtype) -> float:
    """A per-tensor scale that maps ``max |x|`` onto the largest finite value of ``dtype``."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    return amax / torch.finfo(dtype).max if amax > 0.0 else 1.0


def relative_rounding_error(dtype: torch.dtype) -> float:
    """Largest relative error of rounding a normal-range value to ``dtype`` (half an ulp)."""
    return 2.0 ** -(_MANTISSA_BITS[dtype] + 1)


def attention_error_bound(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> float:
    """Bound on max |attention(K8, V8) - attention(K, V)| for one FP8 cache dtype.

    ``query`` [..., D], ``key``/``value`` [..., L, D] of one head set. Rounding an element ``y`` to
    FP8 with a per-tensor scale ``s`` errs by at most ``eps * |y| + tiny * s`` (``tiny`` is half
    the smallest subnormal). Quantizing K moves each logit by at most
    ``d = scale * sum_d |q_d| (eps |k_d| + tiny * k_scale)``, which scales each softmax weight by
    a factor within ``exp(+-2d)``; quantizing V moves each value by ``eps |v| + tiny * v_scale``.
    Hence ``|err| <= (exp(2d) - 1) * max|v| + exp(2d) * (eps * max|v| + tiny * v_scale)``.
    """
    eps = relative_rounding_error(dtype)
    tiny = float(torch.finfo(dtype).smallest_normal) * 2.0 ** -(_MANTISSA_BITS[dtype] + 1)
    q = query.float().abs()
    k = key.float().abs() * eps + tiny * k_scale
    d = float((q.unsqueeze(-2) * k).sum(-1).max()) * scale
    vmax = float(value.float().abs().max())
    grow = math.exp(2.0 * d)
    return (grow - 1.0) * vmax + grow * (eps * vmax + tiny * v_scale)
