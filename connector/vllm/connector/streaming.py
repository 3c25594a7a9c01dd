"""Streamed loads: a hit with blocks on the daemon's SSD, copied as the daemon reads it.

The scheduler half answers such a hit with vLLM's asynchronous load (``load_async``): vLLM
allocates the request's blocks, parks it (``WAITING_FOR_REMOTE_KVS``) and goes on scheduling
other requests. Here, at ``start_load_kv``, the worker sends one Acquire per chunk of the hit
(``CHUNK_BYTES``, about 32 MiB), all at once, so the daemon reads every chunk's SSD blocks into
DRAM in parallel (its I/O threads) and answers each Acquire as soon as its chunk is staged. One
runner thread (``core.runner.Runner``) takes the chunks in order: it waits for a chunk's
Acquire, checks and copies its slots into vLLM's blocks (``core.load``: through the worker's
``LayerViews`` sink, one pass with ``verified_copy``), releases its lease, and goes on, so the
engine's copy of a chunk overlaps the disk reads of the chunks
after it; the load ends a copy of one chunk after the last read.

A load ends at the first block that did not arrive or did not verify: the rest of its chunks are
released uncopied. ``take_finished`` (from vLLM's ``get_finished``, on the engine thread) hands
over the loads that ended, with how many leading blocks are in place; the worker reports the
request as finished receiving and the blocks after those as load errors in the same step, as
vLLM requires, so vLLM recomputes from there. A load of a request vLLM aborted (``cancel``) stops
copying and is handed over too (vLLM frees the blocks only then). Each chunk's lease is checked
after its copy (``core.load``'s one rule): one that ran out fails the load from that chunk on.

Thread use: ``start``, ``cancel`` and ``take_finished`` on the engine thread; the copies, the
waits and the Releases on the stream thread, over the client, arena tensor and slots captured at
``start`` (each holds its own channel or mapping, so a link that re-registers meanwhile does not
pull them away; a daemon that went away fails the load instead).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from tierd.connector.core.arena_slots import ArenaSlots
from tierd.connector.core.errors import describe
from tierd.connector.core.lease import Lease, PendingLease, acquire_async, releaser
from tierd.connector.core.link import DaemonLink
from tierd.connector.core.load import Sink, finish_load, start_load
from tierd.connector.core.runner import Runner
from tierd.types import BlockHash
from tierd.wire.client import TierdClient

from .metadata import LoadSpec

_log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20
"""Bytes per Acquire of a streamed load: small enough that the copy of the last chunk (the part
that cannot overlap a read) is short, large enough that the round trips stay few."""


@dataclass(slots=True)
class _Chunk:
    first: int                        # index of the chunk's first block in the load
    count: int
    lease: PendingLease


@dataclass(slots=True)
class StreamState:
    """A worker's streamed loads (host KV): ``streams`` built at the first one, ``sink`` the
    one-core copy they use, ``ended_now`` loads that ended at their start (handed over at the
    next ``ended``). Engine thread only."""

    sink: Sink
    streams: Streams | None = None
    ended_now: list[StreamedLoad] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        """No load was ever streamed and none ended at its start: ``ended`` has nothing."""
        return self.streams is None and not self.ended_now

    def start(self, spec: LoadSpec, link: DaemonLink, slot_bytes: int,
              clock: Callable[[], float], device: bool) -> None:
        """Begin a streamed load. With the daemon down it fails now, and with CUDA KV
        (``device``) too (the scheduler streams only to host KV; CUDA loads are staged
        instead); it is handed over at the next ``ended`` either way."""
        if device or not spec.block_ids or not link.connect():
            if device:
                _log.warning("tierd: a streamed load reached a CUDA worker; vLLM recomputes %s",
                             spec.req_id)
            self.ended_now.append(StreamedLoad(spec, ""))
            return
        if self.streams is None:
            self.streams = Streams(link.new_client(), self.sink, slot_bytes, clock)
        self.streams.start(spec, link.engine.engine_id, link.slots)

    def ended(self, finished: set[str]) -> list[StreamedLoad]:
        """Stop the loads of the requests vLLM ``finished`` (aborted); the loads that ended
        since the last call (each handed over once)."""
        ended, self.ended_now = self.ended_now, []
        if self.streams is not None:
            self.streams.cancel(finished)
            ended += self.streams.take_finished()
        return ended


@dataclass(slots=True)
class StreamedLoad:
    """One request's streamed load. ``placed``: leading blocks in vLLM's blocks and verified
    (final once the load is handed over); ``cancelled``: vLLM aborted the request."""

    spec: LoadSpec
    engine_id: str
    chunks: list[_Chunk] = field(default_factory=list)
    placed: int = 0
    cancelled: bool = False


class Streams:
    """The worker's streamed loads and the one thread that copies them (see the module doc)."""

    def __init__(self, client: TierdClient, sink: Sink, slot_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``client``: a channel of the streams' own (Acquires and Releases); ``sink``: where
        the chunks go (synchronous: the worker's ``LayerViews`` on one thread); ``slot_bytes``:
        the size of one block's slot."""
        self._client, self._sink, self._clock = client, sink, clock
        self._release = releaser(client, lambda exc: _log.debug(
            "tierd: release of a streamed chunk failed: %s", describe(exc)))
        self._chunk_blocks = max(1, CHUNK_BYTES // slot_bytes)
        self._runner = Runner(1, "tierd-stream", ("copy",))
        self._lock = threading.Lock()
        self._active: dict[str, StreamedLoad] = {}
        self._ended: list[StreamedLoad] = []

    def start(self, spec: LoadSpec, engine_id: str, slots: ArenaSlots) -> None:
        """Send the Acquires of ``spec``'s chunks now and queue its copies on the thread."""
        load = StreamedLoad(spec, engine_id)
        hashes = [BlockHash(h) for h in spec.block_hashes]
        for first in range(0, len(hashes), self._chunk_blocks):
            part = hashes[first:first + self._chunk_blocks]
            load.chunks.append(_Chunk(first, len(part), acquire_async(
                self._client, engine_id, part, clock=self._clock)))
        with self._lock:
            self._active[spec.req_id] = load
        self._runner.submit("copy", functools.partial(self._run, load, slots))

    def cancel(self, req_ids: Iterable[str]) -> None:
        """vLLM finished (aborted) these requests: their loads stop copying."""
        with self._lock:
            for req_id in req_ids:
                load = self._active.get(req_id)
                if load is not None:
                    load.cancelled = True

    def take_finished(self) -> list[StreamedLoad]:
        """The loads that ended since the last call (each handed over once)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    @property
    def busy(self) -> bool:
        """Some load has not ended yet."""
        with self._lock:
            return bool(self._active)

    def close(self) -> None:
        """Cancel every load, wait for the thread to release their leases, close the channel."""
        with self._lock:
            for load in self._active.values():
                load.cancelled = True
        self._runner.stop(None)
        self._client.close()

    def _run(self, load: StreamedLoad, slots: ArenaSlots) -> None:
        """Stream thread: the chunks in order (see the module doc). Never raises: whatever
        goes wrong ends the load where it stands (vLLM must hear of every load's end)."""
        ok = True
        try:
            for chunk in load.chunks:
                try:
                    lease = chunk.lease.wait()
                except grpc.RpcError as exc:
                    if ok and not load.cancelled:
                        _log.warning("tierd: streamed load of %s: Acquire failed (%s); vLLM "
                                     "recomputes from block %d", load.spec.req_id,
                                     exc.code().name, chunk.first)
                    ok = False
                    continue
                if not ok or load.cancelled:
                    self._release(lease, None)
                    ok = False
                    continue
                try:
                    good = self._copy_chunk(load, chunk, lease, slots)
                except Exception:  # a bug: the rest of the load is a miss, its leases released
                    _log.exception("tierd: streamed load of %s failed; vLLM recomputes from "
                                   "block %d", load.spec.req_id, chunk.first)
                    self._release(lease, None)
                    good = 0
                load.placed += good
                ok = good == chunk.count
        finally:
            with self._lock:
                if self._active.get(load.spec.req_id) is load:
                    del self._active[load.spec.req_id]
                self._ended.append(load)

    def _copy_chunk(self, load: StreamedLoad, chunk: _Chunk, lease: Lease,
                    slots: ArenaSlots) -> int:
        """Copy one acquired chunk (``core.load``); how many of its leading blocks are in place
        and valid."""
        block_ids = load.spec.block_ids[chunk.first:chunk.first + chunk.count]
        done = finish_load(start_load(lease, block_ids, slots, self._sink), self._sink,
                           self._release, self._clock)
        if done.lease_lost:
            _log.warning("tierd: lease on a chunk of %s expired before its copy finished; vLLM "
                         "recomputes from block %d", load.spec.req_id, chunk.first)
        elif done.corrupt:
            _log.warning("tierd: block %d of %s failed its checksum; vLLM recomputes from there",
                         chunk.first + done.verified, load.spec.req_id)
        return done.placed
