"""The engine-side core every front end uses (reference hooks, vLLM connector, vLLM tier,
SGLang backend): one way to reach the daemon, one load, one save.

=============  =================================================================================
``settings``   ``ClientSettings``: socket/address/token, engine name, call deadline, retry.
``errors``     ``classify``: the one meaning of a failed call (lease, request, forgotten, down).
``link``       ``DaemonLink`` / ``Session``: register, attach the arena, retry, drop on failure.
``lease``      ``Lease``: an Acquire's pinned slots; ``acquire(_async)``, ``release(_async)``.
``load``       ``load_leased`` (``start_load`` + ``finish_load``) through a ``Sink``.
``sinks``      ``PoolRows``: the sink of a ``[blocks, bytes]`` pool (vLLM's are in its package).
``save``       ``reserve``, ``write_rows``, ``commit(_async)`` (written flags), ``abort``.
``runner``     ``Runner``: the one executor of daemon calls and copies off the engine's threads.
``jobs``       ``EngineJobs``: the job model every front end adapts (lookup, load, store, events).
=============  =================================================================================

A front end, per engine process::

    link = DaemonLink(settings, layout, attach=True)
    if link.connect():
        try:
            lease = acquire(link.client, link.engine.engine_id, hashes, clock=time.monotonic)
        except grpc.RpcError as exc:
            link.failed(exc)
        else:
            done = load_leased(lease, block_ids, link.slots, sink,
                               releaser(link.client, lambda e: link.failed(e, names_lease=True)),
                               time.monotonic)
            # done.placed leading blocks are usable; recompute the rest (invariant 2)
"""

from tierd.connector.core.errors import DROPS, Failure, classify, describe
from tierd.connector.core.lease import (
                                        Lease,
                                        PendingLease,
                                        Release,
                                        acquire,
                                        acquire_async,
                                        release,
                                        release_async,
                                        releaser,
)
from tierd.connector.core.link import DaemonLink, Session
from tierd.connector.core.load import (
                                        LoadResult,
                                        OpenLoad,
                                        Sink,
                                        finish_load,
                                        load_leased,
                                        start_load,
)
from tierd.connector.core.runner import Runner
from tierd.connector.core.save import Reservation, abort, commit, commit_async, reserve, write_rows
from tierd.connector.core.settings import ClientSettings
from tierd.connector.core.sinks import PoolRows
from tierd.connector.transfer import ArenaSlots

__all__ = ["DROPS", "ArenaSlots", "ClientSettings", "DaemonLink", "Failure", "Lease",
           "LoadResult", "OpenLoad", "PendingLease", "PoolRows", "Release", "Reservation",
           "Runner", "Session", "Sink", "abort", "acquire", "acquire_async", "classify", "commit",
           "commit_async", "describe", "finish_load", "load_leased", "release",
           "release_async", "releaser", "reserve", "start_load", "write_rows"]
