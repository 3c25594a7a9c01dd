"""The engine-side core every front end uses: ``settings``, the daemon ``link``, failed-call
``errors``, ``lease`` and ``load`` through ``sinks``, ``save`` and its blank-slot ``stock``,
verified copies between arena slots and pool rows (``arena_slots``), the job model the front ends
adapt (``jobs``) and its one executor (``runner``), and the measured ``prefill_speed``.
"""

from tierd.connector.core.arena_slots import ArenaSlots
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

__all__ = ["DROPS", "ArenaSlots", "ClientSettings", "DaemonLink", "Failure", "Lease",
           "LoadResult", "OpenLoad", "PendingLease", "PoolRows", "Release", "Reservation",
           "Runner", "Session", "Sink", "abort", "acquire", "acquire_async", "classify", "commit",
           "commit_async", "describe", "finish_load", "load_leased", "release",
           "release_async", "releaser", "reserve", "start_load", "write_rows"]
