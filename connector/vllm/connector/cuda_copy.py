"""Moving blocks between tierd's host arena and vLLM's KV tensors on the device.

The byte order is ``kv_tensors``' canonical slot order (``slot[layer][head][token][c]``), so a
block saved here loads bit-exact through ``kv_tensors.load_blocks`` and vice versa. What differs
from ``kv_tensors`` is how the bytes move, on a side stream and without stalling the engine:

* The arena mapping is ``cudaHostRegister``-ed once per attach (``register_host_memory``), so a
  run of consecutive slots is ONE host<->device DMA (``non_blocking`` from/to pinned memory),
  between the arena and a contiguous device *staging* buffer. torch would stage a host tensor
  that is not contiguous through pageable memory, so torch copies here are of whole runs
  (staging laid out like the slots, ``[blocks, L, H, N, C bytes]``).
* A load is *layer-wise* where it can be (``Layerwise``): a slot is layer-major, so one layer of
  a run is ``count`` rows of ``layer_bytes`` at a pitch of ``slot_bytes``: one
  ``cudaMemcpy2DAsync`` (ctypes, the CUDA runtime already mapped here) into staging laid out
  ``[L, blocks, H, N, C]``, then that layer's scatter. Layer 0 is then ready after 1/L of the
  bytes, and the forward pass runs while later layers travel. It costs L DMAs per run, so it is
  used for loads of at most ``MAX_ROW_COPIES`` of them (few, long runs); scattered blocks go run
  by run, and every layer is ready only after the last run.
* Reordering into vLLM's layout happens in device memory, at HBM speed: per layer, one
  ``index_copy_`` (load) or ``index_select`` (save) over all the blocks of the transfer, whatever
  the number of runs and whatever vLLM's ``KVCacheLayout``.
* A load records one event per layer after that layer's scatter; ``wait_layer`` makes the
  *current* stream (the forward pass) wait on it, never the host. A save gathers each layer as
  vLLM hands it over (after the current stream's writes of it) and, once every layer is in
  staging, issues the runs' D2H copies and hands back a ``SaveTicket``: the step goes on while
  the bytes travel; a Commit waits on its ticket.

Ordering: everything runs on one side stream, in issue order, so staging is reused only after
the copies that read it; staging is allocated on the side stream, so the caching allocator never
hands it to another stream early. Before touching vLLM's blocks the side stream waits for the
current stream's work issued so far; after a save's gathers the current stream waits for them
(so vLLM may reuse the blocks from the next step on, without a host stall).

On CPU tensors the same class runs with a ``HostSync`` (every copy is done when it returns;
events are no-ops): the seam is ``StreamSync``, picked from the KV tensors' device.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from .kv_tensors import Run, SlotFormat

_log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 512 << 20
"""Bound of the device staging buffer (device memory outside vLLM's KV budget, allocated as
needed): a bigger load goes through it in pieces; a bigger save keeps only its leading blocks
(``open_save``)."""

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses

MAX_ROW_COPIES = 1024
"""Most 2-D DMAs (layers x runs) a layer-wise load may take (each costs a few microseconds to
issue; beyond this, run-by-run copies finish sooner)."""

Layerwise = Literal["auto", "always", "never"]
"""How loads go: ``auto`` layer-wise where ``StreamSync.strided_dma`` holds, the arena is
pinned and the load needs at most ``MAX_ROW_COPIES`` 2-D DMAs; ``always``/``never`` (tests)."""


# -- pinning the arena -----------------------------------------------------------------------

def register_host_memory(tensor: torch.Tensor) -> bool:
    """``cudaHostRegister`` all of ``tensor``'s bytes (the arena, once per attach), through
    torch's cudart or else CuPy, so DMA to and from it is pinned. False, logged, where there is
    no CUDA or registration fails (copies then go through pageable memory, synchronously).
    Blocks while the driver pins the pages (longer the bigger the arena: do it at attach, not on
    the first copy). Pinned until ``unregister_host_memory``, which must come after the last
    copy through it and before the mapping goes away."""
    if not torch.cuda.is_available():
        _log.info("tierd: no CUDA here; the arena is not registered as pinned memory")
        return False
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    cudart = _torch_cudart()
    code = (_code(cudart.cudaHostRegister(ptr, size, _PORTABLE)) if cudart is not None
            else _cupy_call("hostRegister", ptr, size, _PORTABLE))
    if code != 0:
        _clear_last_error()
        _log.warning("tierd: cudaHostRegister of the %d MiB arena failed (%s); copies to the GPU "
                     "stay pageable and synchronous", size >> 20,
                     "no cudart or CuPy" if code is None else f"error {code}")
        return False
    return True


def unregister_host_memory(tensor: torch.Tensor) -> None:
    """Undo ``register_host_memory`` (no copy may still be using the range). Logs a failure."""
    cudart = _torch_cudart()
    ptr = tensor.data_ptr()
    code = (_code(cudart.cudaHostUnregister(ptr)) if cudart is not None
            else _cupy_call("hostUnregister", ptr))
    if code != 0:
        _clear_last_error()
        _log.warning("tierd: cudaHostUnregister of the arena failed (error %s)", code)


def _torch_cudart() -> Any:
    """torch's CUDA runtime bindings, or None (a build without them)."""
    try:
        return getattr(torch.cuda, "cudart")()
    except (AssertionError, AttributeError, RuntimeError):
        return None


def _code(result: Any) -> int:
    """A ``cudaError`` from torch's bindings (an enum in torch 2.x, an int in some) as int."""
    return int(getattr(result, "value", result))


def _cupy_call(name: str, *args: int) -> int | None:
    """``cupy.cuda.runtime.<name>(*args)``: 0, the CUDA error, or None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        getattr(cupy.cuda.runtime, name)(*args)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return int(exc.status)
    return 0


def _runtimes() -> list[ctypes.CDLL]:
    """The CUDA runtime libraries mapped into this process (torch's, CuPy's), by path: the
    same instances, with the same state, as their users'."""
    with open("/proc/self/maps") as maps:
        fields = [line.split() for line in maps]
    paths = sorted({f[5] for f in fields if len(f) == 6 and "libcudart.so" in f[5]})
    return [ctypes.CDLL(path) for path in paths]


def _clear_last_error() -> None:
    """``cudaGetLastError`` in each CUDA runtime mapped here: a failed call leaves its error
    pending, and torch would report it as the next kernel launch's own."""
    for runtime in _runtimes():
        runtime.cudaGetLastError()


def _memcpy_2d() -> Any:
    """``cudaMemcpy2DAsync`` of the first CUDA runtime mapped here, typed; None if none is
    (torch linked statically): loads then go run by run."""
    for runtime in _runtimes():
        fn = runtime.cudaMemcpy2DAsync
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        fn.restype = ctypes.c_int
        return fn
    return None


# -- the seam: CUDA streams and events, or nothing on CPU ------------------------------------

class Marker(Protocol):
    """A point in the side stream's work (an event)."""

    def record(self) -> None:
        """Mark everything issued on the side stream so far."""

    def block_current(self) -> None:
        """Make the current stream wait for the marked work (the host does not wait)."""

    def query(self) -> bool:
        """True once the marked work has finished (or nothing was ever marked)."""

    def synchronize(self) -> None:
        """Block the host until the marked work has finished."""


class StreamSync(Protocol):
    """Where the side stream's work runs and how it is ordered."""

    def side(self) -> contextlib.AbstractContextManager[Any]:
        """Context in which copies and allocations go to the side stream."""

    def after_current(self) -> None:
        """Make the side stream wait for the current stream's work issued so far."""

    def marker(self) -> Marker:
        """A new, unrecorded marker."""

    def synchronize(self) -> None:
        """Block the host until all side-stream work has finished."""

    @property
    def strided_dma(self) -> bool:
        """Whether ``copy_rows`` between host and device is one DMA (else loads go by run)."""

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the side stream, for 2-D uint8 tensors whose rows are
        contiguous (any row pitch), one on the host and one on the device."""


class HostSync:
    """CPU tensors: every copy has finished when it returns, so there is nothing to order;
    it is its own (always finished) marker."""

    def side(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_current(self) -> None:
        pass

    def marker(self) -> Marker:
        return self

    def record(self) -> None:
        pass

    def block_current(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    @property
    def strided_dma(self) -> bool:
        return False

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


class _CudaMarker:
    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._event: Any = getattr(torch.cuda, "Event")()  # untyped in torch's stubs

    def record(self) -> None:
        self._event.record(self._stream)

    def block_current(self) -> None:
        torch.cuda.current_stream(self._stream.device).wait_event(self._event)

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()


class CudaSync:
    """One side ``torch.cuda.Stream`` on ``device``; markers are ``torch.cuda.Event``s."""

    def __init__(self, device: torch.device) -> None:
        self._stream: Any = getattr(torch.cuda, "Stream")(device)  # untyped in torch's stubs
        self._memcpy_2d = _memcpy_2d()

    def side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream)

    def after_current(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))

    def marker(self) -> Marker:
        return _CudaMarker(self._stream)

    def synchronize(self) -> None:
        self._stream.synchronize()

    @property
    def strided_dma(self) -> bool:
        return self._memcpy_2d is not None

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert dst.shape == src.shape and dst.stride(1) == src.stride(1) == 1, (
            "copy_rows takes 2-D byte tensors of equal shape with contiguous rows")
        height, width = src.shape
        code = self._memcpy_2d(dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0),
                               width, height, _MEMCPY_DEFAULT, self._stream.cuda_stream)
        assert code == 0, f"cudaMemcpy2DAsync failed with CUDA error {code}"


# -- transfers -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SaveTicket:
    """One step's save, issued: its bytes are in the arena slots once ``landed`` has finished
    (``DeviceTransfer.save_done`` / ``wait_save``); until then the slots must not be read."""

    blocks: int
    landed: Marker


@dataclass(slots=True)
class _OpenSave:
    block_runs: list[Run]
    ids: torch.Tensor                   # vLLM block ids, staging order, on the device
    blocks: int
    layers: set[int] = field(default_factory=set)


class DeviceTransfer:
    """Copies between one arena mapping and one worker's KV tensors (``byte_view``s, any
    ``KVCacheLayout``), on CUDA or CPU alike. Holds the mapping (``arena``) while it lives, so
    no queued copy outlives its memory. ``pinned``: the caller registered the arena
    (``register_host_memory``) and unregisters it only after ``close``. One thread only (the
    model runner's).

    Per step: ``start_load`` (before the forward pass) then ``wait_layer`` per layer; then
    ``open_save`` / ``save_layer`` per layer / ``finish_save``."""

    def __init__(self, arena: torch.Tensor, fmt: SlotFormat, kv_bytes: Sequence[torch.Tensor],
                 *, pinned: bool = False, max_staging_bytes: int = DEFAULT_STAGING_BYTES,
                 layerwise: Layerwise = "auto", sync: StreamSync | None = None) -> None:
        """``ValueError`` naming the fix for tensors that do not match ``fmt`` or a staging
        bound below one slot. ``sync`` replaces the stream seam (tests)."""
        self.device = kv_bytes[0].device
        if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.device.type != "cpu":
            raise ValueError("the arena must be the 1-D uint8 host tensor of ShmArena.as_tensor()")
        if len(kv_bytes) != len(fmt.layer_names) or any(
                t.dtype != torch.uint8 or tuple(t.shape[1:]) != fmt.block_shape
                or t.device != self.device for t in kv_bytes):
            raise ValueError(f"pass one kv_tensors.byte_view per layer of {fmt}, all on one "
                             "device")
        if max_staging_bytes < fmt.slot_bytes:
            raise ValueError(f"max_staging_bytes {max_staging_bytes} is below one slot "
                             f"({fmt.slot_bytes} bytes): raise it")
        self.arena, self._fmt, self._kv = arena, fmt, list(kv_bytes)  # the mapping held
        self.format = fmt
        self.max_staging_bytes = max_staging_bytes
        self._layerwise = layerwise
        cuda = self.device.type == "cuda"
        self._sync: StreamSync = sync or (CudaSync(self.device) if cuda else HostSync())
        self.pinned = pinned
        with self._sync.side():
            self._staging = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._layer_done = [self._sync.marker() for _ in kv_bytes]
        self._read = self._sync.marker()    # the load's last H2D: its arena slots were read
        self._loaded = False                # a load was started: the markers above are valid
        self._save: _OpenSave | None = None

    @property
    def staging_bytes(self) -> int:
        """Current size of the staging buffer (grows on demand to ``max_staging_bytes``)."""
        return self._staging.numel()

    # -- loads -------------------------------------------------------------------------------

    def start_load(self, block_runs: Sequence[Run]) -> None:
        """Queue the copy of each run's slots into its vLLM blocks of every layer and return
        (layer-wise or run by run: see the module doc). The runs' arena slots must stay valid
        (leased) until ``wait_reads``; the blocks hold the bytes for work on the current stream
        after ``wait_layer`` (for the host: after ``wait_load``)."""
        assert self._save is None, ("start_load while a save is open: loads come before the "
                                    "forward pass (start_load_kv), saves during it")
        slot_bytes, layers = self._fmt.slot_bytes, len(self._kv)
        pieces = _split(block_runs, self.max_staging_bytes // slot_bytes, slot_bytes)
        by_layer = self._layerwise == "always" or (
            self._layerwise == "auto" and self.pinned and self._sync.strided_dma
            and sum(len(p) for p in pieces) * layers <= MAX_ROW_COPIES)
        self._sync.after_current()  # pending writes to the destination blocks come first
        with self._sync.side():
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                if by_layer:
                    self._load_by_layer(piece, last)
                else:
                    self._load_by_run(piece, last)
            if not pieces:
                for marker in (self._read, *self._layer_done):
                    marker.record()
        self._loaded = True

    def _load_by_run(self, piece: Sequence[Run], last: bool) -> None:
        """One DMA per run into ``[blocks, L, ...]`` staging, then each layer's scatter."""
        slots = self._stage(piece).view(-1, len(self._kv), *self._fmt.block_shape)
        for run, at, src in zip(piece, _starts(piece), self._host_slots(piece)):
            slots[at:at + run.count].copy_(src, non_blocking=True)
        if last:
            self._read.record()
        ids = self._ids(piece)
        for layer, kv in enumerate(self._kv):
            kv.index_copy_(0, ids, slots[:, layer])
            if last:
                self._layer_done[layer].record()

    def _load_by_layer(self, piece: Sequence[Run], last: bool) -> None:
        """Per layer: one 2-D DMA per run into ``[L, blocks, ...]`` staging, the scatter."""
        fmt, layers = self._fmt, len(self._kv)
        staged = self._stage(piece)
        rows = staged.view(layers, -1, fmt.layer_bytes)
        slots = staged.view(layers, -1, *fmt.block_shape)
        host = [src.view(run.count, fmt.slot_bytes)
                for run, src in zip(piece, self._host_slots(piece))]
        ids = self._ids(piece)
        for layer, kv in enumerate(self._kv):
            lo, hi = layer * fmt.layer_bytes, (layer + 1) * fmt.layer_bytes
            for run, at, src in zip(piece, _starts(piece), host):
                self._sync.copy_rows(rows[layer, at:at + run.count], src[:, lo:hi])
            if last and layer == layers - 1:
                self._read.record()
            kv.index_copy_(0, ids, slots[layer])
            if last:
                self._layer_done[layer].record()

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer ``layer`` of the last load is in place.
        Does not block the host."""
        assert self._loaded, "wait_layer before any start_load: there is no load to wait for"
        assert 0 <= layer < len(self._kv), f"layer {layer} is not one of the {len(self._kv)}"
        self._layer_done[layer].block_current()

    def wait_reads(self) -> None:
        """Block until the last load has read its arena slots (its leases may then go)."""
        assert self._loaded, "wait_reads before any start_load"
        self._read.synchronize()

    def wait_load(self) -> None:
        """Block until the last load is in vLLM's blocks, every layer."""
        assert self._loaded, "wait_load before any start_load"
        self._layer_done[-1].synchronize()  # the last layer's scatter is the last work queued

    # -- saves -------------------------------------------------------------------------------

    def open_save(self, block_runs: Sequence[Run]) -> int:
        """Start this step's save of ``block_runs`` (the runs' vLLM blocks into their slots);
        returns how many leading blocks (in run order) it carries: all, unless they exceed
        ``max_staging_bytes``: the rest are not written (a future miss)."""
        assert self._save is None, "open_save twice: finish_save the step's save first"
        slot_bytes = self._fmt.slot_bytes
        kept = _split(block_runs, self.max_staging_bytes // slot_bytes, slot_bytes)[:1]
        piece = kept[0] if kept else []
        with self._sync.side():
            self._stage(piece)
            self._save = _OpenSave(piece, self._ids(piece), sum(r.count for r in piece))
        return self._save.blocks

    def save_layer(self, layer: int) -> None:
        """Queue the gather of layer ``layer`` of the open save's blocks into staging, after
        the current stream's work so far (the forward pass's writes of it). Returns at once."""
        save = self._save
        assert save is not None, "save_layer without open_save"
        assert 0 <= layer < len(self._kv), f"layer {layer} is not one of the {len(self._kv)}"
        assert layer not in save.layers, f"layer {layer} saved twice in one step"
        save.layers.add(layer)
        if not save.blocks:
            return
        self._sync.after_current()
        with self._sync.side():
            slots = self._staging[:save.blocks * self._fmt.slot_bytes].view(
                save.blocks, len(self._kv), *self._fmt.block_shape)
            slots[:, layer].copy_(self._kv[layer].index_select(0, save.ids))

    def finish_save(self) -> SaveTicket | None:
        """Close the step's save. With every layer gathered: queue one D2H copy per run into
        the arena and return its ticket (the current stream waits for the gathers, so vLLM may
        reuse the blocks); else None and the arena is untouched."""
        save, self._save = self._save, None
        if save is None or len(save.layers) < len(self._kv):
            if save is not None and save.layers:
                self._gathered().block_current()
            return None
        landed = self._sync.marker()
        if save.blocks:
            self._gathered().block_current()
            with self._sync.side():
                slots = self._staging[:save.blocks * self._fmt.slot_bytes].view(
                    save.blocks, len(self._kv), *self._fmt.block_shape)
                piece = save.block_runs
                for run, at, dst in zip(piece, _starts(piece), self._host_slots(piece)):
                    dst.copy_(slots[at:at + run.count], non_blocking=True)
                landed.record()
        return SaveTicket(save.blocks, landed)

    def drop_save(self) -> None:
        """Drop the open save without touching the arena (its slots may be freed at once); the
        current stream waits for the gathers already queued, as ``finish_save`` makes it."""
        save, self._save = self._save, None
        if save is not None and save.layers:
            self._gathered().block_current()

    def save_done(self, ticket: SaveTicket) -> bool:
        """True once the ticket's bytes are in the arena (does not block)."""
        return ticket.landed.query()

    def wait_save(self, ticket: SaveTicket) -> None:
        """Block until the ticket's bytes are in the arena (safe from any thread)."""
        ticket.landed.synchronize()

    def close(self) -> None:
        """Block until every queued copy has finished (the arena may then be unregistered and
        unmapped); a save still open is dropped (the arena is untouched)."""
        self._save = None
        self._sync.synchronize()

    # -- helpers -----------------------------------------------------------------------------

    def _gathered(self) -> Marker:
        with self._sync.side():
            marker = self._sync.marker()
            marker.record()
        return marker

    def _stage(self, piece: Sequence[Run]) -> torch.Tensor:
        """The first ``blocks of piece x slot_bytes`` bytes of staging, grown (on the side
        stream, the caller's context) if short."""
        need = sum(run.count for run in piece) * self._fmt.slot_bytes
        assert need <= self.max_staging_bytes, "pieces are split to fit the staging bound"
        if self._staging.numel() < need:
            size = min(self.max_staging_bytes, max(need, 2 * self._staging.numel()))
            self._staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._staging[:need]

    def _host_slots(self, piece: Sequence[Run]) -> list[torch.Tensor]:
        """Each run's slots in the arena, ``[count, L, H, N, C]`` (contiguous views)."""
        fmt = self._fmt
        return [self.arena[r.offset:r.offset + r.count * fmt.slot_bytes].view(
            r.count, len(fmt.layer_names), *fmt.block_shape) for r in piece]

    def _ids(self, piece: Sequence[Run]) -> torch.Tensor:
        """The piece's vLLM block ids in staging order, on the device (queued, not blocking)."""
        ids = [run.block_id + k for run in piece for k in range(run.count)]
        pin = self.device.type == "cuda"
        return torch.tensor(ids, dtype=torch.int64, pin_memory=pin).to(self.device,
                                                                          non_blocking=True)


def _split(block_runs: Sequence[Run], cap: int, slot_bytes: int) -> list[list[Run]]:
    """``block_runs`` in order, in pieces of at most ``cap`` blocks (a run may be cut in
    parts, each a ``Run`` of its own)."""
    pieces: list[list[Run]] = []
    piece: list[Run] = []
    room = cap
    for run in block_runs:
        done = 0
        while done < run.count:
            if room == 0:
                pieces.append(piece)
                piece, room = [], cap
            take = min(room, run.count - done)
            piece.append(Run(run.first + done, run.block_id + done,
                             run.offset + done * slot_bytes, take))
            done, room = done + take, room - take
    if piece:
        pieces.append(piece)
    return pieces


def _starts(piece: Sequence[Run]) -> list[int]:
    """Each run's first block in staging (runs back to back, in order)."""
    out, at = [], 0
    for run in piece:
        out.append(at)
        at += run.count
    return out
