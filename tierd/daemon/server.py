"""The gRPC edge of the node daemon: thin servicers over ``NodeStore``, one error-mapping
interceptor, health + reflection, Unix-socket (and optional TCP) listeners, the lane beside the
Unix socket (``lane_server``: the engines' calls through the same interceptor, without gRPC's
per-call cost), the background maintenance pass, and graceful shutdown.

Servicers hold no logic: each resolves the caller's tenant, checks the engine id belongs to it,
converts the request (``convert``), calls one ``NodeStore`` method and converts the result back.
Everything runs on one asyncio event loop; ``NodeStore`` is not thread-safe and is only touched
from it. The only catch-all of the daemon is ``ErrorInterceptor``: a bug in one call becomes
INTERNAL with a logged traceback, and the daemon keeps serving.

With ``redis_url`` set the daemon is a cluster node (``cluster_link.ClusterLink``): the store's
tier changes are published to the Redis directory by a background task, ``Locate`` asks the
directory, and with ``remote_tier`` evicted blocks are shared through Redis. A Redis failure is
never an RPC error: it makes the directory stale and the node serves locally.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tierd.daemon import why_convert
from tierd.daemon.arena import OwnedArena, check_room, free_bytes
from tierd.daemon.arena_owner import new_arena_name, remove_stale_arenas
from tierd.daemon.auth import Authenticator, TokenTable
from tierd.daemon.build import Node, build_node
from tierd.daemon.chunks import run_steps
from tierd.daemon.cluster_link import ClusterLink
from tierd.daemon.commit_edge import CommitEdge
from tierd.daemon.config import TierdConfig
from tierd.daemon.engine_access import group_id, share
from tierd.daemon.errors import FailedPrecondition, ResourceExhausted, Unauthenticated
from tierd.daemon.lane_server import LaneServer
from tierd.daemon.loop_share import LoopShare, LoopShareCollector
from tierd.daemon.node import NodeConfig, NodeStore
from tierd.daemon.presence import PresenceFilter
from tierd.daemon.slots import SlabAllocator
from tierd.daemon.ssd import SsdStore
from tierd.daemon.status import MAX_DETAILS_CHARS, status_for
from tierd.v1 import tierd_pb2 as pb
from tierd.v1 import tierd_pb2_grpc as pb_grpc
from tierd.wire import convert
from tierd.wire.arena import ShmArena
from tierd.wire.lane import lane_path, request_type
from tierd.wire.layout import Layout, namespace_for

_log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tierd"].full_name  # "tierd.v1.Tierd"


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Wraps every unary-unary method of every service (Tierd, health): parses the request itself
    (a malformed message is INVALID_ARGUMENT, not gRPC's INTERNAL), maps domain errors with
    ``status_for``, turns anything else into INTERNAL with a logged traceback, and records the
    call's latency with ``observe(method, seconds)``. Streaming methods pass through untouched.

    With a ``loop_share`` (and ``tenant_of``: the caller's tenant, or None when it has none),
    each call is admitted by its tenant's share of the event loop and its loop time counted
    there (``tierd.daemon.loop_share``)."""

    def __init__(self, observe: Callable[[str, float], None],
                 loop_share: LoopShare | None = None,
                 tenant_of: Callable[[grpc.aio.ServicerContext], str | None] = lambda c: None
                 ) -> None:
        self._observe, self._share, self._tenant_of = observe, loop_share, tenant_of

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self.guard(details.method, handler.unary_unary, handler.request_deserializer),
            request_deserializer=None, response_serializer=handler.response_serializer)

    def guard(self, method: str, behavior: Callable[..., Any],
              parse: Callable[[bytes], Any] | None) -> Callable[..., Awaitable[Any]]:
        """``behavior`` (a unary method named ``method``, its request parsed by ``parse``) as
        this interceptor runs it: (serialized request, context) -> reply; errors end in
        ``context.abort``. The lane runs its calls through it too (``lane_server``)."""
        name = method.rsplit("/", 1)[-1]

        async def run(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                request = parse(raw) if parse is not None else raw
            except DecodeError as exc:
                raise ValueError(f"malformed {name} request: {exc}") from None
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            loop = self._share
            tenant = self._tenant_of(context) if loop is not None else None
            try:
                if loop is None or tenant is None:
                    return await run(raw, context)
                await loop.admit(tenant)
                try:
                    return await loop.timed(tenant, run(raw, context))
                finally:
                    loop.finished(tenant)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # the daemon's one catch-all: map, log bugs, keep serving
                code = status_for(exc)
                if code is not None:
                    await context.abort(code, str(exc)[:MAX_DETAILS_CHARS])
                _log.exception("%s failed with a bug; answering INTERNAL", method)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}: "
                                    f"{type(exc).__name__}: {exc}"[:MAX_DETAILS_CHARS])
            finally:
                self._observe(name, time.perf_counter() - start)

        return call


class TierdServicer(pb_grpc.TierdServicer):
    """The Tierd service: one NodeStore call per RPC, conversion at the edge, nothing else."""

    def __init__(self, store: NodeStore, arena: ShmArena, allocator: SlabAllocator,
                 ssd: SsdStore | None, node_config: NodeConfig, auth: Authenticator,
                 cluster: ClusterLink | None = None,
                 presence: PresenceFilter | None = None) -> None:
        self._store, self._arena, self._allocator, self._ssd = store, arena, allocator, ssd
        self._presence = presence
        self._node_config = node_config
        self._auth = auth
        self._cluster = cluster
        self._acquire = store.acquire if cluster is None else cluster.acquire
        self._commits = CommitEdge(store)

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        return self._auth.tenant(context.peer(), context.invocation_metadata() or ())

    def _engine(self, context: grpc.aio.ServicerContext, engine_id: str) -> str:
        """Check ``engine_id`` belongs to the caller's tenant (NotFound otherwise)."""
        return self._store.engine(engine_id, self._tenant(context)).engine_id

    def engine_lapsed(self, engine_id: str) -> None:
        """The store unregistered a silent engine: forget it here too."""
        if self._cluster is not None:
            self._cluster.engine_unregistered(engine_id)

    async def RegisterEngine(self, request: pb.RegisterEngineRequest,
                             context: grpc.aio.ServicerContext) -> pb.RegisterEngineResponse:
        tenant = self._tenant(context)
        layout = convert.layout_from_pb(request.layout)
        info = self._store.register_engine(tenant, layout, request.engine_name)
        if self._cluster is not None:
            self._cluster.engine_registered(info)
        _log.info("engine %s (%r, tenant %s) registered: %s", info.engine_id,
                  request.engine_name, tenant, describe_capacity(layout, self._allocator,
                                                                 self._ssd))
        return pb.RegisterEngineResponse(
            engine_id=info.engine_id, arena_name=self._arena.name,
            arena_directory=os.path.dirname(self._arena.path), arena_bytes=self._arena.size,
            geometry=convert.geometry_to_pb(info.geometry),
            lease_seconds=self._node_config.lease_seconds,
            max_blocks_per_request=self._node_config.max_blocks_per_request,
            presence_name=self._presence.name if self._presence is not None else "",
            namespace=(self._presence.prefix(info.namespace) if self._presence is not None
                       else b""))

    async def UnregisterEngine(self, request: pb.UnregisterEngineRequest,
                               context: grpc.aio.ServicerContext) -> pb.UnregisterEngineResponse:
        self._store.unregister_engine(self._engine(context, request.engine_id))
        if self._cluster is not None:
            self._cluster.engine_unregistered(request.engine_id)
        return pb.UnregisterEngineResponse()

    async def Lookup(self, request: pb.LookupRequest,
                     context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        engine_id = self._engine(context, request.engine_id)
        result = self._store.lookup(engine_id, convert.hashes_from_pb(request.block_hashes))
        return pb.LookupResponse(tiers=convert.tiers_to_pb(result.tiers))

    async def Acquire(self, request: pb.AcquireRequest,
                      context: grpc.aio.ServicerContext) -> pb.AcquireResponse:
        engine_id = self._engine(context, request.engine_id)
        lease = await self._acquire(engine_id, convert.hashes_from_pb(request.block_hashes),
                                    hold=request.hold)
        return pb.AcquireResponse(lease_id=lease.lease_id,
                                  seconds_left=lease.ttl_seconds,
                                  slot_ids=lease.slot_ids, checksums=lease.checksums)

    async def Probe(self, request: pb.ProbeRequest,
                    context: grpc.aio.ServicerContext) -> pb.ProbeResponse:
        engine_id = self._engine(context, request.engine_id)
        lease = self._store.probe(engine_id, convert.hashes_from_pb(request.block_hashes),
                                  hold=request.hold)
        return pb.ProbeResponse(lease_id=lease.lease_id, seconds_left=lease.ttl_seconds,
                                slot_ids=lease.slot_ids, checksums=lease.checksums,
                                held_after=convert.tiers_to_pb(lease.held_after))

    async def Release(self, request: pb.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        engine_id = self._engine(context, request.engine_id)
        corrupt = request.corrupt_from if request.HasField("corrupt_from") else None
        served = request.served if request.HasField("served") else None
        return pb.ReleaseResponse(dropped=self._store.release(
            request.lease_id, engine_id=engine_id, corrupt_from=corrupt, served=served))

    async def Reserve(self, request: pb.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        engine_id = self._engine(context, request.engine_id)
        if request.blank_slots:
            if request.block_hashes:
                raise ValueError("a Reserve asks for blank_slots or names block_hashes, not both")
            if request.filtered_query_tokens:
                raise ValueError("filtered_query_tokens go with a Reserve of block_hashes, not "
                                 "of blank_slots: report them at the next named Reserve")
            res = await run_steps(self._store.reserve_blank_steps(engine_id,
                                                                  request.blank_slots))
        else:
            res = await run_steps(self._store.reserve_steps(
                engine_id, convert.hashes_from_pb(request.block_hashes),
                filtered_query_tokens=request.filtered_query_tokens))
        return pb.ReserveResponse(lease_id=res.lease_id,
                                  seconds_left=res.ttl_seconds,
                                  slots=convert.reserved_to_pb(res.slot_ids, res.already_stored))

    async def Commit(self, request: pb.CommitRequest,
                     context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        engine_id = self._engine(context, request.engine_id)
        return pb.CommitResponse(stored=await self._commits.commit(engine_id, request))

    async def CommitMany(self, request: pb.CommitManyRequest,
                         context: grpc.aio.ServicerContext) -> pb.CommitManyResponse:
        engine_id = self._engine(context, request.engine_id)
        return await self._commits.commit_many(engine_id, request)

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        engine_id = self._engine(context, request.engine_id)
        self._store.abort(request.lease_id, engine_id=engine_id)
        return pb.AbortResponse()

    async def ReportHotBlocks(self, request: pb.ReportHotBlocksRequest,
                              context: grpc.aio.ServicerContext) -> pb.ReportHotBlocksResponse:
        engine_id = self._engine(context, request.engine_id)
        self._store.report_hbm(engine_id, convert.hashes_from_pb(request.stored),
                               convert.hashes_from_pb(request.removed), request.cleared)
        if request.prefill_tokens_per_second:
            self._store.insight.savings.report_speed(
                self._store.engine(engine_id, self._tenant(context)).namespace,
                request.prefill_tokens_per_second)
        return pb.ReportHotBlocksResponse()

    async def Stats(self, request: pb.StatsRequest,
                    context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        insight, stats = self._store.insight, self._store.stats()
        insight.tally()  # the hooks' queues: per-model counts and savings as of this call
        if self._auth.is_admin(context.invocation_metadata() or ()):  # every tenant's usage
            reply = convert.stats_to_pb(stats, (), (), self._store.tenants())
            tenant = None
        else:
            tenant = self._tenant(context)
            reply = convert.stats_to_pb(stats, self._store.engines_of(tenant),
                                        self._store.models_of(tenant), self._store.tenants(tenant))
        reply.savings.extend(convert.savings_to_pb(insight.savings.rows(tenant)))
        reply.what_if.extend(convert.curves_to_pb(insight.what_if(stats, tenant)))
        return reply

    async def Locate(self, request: pb.LocateRequest,
                     context: grpc.aio.ServicerContext) -> pb.LocateResponse:
        if self._cluster is None:
            raise FailedPrecondition("this daemon runs without a cluster: start it with "
                                     "--redis-url redis://HOST:PORT/DB (TIERD_REDIS_URL)")
        hashes = convert.hashes_from_pb(request.block_hashes)
        if len(hashes) > self._node_config.max_blocks_per_request:
            raise ResourceExhausted(f"{len(hashes)} blocks in one Locate; at most "
                                    f"{self._node_config.max_blocks_per_request}")
        if request.engine_id:
            namespace = self._cluster.namespace_of(self._engine(context, request.engine_id))
        elif request.HasField("layout"):
            namespace = namespace_for(self._tenant(context),
                                      convert.layout_from_pb(request.layout))
        else:
            raise ValueError("Locate needs engine_id, or a layout to ask without registering")
        placements, stale = await self._cluster.locate(namespace, hashes)
        return convert.locate_to_pb(placements, stale)

    async def Why(self, request: pb.WhyRequest,
                  context: grpc.aio.ServicerContext) -> pb.WhyResponse:
        layout, hashes, variants = why_convert.request_from_pb(request)
        tenant = self._tenant(context)
        answer = self._store.insight.why.explain(tenant, layout, hashes, variants)
        if self._cluster is not None:
            nodes, stale = await self._cluster.locate(namespace_for(tenant, layout), hashes)
            answer = dataclasses.replace(answer, cluster=True, nodes=nodes, cluster_stale=stale)
        return why_convert.answer_to_pb(answer)


def describe_capacity(layout: Layout, allocator: SlabAllocator, ssd: SsdStore | None) -> str:
    """One log line: how many blocks and tokens of ``layout`` each tier could hold."""
    dram = allocator.capacity_slots(layout.block_bytes)
    parts = [f"block {layout.block_bytes} B ({layout.block_size} tokens)",
             f"DRAM {dram} blocks = {dram * layout.block_size} tokens"]
    if ssd is not None:
        blocks = ssd.capacity_bytes // ssd.record_bytes(layout.block_bytes)
        parts.append(f"SSD {blocks} blocks = {blocks * layout.block_size} tokens")
    return ", ".join(parts)


def _claim_socket(path: str) -> None:
    """Remove a stale socket file at ``path``; ``ValueError`` if a live daemon answers on it."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover of a killed daemon
        return
    finally:
        probe.close()
    raise ValueError(f"a daemon already listens on {path}: stop it, or pass another --socket-path")


class Daemon:
    """One running node: arena, allocator, SSD store, NodeStore, gRPC server, maintenance task.

    Build with ``await Daemon.start(config)``; stop with ``await daemon.stop()`` (idempotent).
    """

    def __init__(self, config: TierdConfig, arena: OwnedArena, store: NodeStore,
                 server: grpc.aio.Server, health: HealthServicer, tcp_port: int | None,
                 cluster: ClusterLink | None = None,
                 presence: PresenceFilter | None = None) -> None:
        self.config, self.arena, self.store = config, arena, store
        self.cluster = cluster
        """The cluster link (directory, publisher, remote tier), None without ``redis_url``."""
        self.presence = presence
        """The presence filter engines read, None when off (or with the remote tier)."""
        self._server, self._health = server, health
        self.tcp_port = tcp_port
        """The bound TCP port (the real one when the config asked for 0), None without TCP."""
        self._tasks: list[asyncio.Task[None]] = []   # the maintain and write-behind loops
        self._stopping = asyncio.Event()
        self._metrics_http: Any = None
        self.metrics_port: int | None = None
        """The bound Prometheus port (the real one when the config asked for 0), or None."""
        self._stopped = False
        self.loop_share: LoopShare | None = None
        """Each tenant's share of the event loop (set by ``start``)."""
        self.lane: LaneServer | None = None
        """The lane's server (``tierd.wire.lane``), None without one (set by ``start``)."""
        self.lane_path: str | None = None
        """Where the lane listens, None without one."""

    @classmethod
    async def start(cls, config: TierdConfig,
                    extra_handlers: Sequence[grpc.GenericRpcHandler] = ()) -> Daemon:
        """Create the arena (pre-faulted; ValueError naming the fixes, before anything is made,
        if its directory lacks the room), open the SSD tier (rebuilding its index), bind the
        listeners and start serving. Blocks the loop for the arena pre-fault. ``extra_handlers``
        are served beside Tierd (the benchmark's echo service)."""
        config.validate()
        remove_stale_arenas(config.arena_directory)
        presence = config.presence_cells if config.presence_cells and not config.remote_tier else 0
        check_room(config.arena_directory, config.dram_bytes + presence,
                   free_bytes(config.arena_directory))
        arena = OwnedArena.create(new_arena_name(), config.dram_bytes,
                                  directory=config.arena_directory, prefault=config.prefault)
        try:
            return await cls._start_with(config, arena, extra_handlers)
        except BaseException:
            arena.close()
            arena.unlink()
            raise

    @classmethod
    async def _start_with(cls, config: TierdConfig, arena: OwnedArena,
                          extra_handlers: Sequence[grpc.GenericRpcHandler]) -> Daemon:
        node = build_node(config, arena)
        try:
            return await cls._serve(config, arena, node, extra_handlers)
        except BaseException:
            if node.presence is not None:
                node.presence.close()
            raise

    @classmethod
    async def _serve(cls, config: TierdConfig, arena: OwnedArena, node: Node,
                     extra_handlers: Sequence[grpc.GenericRpcHandler]) -> Daemon:
        store, allocator, ssd = node.store, node.allocator, node.ssd
        cluster, presence = node.cluster, node.presence
        latency = store.metrics.rpc_latency
        tokens = TokenTable.load(config.token_file)
        if config.tcp_token:
            tokens = tokens.with_token(config.tcp_token, config.default_tenant)
        auth = Authenticator(tokens, config.default_tenant, config.admin_token)
        loop_share = LoopShare(config.loop_share_wait_seconds)
        store.metrics.registry.register(LoopShareCollector(loop_share))
        interceptor = ErrorInterceptor(lambda m, s: latency.labels(m).observe(s), loop_share,
                                       lambda context: _tenant_or_none(auth, context))
        server = grpc.aio.server(
            interceptors=[interceptor],
            options=[("grpc.max_receive_message_length", config.max_message_bytes),
                     ("grpc.max_send_message_length", config.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        servicer = TierdServicer(store, arena, allocator, ssd, config.node_config(), auth,
                                 cluster, presence)
        store.watch_engines(servicer.engine_lapsed)
        pb_grpc.add_TierdServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        server.add_generic_rpc_handlers(list(extra_handlers))
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        if config.engine_group:
            gid = group_id(config.engine_group)
            for shm in (arena, presence.shm if presence is not None else None):
                if shm is not None:
                    shm.share_with_group(gid)
        if config.socket_path:
            _claim_socket(config.socket_path)
            server.add_insecure_port(f"unix:{config.socket_path}")
            if config.engine_group:
                share(config.socket_path, gid)
        tcp_port = None
        if config.tcp_port is not None:
            tcp_port = server.add_insecure_port(f"{_bracket(config.tcp_host)}:{config.tcp_port}")
        lane = None
        path = lane_path(config.socket_path) if config.socket_path and config.lane else None
        if config.socket_path and config.lane and path is None:
            _log.warning("no lane: %s.lane would be longer than a Unix socket path may be (107 "
                         "bytes); engines call over gRPC. Shorten socket_path",
                         config.socket_path)
        if path is not None:
            _claim_socket(path)
            lane = LaneServer(lambda name: interceptor.guard(
                f"/{SERVICE_NAME}/{name}", getattr(servicer, name), request_type(name).FromString),
                config.max_message_bytes)
            await lane.start(path)
            if config.engine_group:
                share(path, gid)
        await server.start()
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        daemon = cls(config, arena, store, server, health, tcp_port, cluster, presence)
        daemon.lane, daemon.lane_path = lane, path if lane is not None else None
        daemon.loop_share = loop_share
        daemon._tasks.append(asyncio.create_task(daemon._every(
            config.maintain_seconds, daemon.maintain, "maintain pass")))
        if ssd is not None and config.write_behind_seconds > 0:
            daemon._tasks.append(asyncio.create_task(daemon._every(
                config.write_behind_seconds / 2, store.write_behind, "write-behind pass")))
        if config.metrics_port is not None:
            from prometheus_client import start_http_server
            daemon._metrics_http, _ = start_http_server(
                config.metrics_port, addr=config.metrics_host, registry=store.metrics.registry)
            daemon.metrics_port = daemon._metrics_http.server_port
        if config.tenant_quotas:
            _log.info("tenant quotas: %s", config.tenant_quotas.describe())
        if cluster is not None:
            cluster.set_address(config.published_address(tcp_port))
            cluster.start()
            _log.info("cluster node %s (%s): directory %s, remote tier %s", config.node_id,
                      cluster.config.node.address, config.redis_url,
                      f"on, {config.remote_tier_bytes >> 20} MiB" if config.remote_tier
                      else "off")
        _log.info("tierd serving: arena %s (%s, slabs of %s), SSD %s, %s%s%s",
                  arena.path, format_bytes(config.dram_bytes), format_bytes(config.slab_bytes),
                  f"{config.ssd_dir} bound {format_bytes(config.ssd_bytes)}, write-behind "
                  + (f"{config.write_behind_seconds:g} s" if config.write_behind_seconds
                     else "off") if ssd is not None else "off",
                  f"unix:{config.socket_path}" + (" (and its lane)" if lane is not None else "")
                  if config.socket_path else "",
                  f" tcp {config.tcp_host}:{tcp_port}" if tcp_port is not None else "",
                  f" metrics http://{config.metrics_host}:{daemon.metrics_port}/metrics"
                  if daemon.metrics_port is not None else "")
        return daemon

    async def maintain(self) -> None:
        """One upkeep pass: ``NodeStore.maintain`` (lease expiry, demotion), then the blocks it
        and the request path evicted go to the remote tier (when on)."""
        await self.store.maintain()
        if self.cluster is not None:
            await self.cluster.flush_remote()

    async def _every(self, period: float, work: Callable[[], Awaitable[object]],
                     what: str) -> None:
        """Run ``work`` every ``period`` seconds until ``stop``; a pass that fails is logged
        and retried. Never cancelled mid-pass: ``stop`` waits for the pass in flight."""
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), period)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await work()
            except Exception:  # a failed pass must not end the loop for good
                _log.exception("%s failed; retrying in %.1f s", what, period)

    async def stop(self, grace: float = 2.0) -> None:
        """Stop accepting calls, let running ones finish for ``grace`` seconds, let the maintain
        and write-behind passes in flight finish, close the store (writing DRAM-only blocks to
        SSD within ``stop_flush_seconds``), then unlink the arena and the socket. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        if self.lane is not None:
            await self.lane.stop()
        await self._server.stop(grace)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self._stopping.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.cluster is not None:
            await self.cluster.close()
        flushed = await self.store.close()
        if self.store.has_ssd:
            _log.info("stop: %d DRAM-only blocks written to SSD in %.2f s, %d left DRAM-only "
                      "(budget %.1f s)", flushed.written, flushed.seconds, flushed.left,
                      self.config.stop_flush_seconds)
        if self.presence is not None:
            self.presence.close()
        self.arena.close()
        self.arena.unlink()
        for path in (self.config.socket_path, self.lane_path):
            if path and os.path.exists(path):
                os.unlink(path)
        _log.info("tierd stopped: arena and socket removed")


def _tenant_or_none(auth: Authenticator, context: grpc.aio.ServicerContext) -> str | None:
    """The caller's tenant for its share of the loop; None when it has none (a bad or missing
    token, the admin token: the call itself answers that)."""
    try:
        return auth.tenant(context.peer(), context.invocation_metadata() or ())
    except Unauthenticated:
        return None


def format_bytes(n: int) -> str:
    """``65536`` -> "64 KiB", ``1 << 30`` -> "1 GiB", ``1536`` -> "1.5 KiB" (log lines)."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve(config: TierdConfig) -> None:
    """Run a daemon until SIGTERM or SIGINT, then stop it gracefully. Once it serves, the heap
    built at start-up (modules, gRPC, protobuf) is frozen out of the garbage collector, so a
    full collection walks only what the daemon allocated since and holds the event loop for a
    fraction of the time (this process's objects only: an in-process ``Daemon`` freezes
    nothing)."""
    daemon = await Daemon.start(config)
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        _log.info("signal received: shutting down")
    finally:
        await daemon.stop()
