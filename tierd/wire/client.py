"""Clients of the node daemon: ``TierdClient`` (blocking) and ``AsyncTierdClient`` (asyncio).

Each holds one gRPC channel and makes exactly one round trip per method call, whatever the
number of blocks. ``TierdClient`` on a Unix socket sends its calls over the daemon's lane
instead where it has one (``tierd.wire.lane``: the same calls without gRPC's per-call cost).
Inputs and outputs are plain Python values (``Layout``, ``BlockHash`` lists, the frozen results
of ``tierd.wire.convert``); no protobuf type reaches the caller.

Errors are ``grpc.RpcError`` (sync; ``call_error.CallError`` over the lane) /
``grpc.aio.AioRpcError`` (async) carrying the precise status code (``.code()``) and message
(``.details()``) the daemon chose: INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION,
RESOURCE_EXHAUSTED, UNAUTHENTICATED; UNAVAILABLE when no daemon listens.

The engine-side data path, for reference::

    client = TierdClient(socket_path="/run/user/1000/tierd.sock")
    engine = client.register_engine(layout, engine_name="llama-tp0")
    arena = ShmArena.attach(engine.arena_name, directory=engine.arena_directory)
    got = client.acquire(engine.engine_id, hashes)           # pins got.num_blocks blocks
    for slot, checksum in zip(got.slot_ids, got.checksums):  # copy out, then verify
        off = engine.geometry.offset(slot)
        ... arena.view(off, engine.geometry.slot_bytes) ...
    client.release(engine.engine_id, got.lease_id)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from tierd.paths import client_socket_path
from tierd.types import BlockHash, Tier
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire import convert
from tierd.wire.call_error import CallError, code_of
from tierd.wire.call_threads import CallThreads
from tierd.wire.lane import lane_path
from tierd.wire.lane_client import LaneClient, LaneGone, LaneRefused
from tierd.wire.layout import Layout
from tierd.wire.replies import AcquiredBlocks, DaemonStats, EngineHandle, Located, ReservedSlots
from tierd.wire.sent import FutureSent, LaneSent, Sent

if TYPE_CHECKING:
    from tierd.daemon.why import Variant, WhyAnswer

T = TypeVar("T")


__all__ = ["AcquiredBlocks", "AsyncTierdClient", "CommitRefused", "DaemonStats", "EngineHandle",
           "Located", "ReservedSlots", "TierdClient", "target_for"]

DEFAULT_TIMEOUT = 30.0
"""Seconds before a call fails with DEADLINE_EXCEEDED (an Acquire may read from SSD)."""

LANE_RETRY_SECONDS = 5.0
"""How long a client whose daemon had no lane calls over gRPC before it looks again."""

CALL_THREADS = 16
"""Calls one ``TierdClient`` has in flight at once without waiting (``*_async``); more queue."""

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20)]


def target_for(socket_path: str | None = None, address: str | None = None) -> str:
    """The gRPC target: ``address`` ("host:port") if given, else ``unix:`` + ``socket_path``
    (default: ``client_socket_path()``)."""
    if address:
        return address
    return f"unix:{socket_path or client_socket_path()}"


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class _Requests:
    """Request builders shared by both clients (one place that touches protobuf)."""

    @staticmethod
    def register(layout: Layout, engine_name: str) -> pb.RegisterEngineRequest:
        return pb.RegisterEngineRequest(layout=convert.layout_to_pb(layout),
                                        engine_name=engine_name)

    @staticmethod
    def chain(kind: Any, engine_id: str, hashes: Sequence[BlockHash]) -> Any:
        return kind(engine_id=engine_id, block_hashes=hashes)

    @staticmethod
    def probe(engine_id: str, hashes: Sequence[BlockHash], hold: bool) -> pb.ProbeRequest:
        return pb.ProbeRequest(engine_id=engine_id, block_hashes=hashes, hold=hold)

    @staticmethod
    def reserve(engine_id: str, hashes: Sequence[BlockHash],
                filtered_query_tokens: int) -> pb.ReserveRequest:
        return pb.ReserveRequest(engine_id=engine_id, block_hashes=hashes,
                                 filtered_query_tokens=filtered_query_tokens)

    @staticmethod
    def acquire(engine_id: str, hashes: Sequence[BlockHash], hold: bool) -> pb.AcquireRequest:
        return pb.AcquireRequest(engine_id=engine_id, block_hashes=hashes, hold=hold)

    @staticmethod
    def reserve_blank(engine_id: str, count: int) -> pb.ReserveRequest:
        return pb.ReserveRequest(engine_id=engine_id, blank_slots=count)

    @staticmethod
    def commit(engine_id: str, lease_id: str, written: Sequence[bool],
               names: Sequence[BlockHash]) -> pb.CommitRequest:
        return pb.CommitRequest(engine_id=engine_id, lease_id=lease_id, written=list(written),
                                block_hashes=names)

    @staticmethod
    def commit_many(engine_id: str,
                    commits: Sequence[tuple[str, Sequence[bool], Sequence[BlockHash]]]
                    ) -> pb.CommitManyRequest:
        return pb.CommitManyRequest(engine_id=engine_id, commits=[
            _Requests.commit("", lease_id, written, names) for lease_id, written, names in commits])

    @staticmethod
    def locate(engine_id: str | None, hashes: Sequence[BlockHash],
               layout: Layout | None) -> pb.LocateRequest:
        if (engine_id is None) == (layout is None):
            raise ValueError("locate needs exactly one of engine_id and layout")
        if layout is not None:
            return pb.LocateRequest(block_hashes=hashes, layout=convert.layout_to_pb(layout))
        return pb.LocateRequest(engine_id=engine_id, block_hashes=hashes)

    @staticmethod
    def release(engine_id: str, lease_id: str, corrupt_from: int | None,
                served: int | None = None) -> pb.ReleaseRequest:
        return pb.ReleaseRequest(engine_id=engine_id, lease_id=lease_id, corrupt_from=corrupt_from,
                                 served=served)

    @staticmethod
    def hot(engine_id: str, stored: Sequence[BlockHash], removed: Sequence[BlockHash],
            cleared: bool, speed: float = 0.0) -> pb.ReportHotBlocksRequest:
        return pb.ReportHotBlocksRequest(engine_id=engine_id, stored=stored, removed=removed,
                                         cleared=cleared, prefill_tokens_per_second=speed)


class ChannelClosed(grpc.RpcError):  # type: ignore[misc]  # grpc has no type stubs
    """A call on a client already closed (another thread dropped the session it belonged to):
    a ``grpc.RpcError`` like any other failed call (``core.errors`` classifies it "down"), not
    gRPC's ``ValueError``, so no caller needs a second ``except``."""

    @classmethod
    def of(cls, exc: ValueError, target: str) -> ChannelClosed:
        if "closed" not in str(exc).lower():
            raise exc
        return cls(f"the channel to {target} was closed")


class CommitRefused(CallError):
    """One Commit of a ``commit_many`` that the daemon refused, the others landing: ``code()``
    and ``details()`` are what that Commit made alone would have failed with."""


def _outcomes(reply: pb.CommitManyResponse) -> list[int | CommitRefused]:
    """Each Commit's blocks stored, or its ``CommitRefused``."""
    return [int(o.stored) if o.code == 0 else
            CommitRefused(code_of(o.code), o.message)
            for o in reply.outcomes]


class TierdClient:
    """Blocking client over one channel (and the daemon's lane). Thread-safe (gRPC channels and
    ``LaneClient`` are). Use as a context manager or call ``close``."""

    def __init__(self, *, socket_path: str | None = None, address: str | None = None,
                 token: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 lane: bool = True) -> None:
        """Connect lazily to ``address`` ("host:port", needs ``token``) or the Unix socket
        ``socket_path`` (default socket if neither is given). Nothing is sent until a call.
        On a Unix socket, calls go over the daemon's lane where it has one (``lane``: False
        keeps every call on gRPC); without one (none found, or none reachable any more) calls
        go over gRPC, and the lane is looked for again after ``LANE_RETRY_SECONDS``."""
        self.target = target_for(socket_path, address)
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.TierdStub(self._channel)  # type: ignore[no-untyped-call]
        self._md = _metadata(token)
        self._token = token
        self._timeout = timeout
        self._lock = threading.Lock()
        self._calls: CallThreads | None = None  # started with the first call sent without waiting
        self._closed = False
        self._lane_path = (lane_path(self.target.removeprefix("unix:"))
                           if lane and self.target.startswith("unix:") else None)
        self._lane: LaneClient | None = None
        self._lane_asked = -LANE_RETRY_SECONDS  # monotonic time of the last look for the lane

    @property
    def on_lane(self) -> bool:
        """Whether calls go over the daemon's lane now (``tierd.wire.lane``)."""
        return self._lane is not None

    def _call(self, method: str, request: Any) -> Any:
        reply = self._on_lane(lambda lane: lane.call(method, request))
        if reply is not None:
            return reply
        try:
            return getattr(self._stub, method)(request, metadata=self._md,
                                               timeout=self._timeout)
        except ValueError as exc:
            raise ChannelClosed.of(exc, self.target) from exc

    def _on_lane(self, use: Callable[[LaneClient], T]) -> T | None:
        """``use(lane)`` where the daemon has a lane that takes the call; None where the call
        is to go over gRPC: no lane, or one with its most connections open (``LaneRefused``),
        or none any more (``LaneGone``: looked for again later). ``ChannelClosed`` after
        ``close``."""
        if self._closed:
            raise ChannelClosed(f"the channel to {self.target} was closed")
        lane = self._lane if self._lane is not None else self._find_lane()
        if lane is None:
            return None
        try:
            return use(lane)
        except LaneRefused:
            return None
        except LaneGone:
            with self._lock:
                if self._lane is lane:
                    self._lane, self._lane_asked = None, time.monotonic()
            lane.close()
            return None

    def _find_lane(self) -> LaneClient | None:
        """The daemon's lane if it has one (looked for at most every ``LANE_RETRY_SECONDS``)."""
        if self._lane_path is None or time.monotonic() < self._lane_asked + LANE_RETRY_SECONDS:
            return None
        with self._lock:
            if self._lane is None and not self._closed and (
                    time.monotonic() >= self._lane_asked + LANE_RETRY_SECONDS):
                self._lane_asked = time.monotonic()
                self._lane = LaneClient.open(self._lane_path, self._token, self._timeout)
            return self._lane

    def register_engine(self, layout: Layout, engine_name: str = "") -> EngineHandle:
        """Register ``layout``; returns the engine id, arena and slot geometry to use."""
        return convert.engine_handle_from_pb(
            self._call("RegisterEngine", _Requests.register(layout, engine_name)))

    def unregister_engine(self, engine_id: str) -> None:
        """Forget the engine; its leases and reservations are released."""
        self._call("UnregisterEngine", pb.UnregisterEngineRequest(engine_id=engine_id))

    def lookup(self, engine_id: str, hashes: Sequence[BlockHash]) -> list[Tier]:
        """Tier of each block of the longest held prefix of ``hashes`` (len = hit blocks).
        Pins nothing."""
        reply = self._call("Lookup", _Requests.chain(pb.LookupRequest, engine_id, hashes))
        return convert.tiers_from_pb(reply.tiers)

    def acquire(self, engine_id: str, hashes: Sequence[BlockHash], *,
                hold: bool = False) -> AcquiredBlocks:
        """Pin the longest held prefix in DRAM (SSD hits staged first) until ``release`` or the
        lease deadline; returns slot ids and checksums to copy and verify. Counts no lookup.
        ``hold``: a pin for a load that comes later (not counted as served: ``release`` with
        ``served`` counts what was loaded under it)."""
        reply = self._call("Acquire", _Requests.acquire(engine_id, hashes, hold))
        return convert.acquired_from_pb(reply)

    def acquire_async(self, engine_id: str, hashes: Sequence[BlockHash], *,
                      hold: bool = False) -> Future[AcquiredBlocks]:
        """``acquire`` without blocking: a future of its result (or of its ``grpc.RpcError``).
        The daemon stages SSD hits into DRAM meanwhile; the pin starts when the reply is
        made, so a caller that drops the future must still release a lease it resolves to.
        ``hold`` as for ``acquire``."""
        return self._future("Acquire", _Requests.acquire(engine_id, hashes, hold),
                            convert.acquired_from_pb)

    def probe(self, engine_id: str, hashes: Sequence[BlockHash], *,
              hold: bool = False) -> AcquiredBlocks:
        """A Lookup and an Acquire of the leading DRAM run in one round trip: the chain is
        counted as a Lookup, the blocks DRAM holds at its head are pinned (nothing is read),
        and ``held_after`` names the tier of each held block after them (``acquire`` those).
        ``hold`` as for ``acquire``: the pinned run is not counted as served."""
        reply = self._call("Probe", _Requests.probe(engine_id, hashes, hold))
        return convert.acquired_from_pb(reply)

    def probe_async(self, engine_id: str, hashes: Sequence[BlockHash], *,
                    hold: bool = False) -> Future[AcquiredBlocks]:
        """``probe`` without blocking; release the lease it resolves to as ``acquire_async``'s."""
        return self._future("Probe", _Requests.probe(engine_id, hashes, hold),
                            convert.acquired_from_pb)

    def probe_sent(self, engine_id: str, hashes: Sequence[BlockHash]) -> Sent[AcquiredBlocks]:
        """``probe`` sent now from this thread without waiting (``reserve_sent``'s way): the
        thread that waits for the pin reads it, with no call thread woken for it. The caller
        releases the lease it resolves to; ``abandon`` does not (the pin then lasts until its
        deadline), so hand a Probe given up on to ``when_answered`` instead."""
        return self._sent("Probe", _Requests.probe(engine_id, hashes, False),
                          convert.acquired_from_pb)

    def when_answered(self, sent: Sent[T], then: Callable[[Sent[T]], None]) -> None:
        """Run ``then(sent)`` on one of the client's call threads (``CallThreads``): for a call
        sent by a thread that stopped waiting for it (``then`` reads its answer, waiting for it
        if need be)."""
        self._submit(lambda: then(sent))

    def _future(self, method: str, request: Any, result: Callable[[Any], T]) -> Future[T]:
        """Send ``request`` without waiting: a future of ``result(reply)`` or of the call's
        ``grpc.RpcError``, resolved on one of the client's call threads (``CallThreads``),
        which does nothing else for it. ``ChannelClosed`` at once after ``close``."""
        return self._submit(lambda: result(self._call(method, request)))

    def _submit(self, job: Callable[[], T]) -> Future[T]:
        """Queue ``job`` on the client's call threads (started at the first one);
        ``ChannelClosed`` after ``close``."""
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"the channel to {self.target} was closed")
            if self._calls is None:
                self._calls = CallThreads(CALL_THREADS, "tierd-call")
            return self._calls.submit(job)

    def _sent(self, method: str, request: Any, result: Callable[[Any], T]) -> Sent[T]:
        """Send ``request`` now from this thread, without waiting: its answer ``result(reply)``
        (or its ``grpc.RpcError``) is read at ``result()`` by the thread that calls it, with no
        other thread involved (``LaneCall``), so a caller with work to do meanwhile wakes no
        thread twice for the call. Without the lane (or a full one): ``_future``. A call that
        failed in transport on the lane raises its ``grpc.RpcError`` here or at ``result()``."""
        sent = self._on_lane(lambda lane: LaneSent(lane.send(method, request), result))
        return sent if sent is not None else FutureSent(self._future(method, request, result))

    def release(self, engine_id: str, lease_id: str, *, corrupt_from: int | None = None,
                served: int | None = None) -> bool:
        """Unpin an acquired prefix. ``corrupt_from``: index of the first block whose checksum
        failed after the copy; the daemon re-checks it and drops it if it is corrupt (returns
        True then). ``served``: for a held lease (``hold``), how many of its leading blocks
        were loaded under it (counted as prefill served)."""
        return bool(self._call("Release", _Requests.release(engine_id, lease_id, corrupt_from,
                                                            served)).dropped)

    def release_async(self, engine_id: str, lease_id: str, *,
                      corrupt_from: int | None = None) -> Future[bool]:
        """``release`` without waiting: a future of its result (or of its ``grpc.RpcError``)."""
        return self._future("Release", _Requests.release(engine_id, lease_id, corrupt_from),
                            lambda reply: bool(reply.dropped))

    def release_sent(self, engine_id: str, lease_id: str) -> Sent[bool]:
        """``release`` sent now from this thread without waiting (``reserve_sent``'s way)."""
        return self._sent("Release", _Requests.release(engine_id, lease_id, None),
                          lambda reply: bool(reply.dropped))

    def reserve(self, engine_id: str, hashes: Sequence[BlockHash], *,
                filtered_query_tokens: int = 0) -> ReservedSlots:
        """Reserve a slot per block not stored yet; write each, then ``commit`` or ``abort``.
        ``filtered_query_tokens``: lookups answered from the presence filter since the last
        Reserve, for the node's hit ratio."""
        reply = self._call("Reserve", _Requests.reserve(engine_id, hashes, filtered_query_tokens))
        return convert.reserved_from_pb(reply)

    def reserve_async(self, engine_id: str, hashes: Sequence[BlockHash]) -> Future[ReservedSlots]:
        """``reserve`` without waiting: a future of its slots (or of its ``grpc.RpcError``).
        The lease starts when the reply is made, so a caller that drops the future must still
        abort the reservation it resolves to (or let it lapse)."""
        return self._future("Reserve", _Requests.reserve(engine_id, hashes, 0),
                            convert.reserved_from_pb)

    def reserve_sent(self, engine_id: str, hashes: Sequence[BlockHash]) -> Sent[ReservedSlots]:
        """``reserve_async`` whose answer is read by the thread that takes it (``_sent``); the
        lease as ``reserve_async``'s."""
        return self._sent("Reserve", _Requests.reserve(engine_id, hashes, 0),
                          convert.reserved_from_pb)

    def reserve_blank_async(self, engine_id: str, count: int) -> Future[ReservedSlots]:
        """Reserve ``count`` blank slots (fewer where no room could be made), to be named at
        ``commit`` (``names``), without waiting: a future of them (or of the call's
        ``grpc.RpcError``)."""
        return self._future("Reserve", _Requests.reserve_blank(engine_id, count),
                            convert.reserved_from_pb)

    def reserve_blank_sent(self, engine_id: str, count: int) -> Sent[ReservedSlots]:
        """``reserve_blank_async`` whose answer is read by the thread that takes it
        (``reserve_sent``'s way)."""
        return self._sent("Reserve", _Requests.reserve_blank(engine_id, count),
                          convert.reserved_from_pb)

    def commit(self, engine_id: str, lease_id: str, written: Sequence[bool],
               names: Sequence[BlockHash] = ()) -> int:
        """Publish the written blocks: ``written[i]`` is True if the i-th reserved slot was
        written (False for a hash without a slot); the daemon checksums those bytes itself.
        ``names``: the hash of each blank slot's block, in slot order (blank reservations only).
        Returns blocks now stored."""
        reply = self._call("Commit", _Requests.commit(engine_id, lease_id, written, names))
        return int(reply.stored)

    def commit_async(self, engine_id: str, lease_id: str, written: Sequence[bool],
                     names: Sequence[BlockHash] = ()) -> Future[int]:
        """``commit`` without blocking (the daemon checksums the slots meanwhile): a future of
        the blocks stored, or of the call's ``grpc.RpcError``."""
        return self._future("Commit", _Requests.commit(engine_id, lease_id, written, names),
                            lambda reply: int(reply.stored))

    def commit_many(self, engine_id: str,
                    commits: Sequence[tuple[str, Sequence[bool], Sequence[BlockHash]]]
                    ) -> list[int | CommitRefused]:
        """``commit`` of each (lease id, written, names) in one round trip, in order (at most
        64): per Commit, the blocks now stored or its own failure (``CommitRefused``); a failure
        of the call itself raises ``grpc.RpcError`` as ``commit`` does."""
        return _outcomes(self._call("CommitMany", _Requests.commit_many(engine_id, commits)))

    def commit_many_sent(self, engine_id: str,
                         commits: Sequence[tuple[str, Sequence[bool], Sequence[BlockHash]]]
                         ) -> Sent[list[int | CommitRefused]]:
        """``commit_many`` sent now from this thread without waiting (``reserve_sent``'s way):
        its outcomes are read by the thread that calls ``result()``."""
        return self._sent("CommitMany", _Requests.commit_many(engine_id, commits), _outcomes)

    def abort(self, engine_id: str, lease_id: str) -> None:
        """Free a reservation's slots, storing nothing."""
        self._call("Abort", pb.AbortRequest(engine_id=engine_id, lease_id=lease_id))

    def abort_async(self, engine_id: str, lease_id: str) -> Future[None]:
        """``abort`` without waiting: a future of its end (or of its ``grpc.RpcError``)."""
        return self._future("Abort", pb.AbortRequest(engine_id=engine_id, lease_id=lease_id),
                            lambda reply: None)

    def report_hot_blocks(self, engine_id: str, stored: Sequence[BlockHash] = (),
                          removed: Sequence[BlockHash] = (), cleared: bool = False, *,
                          prefill_tokens_per_second: float = 0.0) -> None:
        """Tell the daemon which blocks entered / left the engine's GPU pool (``cleared``
        first empties the engine's HBM set) and, if measured (> 0), the engine's prefill speed
        (the cache's savings are counted at it)."""
        self._call("ReportHotBlocks", _Requests.hot(engine_id, stored, removed, cleared,
                                                    prefill_tokens_per_second))

    def report_speed_sent(self, engine_id: str, prefill_tokens_per_second: float) -> Sent[bool]:
        """``report_hot_blocks`` of the prefill speed alone, sent now from this thread without
        waiting (``reserve_sent``'s way); its answer is True."""
        return self._sent("ReportHotBlocks", _Requests.hot(engine_id, (), (), False,
                                                           prefill_tokens_per_second),
                          lambda reply: True)

    def locate(self, engine_id: str | None, hashes: Sequence[BlockHash], *,
               layout: Layout | None = None) -> Located:
        """Rank the cluster's nodes by the prefix of ``hashes`` they hold, in the namespace of
        ``engine_id`` or (``engine_id`` None) of ``layout`` under the caller's tenant. One Redis
        round trip on the daemon's side; ``stale`` when Redis could not be asked.
        FAILED_PRECONDITION if the daemon has no cluster (no redis_url)."""
        return convert.located_from_pb(
            self._call("Locate", _Requests.locate(engine_id, hashes, layout)))

    def stats(self) -> DaemonStats:
        """Occupancy and counters of every tier, and the caller's engines."""
        return convert.stats_from_pb(self._call("Stats", pb.StatsRequest()))

    def why(self, layout: Layout, hashes: Sequence[BlockHash],
            variants: Sequence[Variant] = ()) -> WhyAnswer:
        """Where the caller's tenant's chain ``hashes`` in ``layout`` lives on the node and
        why its first missing block misses (``tierd.daemon.why``). Read-only."""
        from tierd.daemon import why_convert

        return why_convert.answer_from_pb(
            self._call("Why", why_convert.request_to_pb(layout, hashes, variants)))

    def wait_ready(self, timeout: float) -> None:
        """Block until the channel connects; ``grpc.FutureTimeoutError`` after ``timeout`` s."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def close(self) -> None:
        """Close the channel and the lane: calls in flight or queued fail (``grpc.RpcError``)."""
        with self._lock:
            self._closed = True
            calls, self._calls = self._calls, None
            lane = self._lane
        self._channel.close()
        if lane is not None:
            lane.close()
        if calls is not None:
            calls.stop()

    def __enter__(self) -> TierdClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncTierdClient:
    """The same calls as ``TierdClient``, as coroutines on one ``grpc.aio`` channel. Create and
    use it inside one running event loop; ``await close()`` (or ``async with``) when done."""

    def __init__(self, *, socket_path: str | None = None, address: str | None = None,
                 token: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.target = target_for(socket_path, address)
        self._channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.TierdStub(self._channel)  # type: ignore[no-untyped-call]
        self._md = _metadata(token)
        self._timeout = timeout

    async def _call(self, method: str, request: Any) -> Any:
        return await getattr(self._stub, method)(request, metadata=self._md,
                                                 timeout=self._timeout)

    async def register_engine(self, layout: Layout, engine_name: str = "") -> EngineHandle:
        """See ``TierdClient.register_engine``."""
        return convert.engine_handle_from_pb(
            await self._call("RegisterEngine", _Requests.register(layout, engine_name)))

    async def unregister_engine(self, engine_id: str) -> None:
        """See ``TierdClient.unregister_engine``."""
        await self._call("UnregisterEngine", pb.UnregisterEngineRequest(engine_id=engine_id))

    async def lookup(self, engine_id: str, hashes: Sequence[BlockHash]) -> list[Tier]:
        """See ``TierdClient.lookup``."""
        reply = await self._call("Lookup", _Requests.chain(pb.LookupRequest, engine_id, hashes))
        return convert.tiers_from_pb(reply.tiers)

    async def acquire(self, engine_id: str, hashes: Sequence[BlockHash], *,
                      hold: bool = False) -> AcquiredBlocks:
        """See ``TierdClient.acquire``."""
        reply = await self._call("Acquire", _Requests.acquire(engine_id, hashes, hold))
        return convert.acquired_from_pb(reply)

    async def probe(self, engine_id: str, hashes: Sequence[BlockHash], *,
                    hold: bool = False) -> AcquiredBlocks:
        """See ``TierdClient.probe``."""
        reply = await self._call("Probe", _Requests.probe(engine_id, hashes, hold))
        return convert.acquired_from_pb(reply)

    async def release(self, engine_id: str, lease_id: str, *,
                      corrupt_from: int | None = None) -> bool:
        """See ``TierdClient.release``."""
        reply = await self._call("Release", _Requests.release(engine_id, lease_id, corrupt_from))
        return bool(reply.dropped)

    async def reserve(self, engine_id: str, hashes: Sequence[BlockHash], *,
                      filtered_query_tokens: int = 0) -> ReservedSlots:
        """See ``TierdClient.reserve``."""
        reply = await self._call("Reserve", _Requests.reserve(engine_id, hashes,
                                                              filtered_query_tokens))
        return convert.reserved_from_pb(reply)

    async def commit(self, engine_id: str, lease_id: str, written: Sequence[bool],
                     names: Sequence[BlockHash] = ()) -> int:
        """See ``TierdClient.commit``."""
        reply = await self._call("Commit", _Requests.commit(engine_id, lease_id, written, names))
        return int(reply.stored)

    async def abort(self, engine_id: str, lease_id: str) -> None:
        """See ``TierdClient.abort``."""
        await self._call("Abort", pb.AbortRequest(engine_id=engine_id, lease_id=lease_id))

    async def report_hot_blocks(self, engine_id: str, stored: Sequence[BlockHash] = (),
                                removed: Sequence[BlockHash] = (), cleared: bool = False, *,
                                prefill_tokens_per_second: float = 0.0) -> None:
        """See ``TierdClient.report_hot_blocks``."""
        await self._call("ReportHotBlocks", _Requests.hot(engine_id, stored, removed, cleared,
                                                          prefill_tokens_per_second))

    async def locate(self, engine_id: str | None, hashes: Sequence[BlockHash], *,
                     layout: Layout | None = None) -> Located:
        """See ``TierdClient.locate``."""
        return convert.located_from_pb(
            await self._call("Locate", _Requests.locate(engine_id, hashes, layout)))

    async def stats(self) -> DaemonStats:
        """See ``TierdClient.stats``."""
        return convert.stats_from_pb(await self._call("Stats", pb.StatsRequest()))

    async def wait_ready(self, timeout: float) -> None:
        """Wait until the channel connects; ``asyncio.TimeoutError`` after ``timeout`` s."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncTierdClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
