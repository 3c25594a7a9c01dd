"""The engine-side core every front end uses (reference hooks, vLLM connector, vLLM tier, SGLang
backend): client ``settings``, the daemon ``link``, one classification of failed calls
(``errors``), ``lease`` and ``load`` through a sink (``sinks``), ``save`` and its blank-slot
``stock``, batched verified copies between arena slots and pool rows (``arena_slots``), the job
model every front end adapts (``jobs``), the one executor of their daemon calls (``runner``), and
the engine's measured prefill speed that the front ends report for the daemon's savings
(``prefill_speed``).
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
