"""``DeviceTransfer``: the GPU path's copies, checked on CPU tensors against ``kv_tensors`` byte
for byte in every vLLM 0.33 layout, its staging bound, its stream/event bookkeeping (through a
recording seam) and its misuse asserts; the same round trips on CUDA where there is a GPU. And
the host path's store (``LayerViews.store``: every layer at once) against the same reference."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tierd.connector.native import verified_copy
from tierd.connector.vllm.connector import cuda_copy
from tierd.connector.vllm.connector.cuda_copy import (
    DeviceTransfer,
    Layerwise,
    Marker,
    _split,
    register_host_memory,
    unregister_host_memory,
)
from tierd.connector.vllm.connector.kv_tensors import (
    Run,
    SlotFormat,
    byte_view,
    load_blocks,
    runs,
    save_layer,
    slot_format,
    stack_layers,
)
from tierd.connector.vllm.connector.sinks import LayerViews
from tierd.daemon.arena import OwnedArena

LAYERS, HEADS, HEAD, BS, BLOCKS, SLOTS = 3, 2, 8, 4, 12, 10
ORDERS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# vLLM block ids and arena slots: runs of 3, 1 (slot gap), 2 (block gap), 1 (backwards)
BLOCK_IDS = [3, 4, 5, 6, 9, 10, 1]
SLOT_IDS = [2, 3, 4, 7, 0, 1, 9]


def kv_views(order: str, device: str = "cpu", seed: int = 0) -> list[torch.Tensor]:
    """Byte views of per-layer ``[B, H, N, C]`` fp16 views of one buffer whose physical axis
    order is ``order``, as vLLM 0.33's ``allocate_kv_cache`` builds them; random contents."""
    sizes = {"L": LAYERS, "B": BLOCKS, "H": HEADS, "N": BS, "C": 2 * HEAD}
    strides: dict[str, int] = {}
    total = 1
    for axis in reversed(order):
        strides[axis], total = total, total * sizes[axis]
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randint(0, 1 << 15, (total,), generator=gen, dtype=torch.int16)
    buffer = buffer.view(torch.float16).to(device)
    shape, stride = tuple(sizes[a] for a in "BHNC"), tuple(strides[a] for a in "BHNC")
    return [byte_view(torch.as_strided(buffer, shape, stride, i * strides["L"]))
            for i in range(LAYERS)]


def fmt_of(kv: list[torch.Tensor]) -> SlotFormat:
    caches = {f"layer.{i}": t.view(torch.float16) for i, t in enumerate(kv)}
    return slot_format(caches, BS, "auto", 0, 1, "test-model@0")[0]


def arena_for(fmt: SlotFormat, seed: int | None = None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(SLOTS * fmt.slot_bytes, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (SLOTS * fmt.slot_bytes,), generator=gen, dtype=torch.uint8)


def plan(fmt: SlotFormat) -> list[Run]:
    return runs(BLOCK_IDS, [s * fmt.slot_bytes for s in SLOT_IDS], fmt.slot_bytes)


def save_all(transfer: DeviceTransfer, block_runs: list[Run]) -> int:
    kept = transfer.open_save(block_runs)
    for layer in range(LAYERS):
        transfer.save_layer(layer)
    ticket = transfer.finish_save()
    assert ticket is not None and ticket.blocks == kept
    transfer.wait_save(ticket)
    assert transfer.save_done(ticket)
    return kept


def blocks_of(kv: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The logical contents of blocks ``ids``, ``[len, L, H, N, C]``, on the host."""
    return torch.stack([t[ids].cpu() for t in kv], dim=1)


# -- CPU: byte order against kv_tensors --------------------------------------------------------

def test_plan_has_four_runs() -> None:
    """The scenario's block/slot lists split into the runs the tests rely on."""
    fmt = fmt_of(kv_views("LBHNC"))
    assert [(r.first, r.block_id, r.count) for r in plan(fmt)] == [
        (0, 3, 3), (3, 6, 1), (4, 9, 2), (6, 1, 1)]


@pytest.mark.parametrize("order", ORDERS)
def test_save_writes_the_bytes_kv_tensors_writes(order: str) -> None:
    """A save through DeviceTransfer leaves the arena byte for byte as kv_tensors.save_layer
    does (other slots untouched), for every layout."""
    kv = kv_views(order, seed=1)
    fmt = fmt_of(kv)
    mine, ref = arena_for(fmt), arena_for(fmt)
    assert save_all(DeviceTransfer(mine, fmt, kv), plan(fmt)) == len(BLOCK_IDS)
    for layer in range(LAYERS):
        save_layer(ref, fmt, layer, kv[layer], plan(fmt))
    assert torch.equal(mine, ref)
    untouched = set(range(SLOTS)) - set(SLOT_IDS)
    assert all(not mine[s * fmt.slot_bytes:(s + 1) * fmt.slot_bytes].any() for s in untouched)


@pytest.mark.parametrize("layerwise", ["never", "always"])
@pytest.mark.parametrize("order", ORDERS)
def test_load_writes_the_blocks_kv_tensors_writes(order: str, layerwise: Layerwise) -> None:
    """A load through DeviceTransfer, run by run or layer-wise, fills vLLM's buffer as
    kv_tensors.load_blocks does (with and without the stacked view), other blocks untouched,
    for every layout."""
    fmt = fmt_of(kv_views(order))
    arena = arena_for(fmt, seed=2)
    mine, ref, ref_stacked = (kv_views(order, seed=3) for _ in range(3))
    before = blocks_of(mine, list(range(BLOCKS)))
    transfer = DeviceTransfer(arena, fmt, mine, layerwise=layerwise)
    transfer.start_load(plan(fmt))
    for layer in range(LAYERS):
        transfer.wait_layer(layer)
    transfer.wait_reads()
    transfer.wait_load()
    load_blocks(arena, fmt, ref, plan(fmt))
    load_blocks(arena, fmt, ref_stacked, plan(fmt), stack_layers(ref_stacked))
    everything = list(range(BLOCKS))
    assert torch.equal(blocks_of(mine, everything), blocks_of(ref, everything))
    assert torch.equal(blocks_of(mine, everything), blocks_of(ref_stacked, everything))
    others = sorted(set(everything) - set(BLOCK_IDS))
    assert torch.equal(blocks_of(mine, others), before[others])


@pytest.mark.parametrize("saver, loader", [("LBNHC", "BHLNC"), ("BLHNC", "LBHNC"),
                                           ("LHBNC", "BLNHC")])
def test_round_trip_between_layouts(saver: str, loader: str) -> None:
    """Blocks saved from one layout through DeviceTransfer load bit-exact into another."""
    src = kv_views(saver, seed=4)
    fmt = fmt_of(src)
    arena = arena_for(fmt)
    save_all(DeviceTransfer(arena, fmt, src), plan(fmt))
    dst = kv_views(loader, seed=5)
    transfer = DeviceTransfer(arena, fmt, dst)
    transfer.start_load(plan(fmt))
    transfer.wait_load()
    assert torch.equal(blocks_of(dst, BLOCK_IDS), blocks_of(src, BLOCK_IDS))


# -- CPU: staging ------------------------------------------------------------------------------

def test_split_cuts_runs_to_the_bound() -> None:
    """Pieces hold at most ``cap`` blocks; a cut run keeps block ids and offsets aligned."""
    pieces = _split([Run(0, 3, 200, 3), Run(3, 9, 0, 2)], 2, 100)
    assert pieces == [[Run(0, 3, 200, 2)], [Run(2, 5, 400, 1), Run(3, 9, 0, 1)],
                      [Run(4, 10, 100, 1)]]
    assert _split([], 2, 100) == []


@pytest.mark.parametrize("layerwise", ["never", "always"])
def test_staging_grows_on_demand_up_to_its_bound(layerwise: Layerwise) -> None:
    """Staging starts empty, doubles as needed, never passes the bound; a load larger than the
    bound goes through in pieces and still lands exactly."""
    kv = kv_views("LBNHC")
    fmt = fmt_of(kv)
    slot = fmt.slot_bytes
    arena = arena_for(fmt, seed=6)
    transfer = DeviceTransfer(arena, fmt, kv, max_staging_bytes=3 * slot + slot // 2,
                              layerwise=layerwise)
    assert transfer.staging_bytes == 0
    transfer.start_load(runs([0], [0], slot))
    assert transfer.staging_bytes == slot
    transfer.start_load(runs([1, 2], [slot, 2 * slot], slot))
    assert transfer.staging_bytes == 2 * slot
    transfer.start_load(plan(fmt))  # 7 blocks through 3-block pieces
    assert transfer.staging_bytes == 3 * slot + slot // 2
    ref = kv_views("LBNHC", seed=9)
    load_blocks(arena, fmt, ref, plan(fmt))
    assert torch.equal(blocks_of(kv, BLOCK_IDS), blocks_of(ref, BLOCK_IDS))


def test_a_save_beyond_the_bound_keeps_its_leading_blocks() -> None:
    """A save of 7 blocks through 3 slots of staging writes the first 3 (in run order) only."""
    kv = kv_views("BLNHC", seed=7)
    fmt = fmt_of(kv)
    mine, ref = arena_for(fmt), arena_for(fmt)
    transfer = DeviceTransfer(mine, fmt, kv, max_staging_bytes=3 * fmt.slot_bytes)
    assert save_all(transfer, plan(fmt)) == 3
    first_three = runs(BLOCK_IDS[:3], [s * fmt.slot_bytes for s in SLOT_IDS[:3]],
                       fmt.slot_bytes)
    for layer in range(LAYERS):
        save_layer(ref, fmt, layer, kv[layer], first_three)
    assert torch.equal(mine, ref)


def test_bad_arguments_name_the_fix() -> None:
    """A bound below one slot, or tensors that do not match the format, are ValueErrors."""
    kv = kv_views("LBHNC")
    fmt = fmt_of(kv)
    with pytest.raises(ValueError, match="below one slot"):
        DeviceTransfer(arena_for(fmt), fmt, kv, max_staging_bytes=fmt.slot_bytes - 1)
    with pytest.raises(ValueError, match="byte_view per layer"):
        DeviceTransfer(arena_for(fmt), fmt, kv[:2])
    with pytest.raises(ValueError, match="as_tensor"):
        DeviceTransfer(arena_for(fmt).view(SLOTS, -1), fmt, kv)


# -- CPU: ordering and misuse ------------------------------------------------------------------

class RecordingSync:
    """The stream seam, logging what DeviceTransfer asks of it (markers are numbered)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.markers = 0
        self.on_side = False

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        self.on_side = True
        yield
        self.on_side = False

    def side(self) -> contextlib.AbstractContextManager[Any]:
        return self._side()

    def after_current(self) -> None:
        self.log.append(("side waits", -1))

    def marker(self) -> Marker:
        self.markers += 1
        return RecordingMarker(self, self.markers - 1)

    def synchronize(self) -> None:
        self.log.append(("host waits all", -1))

    @property
    def strided_dma(self) -> bool:
        return True

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self.on_side, "DMAs are queued on the side stream"
        self.log.append(("2-D DMA", src.shape[0]))
        dst.copy_(src)


class RecordingMarker:
    def __init__(self, sync: RecordingSync, number: int) -> None:
        self.sync, self.number = sync, number

    def record(self) -> None:
        assert self.sync.on_side, "markers are recorded on the side stream"
        self.sync.log.append(("record", self.number))

    def block_current(self) -> None:
        self.sync.log.append(("current waits", self.number))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.sync.log.append(("host waits", self.number))


def test_load_records_one_marker_per_layer_after_the_side_waits() -> None:
    """start_load orders itself after the current stream, marks the arena reads, then each
    layer in order; wait_layer makes the current stream (not the host) wait on that layer."""
    kv = kv_views("LBNHC")
    fmt = fmt_of(kv)
    sync = RecordingSync()
    transfer = DeviceTransfer(arena_for(fmt, seed=1), fmt, kv, sync=sync)
    layer_markers, read = [0, 1, 2], 3
    transfer.start_load(plan(fmt))
    transfer.wait_layer(2)
    transfer.wait_layer(0)
    transfer.wait_reads()
    transfer.wait_load()
    assert sync.log == [("side waits", -1), ("record", read),
                        *[("record", m) for m in layer_markers],
                        ("current waits", 2), ("current waits", 0), ("host waits", read),
                        ("host waits", 2)]


def test_a_layerwise_load_marks_each_layer_after_its_own_dmas() -> None:
    """Layer-wise, each layer's 2-D DMAs (one per run, ``count`` rows) come right before its
    marker, so layer 0 is ready after its own bytes; the reads are marked after the last."""
    kv = kv_views("LBHNC")
    fmt = fmt_of(kv)
    sync = RecordingSync()
    transfer = DeviceTransfer(arena_for(fmt, seed=1), fmt, kv, layerwise="always", sync=sync)
    transfer.start_load(plan(fmt))
    dmas = [("2-D DMA", r.count) for r in plan(fmt)]
    assert sync.log == [("side waits", -1),
                        *dmas, ("record", 0), *dmas, ("record", 1),
                        *dmas, ("record", 3), ("record", 2)]


def test_auto_goes_run_by_run_on_cpu_and_where_dmas_would_be_too_many() -> None:
    """``auto`` is layer-wise only with a pinned arena, 2-D DMA and few enough of them."""
    kv = kv_views("LBHNC")
    fmt = fmt_of(kv)
    sync = RecordingSync()
    transfer = DeviceTransfer(arena_for(fmt, seed=1), fmt, kv, sync=sync)
    transfer.start_load(plan(fmt))
    assert ("2-D DMA", 3) not in sync.log  # CPU: not pinned
    transfer.pinned = True  # as on a GPU host
    transfer.start_load(plan(fmt))
    assert sync.log.count(("2-D DMA", 3)) == LAYERS
    sync.log.clear()
    many = [Run(i, i, i * fmt.slot_bytes, 1) for i in range(SLOTS)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_copy, "MAX_ROW_COPIES", SLOTS * LAYERS - 1)
        transfer.start_load(many)
    assert not any(entry[0] == "2-D DMA" for entry in sync.log)
    transfer.pinned = False


def test_save_waits_per_layer_and_lets_the_current_stream_wait_for_the_gathers() -> None:
    """Each save_layer orders its gather after the current stream; finish_save marks the
    gathers, makes the current stream wait on them (vLLM may reuse the blocks), then marks the
    D2H copies, which only the ticket waits for."""
    kv = kv_views("BHLNC")
    fmt = fmt_of(kv)
    sync = RecordingSync()
    transfer = DeviceTransfer(arena_for(fmt), fmt, kv, sync=sync)
    transfer.open_save(plan(fmt))
    for layer in (1, 0, 2):
        transfer.save_layer(layer)
    ticket = transfer.finish_save()
    assert ticket is not None
    transfer.wait_save(ticket)
    landed, gathered = 4, 5  # markers 0-3: layers and reads
    assert sync.log == [("side waits", -1)] * 3 + [
        ("record", gathered), ("current waits", gathered), ("record", landed),
        ("host waits", landed)]


def test_a_save_missing_a_layer_leaves_the_arena_untouched() -> None:
    """finish_save without every layer returns None and writes nothing to the arena."""
    kv = kv_views("LBHNC", seed=8)
    fmt = fmt_of(kv)
    arena = arena_for(fmt)
    transfer = DeviceTransfer(arena, fmt, kv)
    transfer.open_save(plan(fmt))
    transfer.save_layer(0)
    transfer.save_layer(2)
    assert transfer.finish_save() is None
    assert not arena.any()
    assert transfer.finish_save() is None  # no save open: nothing to finish


def test_misuse_is_an_assertion_naming_it() -> None:
    """Waiting before any load, saving without open_save, a layer twice, two open saves, a
    load during a save and a layer out of range are bugs with a message."""
    kv = kv_views("LBNHC")
    fmt = fmt_of(kv)
    transfer = DeviceTransfer(arena_for(fmt), fmt, kv)
    with pytest.raises(AssertionError, match="wait_layer before any start_load"):
        transfer.wait_layer(0)
    with pytest.raises(AssertionError, match="wait_load before any start_load"):
        transfer.wait_load()
    with pytest.raises(AssertionError, match="save_layer without open_save"):
        transfer.save_layer(0)
    transfer.open_save(plan(fmt))
    transfer.save_layer(1)
    with pytest.raises(AssertionError, match="saved twice"):
        transfer.save_layer(1)
    with pytest.raises(AssertionError, match="open_save twice"):
        transfer.open_save(plan(fmt))
    with pytest.raises(AssertionError, match="start_load while a save is open"):
        transfer.start_load(plan(fmt))
    with pytest.raises(AssertionError, match="not one of the 3"):
        transfer.save_layer(3)
    transfer.finish_save()
    transfer.start_load([])  # an empty load still marks every layer
    transfer.wait_layer(2)
    with pytest.raises(AssertionError, match="not one of the 3"):
        transfer.wait_layer(-1)
    transfer.close()


def test_without_cuda_nothing_is_registered() -> None:
    """register_host_memory is False without CUDA; a CPU transfer is never pinned."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    kv = kv_views("LBHNC")
    fmt = fmt_of(kv)
    arena = arena_for(fmt)
    assert register_host_memory(arena) is False
    assert DeviceTransfer(arena, fmt, kv).pinned is False


class FakeCudart:
    """torch's cudart bindings as far as registration goes, answering ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[tuple[Any, ...]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any:
        self.calls.append(("register", ptr, size, flags))
        return SimpleNamespace(value=self.code)

    def cudaHostUnregister(self, ptr: int) -> Any:
        self.calls.append(("unregister", ptr))
        return SimpleNamespace(value=self.code)


@pytest.mark.parametrize("code, pinned", [(0, True), (712, False)])
def test_registration_goes_through_torch_cudart(monkeypatch: pytest.MonkeyPatch, code: int,
                                                pinned: bool) -> None:
    """With CUDA, the whole tensor is registered portable through torch's cudart; an error
    code is False (logged), not an exception; unregister passes the same pointer."""
    cudart = FakeCudart(code)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_copy, "_torch_cudart", lambda: cudart)
    arena = torch.zeros(4096, dtype=torch.uint8)
    assert register_host_memory(arena) is pinned
    unregister_host_memory(arena)
    assert cudart.calls == [("register", arena.data_ptr(), 4096, 1),
                            ("unregister", arena.data_ptr())]


def test_registration_without_cudart_or_cupy_is_false(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torch cudart and no CuPy: False, and nothing raises."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_copy, "_torch_cudart", lambda: None)
    monkeypatch.setattr(cuda_copy, "_cupy_call", lambda name, *args: None)
    assert register_host_memory(torch.zeros(8, dtype=torch.uint8)) is False


# -- GPU ---------------------------------------------------------------------------------------

@pytest.fixture
def shm_arena() -> Iterator[torch.Tensor]:
    """A real arena file's tensor (what the engine maps), ``SLOTS`` slots of this format."""
    directory = tempfile.mkdtemp(prefix="tierd-cc")
    size = SLOTS * fmt_of(kv_views("LBHNC")).slot_bytes
    arena = OwnedArena.create("arena", size, directory=directory, prefault=False)
    yield arena.as_tensor()
    arena.close()
    arena.unlink()
    os.rmdir(directory)


@pytest.mark.gpu
@pytest.mark.parametrize("layerwise", ["auto", "never"])
@pytest.mark.parametrize("order", ORDERS)
def test_cuda_round_trip_matches_the_cpu_path(order: str, layerwise: Layerwise,
                                              shm_arena: torch.Tensor) -> None:
    """On CUDA tensors, a save writes the bytes the CPU path writes, and a load of them (2-D
    DMA per layer, or run by run) restores the blocks bit-exact, for every layout, through a
    registered arena."""
    kv = kv_views(order, "cuda", seed=10)
    fmt = fmt_of(kv)
    assert register_host_memory(shm_arena)
    transfer = DeviceTransfer(shm_arena, fmt, kv, pinned=True,
                              max_staging_bytes=4 * fmt.slot_bytes)
    save_all(transfer, plan(fmt)[:2])  # 4 blocks: fits the bound
    ref = arena_for(fmt)
    cpu_kv = [t.cpu() for t in kv]
    for layer in range(LAYERS):
        save_layer(ref, fmt, layer, cpu_kv[layer], plan(fmt)[:2])
    assert torch.equal(shm_arena, ref)
    shm_arena.copy_(arena_for(fmt, seed=11))
    dst = kv_views(order, "cuda", seed=12)
    loader = DeviceTransfer(shm_arena, fmt, dst, pinned=True, layerwise=layerwise,
                            max_staging_bytes=3 * fmt.slot_bytes)
    loader.start_load(plan(fmt))  # 7 blocks in pieces
    for layer in range(LAYERS):
        loader.wait_layer(layer)
    loader.wait_load()
    expect = kv_views(order, seed=12)
    load_blocks(shm_arena, fmt, expect, plan(fmt))
    torch.cuda.synchronize()
    everything = list(range(BLOCKS))
    assert torch.equal(blocks_of(dst, everything), blocks_of(expect, everything))
    loader.close()
    transfer.close()
    unregister_host_memory(shm_arena)


@pytest.mark.gpu
def test_cuda_arena_is_registered(shm_arena: torch.Tensor) -> None:
    """With a GPU, the arena mapping registers as pinned memory, and unregisters."""
    assert register_host_memory(shm_arena) is True
    unregister_host_memory(shm_arena)

@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("order", ORDERS)
def test_store_writes_every_layer_as_the_per_layer_copy(order: str, native: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of 3, 1, 2 and 1 blocks land in their slots exactly as one copy per layer puts
    them; the slots between stay untouched."""
    if native and not verified_copy.available():
        pytest.skip("the native helper is not built here (make native)")
    native_calls: list[bool] = []
    real = verified_copy.store_rows

    def store_rows(*args: object, **kwargs: object) -> bool:
        native_calls.append(native)
        return real(*args, **kwargs) if native else False  # type: ignore[arg-type]
    monkeypatch.setattr(verified_copy, "store_rows", store_rows)
    kv = kv_views(order)
    fmt = SlotFormat(tuple(f"layer{i}" for i in range(len(kv))), tuple(kv[0].shape[1:]))
    block_runs = runs(BLOCK_IDS, [s * fmt.slot_bytes for s in SLOT_IDS], fmt.slot_bytes)
    expected = torch.full((10 * fmt.slot_bytes,), 7, dtype=torch.uint8)
    for layer, kv_bytes in enumerate(kv):
        save_layer(expected, fmt, layer, kv_bytes, block_runs)
    arena = torch.full_like(expected, 7)
    views = LayerViews(fmt, kv)
    assert views.rows is not None, "vLLM's layers are views of one buffer"
    views.store(arena, block_runs)
    assert native_calls == [native], "one native call, or the per-layer copy after it declined"
    assert torch.equal(arena, expected)
    assert (arena.view(10, -1)[5] == 7).all(), "slot 5 is no target"
