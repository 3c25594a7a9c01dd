"""Real SGLang 0.5.23 HiCache around tierd's storage backend: SGLang's own ``HiCacheController``
(its backup, prefetch-query, prefetch-I/O and sync threads) over a real host pool
(``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) on CPU, a world-size-1 gloo group, and a
real `tierd serve` on a temporary socket (``daemon_in``).

The one stand-in is SGLang's *device* pool (it needs CUDA): the controller reads only its
device, layer count and layer counter, and its type (MLA or not). The scheduler's part of a
prefetch (allocate host pages for the hit, hand them to the I/O thread) is ``Engine.prefetch``.

Run by `make test-sglang` (the SGLang venv); the main suite skips these modules.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs real SGLang: run `make test-sglang`")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from tierd.bench.tierd_serve import TierdServe  # noqa: E402

PAGE = 16
LAYERS = 3
HEADS = 2
HEAD = 32
DEVICE_TOKENS = 512
MLA_DIM = 96  # kv_lora_rank 64 + rope 32


class DevicePool:
    """SGLang's device KV pool as the controller sees it (no GPU here)."""

    def __init__(self, layers: int) -> None:
        self.device = torch.device("cpu")
        self.layer_num = layers

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class MLADevicePool(MLATokenToKVPool):  # type: ignore[misc]
    """The MLA device pool's type (the controller stores one copy for all ranks)."""

    def __init__(self, layers: int) -> None:
        self.device = torch.device("cpu")
        self.layer_num = layers

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class Allocator:
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def get_kvcache(self) -> Any:
        return self.pool


def host_pool(layout: str, *, mla: bool = False, page: int = PAGE,
              dtype: torch.dtype = torch.float16) -> Any:
    """A real SGLang host pool on CPU, ``layout`` ("page_first", "layer_first", ...), sized
    against a fixed budget (SGLang's own check keeps 10 GB of the host free, which a shared
    test machine may not have; these pools are ~1 MiB)."""
    with host_memory_budget_scope(1 << 30):
        return _host_pool(layout, mla, page, dtype)


def _host_pool(layout: str, mla: bool, page: int, dtype: torch.dtype) -> Any:
    common = dict(host_to_device_ratio=2.0, host_size=0, page_size=page, layout=layout,
                  pin_memory=False, device="cpu", device_capacity_tokens=DEVICE_TOKENS,
                  start_layer=0, end_layer=LAYERS)
    if mla:
        rows = tuple(torch.zeros(DEVICE_TOKENS, 1, MLA_DIM, dtype=dtype) for _ in range(LAYERS))
        info = MLABufferInfo(buffers=rows, data_ptrs=torch.tensor([r.data_ptr() for r in rows]),
                             layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS,
                             page_size=page, kv_lora_rank=64, qk_rope_head_dim=32,
                             kv_cache_dim=MLA_DIM, dtype=dtype, device=torch.device("cpu"))
        return MLATokenToKVPoolHost(info, target_layer_num=LAYERS, **common)  # type: ignore
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD, dtype=dtype) for _ in range(LAYERS))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                        v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                        layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=buffers, page_size=page, head_num=HEADS, head_dim=HEAD,
                         v_head_dim=HEAD, dtype=dtype, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, **common)  # type: ignore[arg-type]


def tierd_extra(socket_path: str, model_dir: str, **extra: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` naming tierd's backend."""
    return {"backend_name": "tierd", "module_path": "tierd.connector.sglang",
            "class_name": "TierdHiCacheStorage", "interface_v1": 1,
            "socket_path": socket_path, "model_path": model_dir, "retry_seconds": 0.0,
            **extra}


_GROUP: list[Any] = []


def tp_group() -> Any:
    """A world-size-1 gloo group (one per process)."""
    if not _GROUP:
        import torch.distributed as dist

        if not dist.is_initialized():
            store = os.path.join(tempfile.mkdtemp(prefix="tierd-gloo-"), "store")
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                    world_size=1)
        _GROUP.append(dist.new_group([0], backend="gloo"))
    return _GROUP[0]


class Engine:
    """One SGLang engine's HiCache: a host pool and SGLang's controller with a storage backend
    (tierd's unless ``backend`` says otherwise)."""

    def __init__(self, extra: dict[str, Any], *, layout: str = "page_first",
                 mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 backend: str = "dynamic", page: int = PAGE,
                 model_name: str | None = None) -> None:
        self.host = host_pool(layout, mla=mla, page=page)
        self.page = page
        device = MLADevicePool(LAYERS) if mla else DevicePool(LAYERS)
        with get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                     attn_dcp_size=1, attn_dcp_rank=0):
            self.controller = HiCacheController(
                Allocator(device), self.host, page, tp_group(), threading.Event(),
                storage_backend=backend, model_name=model_name or "tiny",
                storage_backend_extra_config=dict(extra), io_backend="direct")

    @property
    def backend(self) -> Any:
        return self.controller.storage_backend

    def fill(self, pages: int, seed: int) -> torch.Tensor:
        """New host pages holding random bytes from ``seed`` (only those pages are written:
        another thread may be loading into this pool); their host indices."""
        indices = self.host.alloc(pages * self.page)
        assert indices is not None, "host pool full"
        gen = torch.Generator().manual_seed(seed)
        for first in indices[::self.page].tolist():
            page = self.host.get_dummy_flat_data_page()
            raw = page.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
            self.host.set_from_flat_data_page(first, page)
        return indices

    def backup(self, tokens: list[int], indices: torch.Tensor) -> int:
        """SGLang's write-through to storage of ``indices`` holding ``tokens``: tokens stored."""
        keys = get_hash_str(tokens, None, page_size=self.page)
        self.controller.write_storage(indices, tokens, hash_value=keys)
        op = self.controller.ack_backup_queue.get(timeout=60)
        if hasattr(self.backend, "flush"):  # tierd: its last Commit lands (in ms), so other
            self.backend.flush()            # engines see the pages at once
        return int(op.completed_tokens)

    def prefetch(self, rid: str, tokens: list[int]) -> tuple[int, int, torch.Tensor]:
        """SGLang's prefetch of ``tokens``: (tokens storage reported held, tokens loaded, host
        indices they were loaded into)."""
        self.controller.prefetch(rid, tokens)
        op = self.controller.prefetch_hit_queue.get(timeout=60)
        hit = int(op.storage_hit_count)
        if hit == 0:
            return 0, 0, torch.empty(0, dtype=torch.int64)
        op.host_indices = self.host.alloc(hit)
        self.controller.prefetch_buffer.put(op)
        loaded = 0
        while True:
            ack = self.controller.ack_prefetch_queue.get(timeout=60)
            if ack.completed_tokens is not None:
                loaded = ack.completed_tokens
            if ack.completed_req:
                if hasattr(self.backend, "flush"):  # tierd: its Releases land (in ms)
                    self.backend.flush()
                return hit, loaded, op.host_indices

    def pages(self, indices: torch.Tensor) -> list[bytes]:
        """The bytes of each host page at ``indices`` (SGLang's flat page)."""
        return [self.host.get_data_page(int(i), flat=True).view(torch.uint8).numpy().tobytes()
                for i in indices[::self.page]]

    def close(self) -> None:
        self.controller.detach_storage_backend()


def daemon_in(workdir: str) -> TierdServe:
    """A real `tierd serve` on a Unix socket in ``workdir`` (not started), 32 MiB of DRAM, its
    SSD tier in ``workdir/ssd``: ``restart`` stops it (SIGTERM: the stop flush writes DRAM
    blocks to SSD) and starts it again on the same SSD directory. No write-behind: a block stays
    in DRAM only until the stop, so what a test reads is where the test put it (a write-behind
    pass racing a corrupted slot made the drop check flaky)."""
    return TierdServe(workdir, ["--dram-bytes", "32MiB", "--slab-bytes", "64KiB",
                                "--no-prefault", "--ssd-dir", os.path.join(workdir, "ssd"),
                                "--ssd-bytes", "64MiB", "--write-behind-seconds", "0"])


def wait_until(predicate: Any, seconds: float = 30.0) -> None:
    """Poll ``predicate`` (readiness, not timing) until true or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
