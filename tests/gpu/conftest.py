"""Fixtures for tierd.gpu tests: paged caches filled from known dense K/V."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tierd.gpu import KVCache, allocate_kv_cache, reshape_and_cache


@dataclass(frozen=True)
class PagedBatch:
    """A one-layer paged cache holding ``keys[i]`` / ``values[i]`` ([len, Hk, D]) of each sequence
    at scattered blocks, with the block table and lengths that address them."""

    cache: KVCache
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


BuildPaged = Callable[..., PagedBatch]


@pytest.fixture
def build_paged() -> BuildPaged:
    def build(
        seq_lens: list[int],
        *,
        num_kv_heads: int = 2,
        head_size: int = 64,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> PagedBatch:
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(need) + 7  # spare blocks so tables are scattered, not a prefix
        cache = allocate_kv_cache(
            1, num_blocks, num_kv_heads, head_size, block_size, dtype, "cpu",
            kv_cache_dtype,  # type: ignore[arg-type]
        )  # fmt: skip
        perm = torch.randperm(num_blocks, generator=gen)
        table = torch.full((len(seq_lens), max(need) + 2), -1, dtype=torch.int32)
        keys, values, used = [], [], 0
        for i, n in enumerate(seq_lens):
            blocks = perm[used : used + need[i]]
            used += need[i]
            table[i, : need[i]] = blocks.to(torch.int32)
            k = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
            pos = torch.arange(n)
            slots = blocks[pos // block_size] * block_size + pos % block_size
            reshape_and_cache(
                k, v, cache.k_caches[0], cache.v_caches[0], slots, k_scale=k_scale, v_scale=v_scale
            )
            keys.append(k)
            values.append(v)
        return PagedBatch(cache, keys, values, table, torch.tensor(seq_lens, dtype=torch.int32))

    return build
