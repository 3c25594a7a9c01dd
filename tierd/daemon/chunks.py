"""Big requests in bounded steps, so one call of thousands of blocks cannot hold the event loop.

Every call runs on the daemon's one event loop: while a ``Commit`` of 4,096 blocks publishes
them, no other tenant's call is served. The store's heavy methods are written as generators
(``Steps``) that do at most ``STEP_BLOCKS`` blocks of work between two ``yield``s, each ``yield``
a point where the store's tables are consistent; the gRPC edge drives them with ``run_steps``,
which gives the loop to every other ready call between steps. Synchronous callers (tests, the
cluster link) drive them to the end at once with ``run_now``: the same effects, no other call in
between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")

STEP_BLOCKS = 256
"""Most blocks a step handles before it yields the loop (a step of this size takes well under
a millisecond of the loop)."""

Steps = Generator[None, None, T]
"""Work in steps: each ``next`` runs one step; the result is the generator's return value."""


def step_starts(count: int) -> range:
    """Where each step of ``count`` blocks begins: 0, ``STEP_BLOCKS``, ..."""
    return range(0, count, STEP_BLOCKS)


async def run_steps(steps: Steps[T]) -> T:
    """Run ``steps`` to the end, letting every other ready task run between two steps."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


def run_now(steps: Steps[T]) -> T:
    """Run ``steps`` to the end without yielding the loop (for synchronous callers)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
