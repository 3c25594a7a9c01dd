"""The reference engine's save staging: pool rows gathered on the engine thread into a bounded
ring of host rows (``gather_rows``, a memcpy per run of consecutive pool rows, so the pool may be
reused at once), written to the arena later by the hooks' worker thread."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierd.connector.core.arena_slots import allocate_staging, words

_MAX_RUN_COPIES = 8
"""``gather_rows`` copies run by run up to this many runs, else in one ``index_select``."""


def gather_rows(pool: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Copy pool rows ``block_ids[i]`` into ``out[i]`` (``out``: host uint8 ``[len(block_ids),
    row_bytes]``, contiguous; the pool on any device). One ``copy_`` per run of consecutive
    block ids (a fresh request's blocks are mostly handed out in order, so a save is a run or
    two: plain memcpys, no index tensor), one ``index_select`` when they are scattered. Blocks
    until done."""
    if tuple(out.shape) != (len(block_ids), pool.shape[1]) or out.dtype != pool.dtype:
        raise ValueError(f"out must be {pool.dtype} [{len(block_ids)}, {pool.shape[1]}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    starts = [i for i in range(len(block_ids))
              if i == 0 or block_ids[i] != block_ids[i - 1] + 1]
    if len(starts) <= _MAX_RUN_COPIES:
        for first, stop in zip(starts, starts[1:] + [len(block_ids)]):
            row = block_ids[first]
            out[first:stop].copy_(pool[row:row + stop - first])
        return
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=pool.device)
    src, dst = words(pool), words(out)
    if pool.device == out.device and src.dtype == dst.dtype:
        torch.index_select(src, 0, ids, out=dst)
    else:
        out.copy_(torch.index_select(pool, 0, ids))



@dataclass(frozen=True, slots=True)
class Span:
    """Rows ``[start, stop)`` of a ``StagingRing``."""

    start: int
    stop: int


class StagingRing:
    """A bounded staging area for blocks on their way to the arena: ``[capacity, row_bytes]``
    rows handed out as contiguous spans (one gather fills a span) and given back oldest first.

    ``take`` returns None when the ring cannot fit the span (the caller drops those blocks:
    nothing queues without bound). Thread-safe: one thread takes, another gives back."""

    def __init__(self, capacity: int, row_bytes: int) -> None:
        self.rows = allocate_staging(capacity, row_bytes)
        self.capacity = capacity
        self._spans: deque[Span] = deque()
        self._lock = threading.Lock()

    def take(self, n: int) -> Span | None:
        """Reserve ``n`` contiguous rows (``self.rows[span.start:span.stop]``); None if full."""
        if n < 1:
            raise ValueError(f"take at least one row, got {n}")
        with self._lock:
            if not self._spans:
                start = 0 if n <= self.capacity else None
            else:
                oldest, newest = self._spans[0].start, self._spans[-1].stop
                wrapped = self._spans[-1].start < oldest
                if wrapped:
                    start = newest if newest + n <= oldest else None
                elif newest + n <= self.capacity:
                    start = newest
                else:
                    start = 0 if n <= oldest else None
            if start is None:
                return None
            span = Span(start, start + n)
            self._spans.append(span)
            return span

    def give_back(self, span: Span) -> None:
        """Return the oldest outstanding span (spans come back in the order taken)."""
        with self._lock:
            assert self._spans and self._spans[0] == span, "staging spans return oldest first"
            self._spans.popleft()

    @property
    def used_rows(self) -> int:
        with self._lock:
            return sum(s.stop - s.start for s in self._spans)

    def check_integrity(self) -> None:
        """Assert outstanding spans are disjoint, in bounds and in ring order."""
        with self._lock:
            spans = list(self._spans)
        for span in spans:
            assert 0 <= span.start < span.stop <= self.capacity, f"{span} out of bounds"
        wraps = sum(1 for a, b in zip(spans, spans[1:]) if b.start < a.start)
        assert wraps <= 1, "staging ring wrapped twice"
        for a, b in zip(spans, spans[1:]):
            assert b.start >= a.stop or b.start < a.start, f"{a} and {b} overlap"
        if wraps:
            assert spans[-1].stop <= spans[0].start, "a wrapped span runs into the oldest one"
