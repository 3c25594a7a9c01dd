"""Live miss-ratio curves: the hit ratio each tier would have at other sizes, from a sample of the
node's lookups (SHARDS: spatial sampling with a fixed memory bound).

**Off the request path.** A lookup only queues its chain (its keys joined into one bytes
object: O(1) per request besides that copy, bounded by ``max_pending_blocks``); the maintenance
pass samples and replays the queue (``drain_async``: in steps, requests served between them; a
read of the curves replays at most a few thousand blocks itself). A block is sampled when 3
bytes of its hash fall under a threshold (rate ``R = threshold / 2**24``): the same blocks are
sampled every time they are looked up, whichever chain holds them.

**Model.** Each sampled block gets its stack distance: the distinct sampled blocks referenced
since its own last reference (a ``Fenwick`` tree over reference times), scaled by ``1 / R``. A
lookup hits the leading run of blocks held, so a sampled block of a chain counts as a hit at a
cache of ``c`` blocks when the running maximum of the distances of the chain's sampled blocks
up to it is under ``c`` (exact at rate 1). The histogram holds those running maxima (a first
reference: never a hit), each weighted ``1 / R``; ``hit_ratio(c)`` is the weight under ``c``
over the total: token-weighted prefix hits, as the node's own hit ratio counts them.

**Bound.** At most ``max_keys`` sampled blocks are tracked; past it the threshold drops to the
largest sampled hash, whose block is forgotten (fixed-size SHARDS), so memory stays bounded
whatever the traffic. Histograms are kept per (tenant, model), at most ``max_labels`` (others
fold into one). The curve covers the daemon's life since start.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

from tierd.types import Namespace, NamespacedKey, Tier
from tierd.wire.replies import SCALES, Curve

_P = 1 << 24                 # hash space of the sampling decision (3 bytes of the block hash)
_STEPS = 16                  # histogram buckets per doubling of the distance (~4.4% wide)
_NEVER = -1                  # bucket of first references (a miss at every size)
OTHER: tuple[str, str] = ("", "other")
"""The label of models past ``max_labels``."""

Label = tuple[str, str]
"""(tenant, model id) of a histogram."""


def _bucket(distance: float) -> int:
    return 0 if distance < 1 else 1 + int(_STEPS * math.log2(distance))


def _bucket_range(bucket: int) -> tuple[float, float]:
    if bucket == 0:
        return 0.0, 1.0
    return 2 ** ((bucket - 1) / _STEPS), 2 ** (bucket / _STEPS)


class _Fenwick:
    """Counts per reference time, prefix sums in O(log n)."""

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)

    def add(self, i: int, delta: int) -> None:
        while i < len(self.tree):
            self.tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


class Shards:
    """The sampler and its histograms. Not thread-safe: the event loop calls ``accessed`` and
    ``drain``; readers (``curves``) drain first and run on the event loop too."""

    def __init__(self, label_of: Callable[[Namespace], Label | None], *,
                 max_keys: int = 65_536, max_pending_blocks: int = 1 << 16,
                 max_labels: int = 256) -> None:
        self._label_of = label_of
        self.max_keys, self._max_pending, self._max_labels = max_keys, max_pending_blocks, \
            max_labels
        self.threshold = _P                                  # sample all until the bound bites
        self._below = b"\xff" * 4     # ``threshold`` as bytes: a root's 3 bytes sort under it
        self._pending: deque[tuple[Namespace, bytes, int]] = deque()  # keys joined, key length
        self._pending_blocks = 0
        self.dropped_chains = 0                              # past max_pending_blocks
        self._last: dict[NamespacedKey, int] = {}            # sampled block -> last reference time
        self._roots: list[tuple[int, NamespacedKey]] = []    # max-heap (negated) of hashes
        self._root_of: dict[NamespacedKey, int] = {}         # sampled block -> its hash
        self._capacity = 4 * max_keys                        # reference times before a renumber
        self._tree = _Fenwick(self._capacity)
        self._time = 0
        self._hist: dict[Label, dict[int, float]] = {}

    @property
    def rate(self) -> float:
        """The share of blocks sampled now."""
        return self.threshold / _P

    @property
    def sampled_blocks(self) -> int:
        """Blocks tracked now (at most ``max_keys``)."""
        return len(self._last)

    def accessed(self, namespace: Namespace, keys: Sequence[NamespacedKey]) -> None:
        """A lookup of ``keys`` (one chain, first block first): queued for ``drain``."""
        if keys:
            if self._pending_blocks + len(keys) > self._max_pending:
                self.dropped_chains += 1
                return
            self._pending.append((namespace, b"".join(keys), len(keys[0])))
            self._pending_blocks += len(keys)

    def drain(self, limit: int | None = None) -> None:
        """Replay the queued chains through the stack model (see the module doc): all, or
        whole chains until about ``limit`` blocks were replayed. Never blocks on I/O; costs a
        few microseconds per queued block."""
        budget = math.inf if limit is None else limit
        while self._pending and budget > 0:
            namespace, joined, size = self._pending.popleft()
            self._pending_blocks -= len(joined) // size
            budget -= len(joined) // size
            below = self._below
            keys = [NamespacedKey(joined[i:i + size]) for i in range(0, len(joined), size)]
            sampled = [k for k in keys if k[-3:] < below]
            if sampled:
                self._replay(self._label(namespace), sampled)

    async def drain_async(self, step: int = 1024) -> None:
        """``drain`` all, about ``step`` blocks at a time, yielding to the event loop between
        steps so requests are served meanwhile."""
        while self._pending:
            self.drain(step)
            await asyncio.sleep(0)

    def hit_ratio(self, capacity_blocks: float, label: Label | None = None) -> float:
        """The estimated hit ratio at a cache of ``capacity_blocks`` blocks, for ``label``'s
        references (None: all), 0.0 before any reference."""
        hists = [self._hist[label]] if label is not None else list(self._hist.values())
        under = total = 0.0
        for hist in hists:
            for bucket, weight in hist.items():
                total += weight
                if bucket == _NEVER:
                    continue
                low, high = _bucket_range(bucket)
                if high <= capacity_blocks:
                    under += weight
                elif low < capacity_blocks:
                    under += weight * (capacity_blocks - low) / (high - low)
        return under / total if total else 0.0

    def curves(self, tier: Tier, capacity_blocks: int,
               labels: Sequence[Label] | None = None) -> list[Curve]:
        """The tier's curve for every reference (tenant "" and model "*") and one per label
        (``labels``, default every label seen), after draining the queue."""
        self.drain()
        out = []
        for label in [None, *(self._hist if labels is None else labels)]:
            if label is not None and label not in self._hist:
                continue
            ratios = tuple(self.hit_ratio(s * capacity_blocks, label) for s in SCALES)
            weight = sum((self._hist[label] if label else _merged(self._hist)).values())
            tenant, model = label if label is not None else ("", "*")
            out.append(Curve(tier, tenant, model, capacity_blocks, ratios, _flattens(ratios),
                             weight))
        return out

    def labels(self) -> list[Label]:
        return list(self._hist)

    def check_integrity(self) -> None:
        assert len(self._last) <= self.max_keys, "SHARDS sample over max_keys"
        assert set(self._last) == set(self._root_of), "sampled blocks without their tree"
        assert all(r < self.threshold for r in self._root_of.values()), "a block over the rate"
        assert self._pending_blocks <= self._max_pending, "SHARDS queue over its bound"
        assert self._pending_blocks == sum(len(j) // n for _, j, n in self._pending), \
            "queue miscounted"
        assert len(self._hist) <= self._max_labels + 1, "SHARDS labels over their bound"
        assert self._tree.prefix(self._time) == len(self._last), "reference times drifted"

    # -- the stack model -------------------------------------------------------------------

    def _label(self, namespace: Namespace) -> Label:
        label = self._label_of(namespace) or OTHER
        if label not in self._hist and len(self._hist) >= self._max_labels:
            return OTHER
        return label

    def _replay(self, label: Label, keys: Sequence[NamespacedKey]) -> None:
        """The sampled blocks of one chain: each one's running-maximum distance as of before
        the chain's own references, then every one referenced in chain order (the last
        newest)."""
        hist = self._hist.setdefault(label, {})
        weight = 1.0 / self.rate
        now, running = self._tree.prefix(self._time), 0.0
        for key in keys:
            last = self._last.get(key)
            if last is None:
                running = math.inf
            elif running < math.inf:
                running = max(running, (now - self._tree.prefix(last)) / self.rate)
            bucket = _NEVER if running == math.inf else _bucket(running)
            hist[bucket] = hist.get(bucket, 0.0) + weight
        for key in keys:
            if self._time + 1 > self._capacity:
                self._renumber()
            last = self._last.get(key)
            if last is not None:
                self._tree.add(last, -1)
            else:
                root = _root(key)
                self._root_of[key] = root
                heapq.heappush(self._roots, (-root, key))
            self._time += 1
            self._tree.add(self._time, 1)
            self._last[key] = self._time
        while len(self._last) > self.max_keys:
            self._lower_rate()

    def _lower_rate(self) -> None:
        """Forget the sampled blocks of the highest hash and sample below it from now on."""
        top = -self._roots[0][0]
        self.threshold = top
        self._below = top.to_bytes(3, "big")
        while self._roots and -self._roots[0][0] >= top:
            _, key = heapq.heappop(self._roots)
            last = self._last.pop(key, None)
            if last is not None:
                self._tree.add(last, -1)
                del self._root_of[key]

    def _renumber(self) -> None:
        """Reference times ran out: give the tracked blocks times 1..n in the same order."""
        order = sorted(self._last, key=self._last.__getitem__)
        self._tree = _Fenwick(self._capacity)
        for time, key in enumerate(order, 1):
            self._last[key] = time
            self._tree.add(time, 1)
        self._time = len(order)


def _root(key: NamespacedKey) -> int:
    """The sampling hash of a block: 3 bytes of its block hash (uniform)."""
    return int.from_bytes(key[-3:], "big")


def _merged(hists: dict[Label, dict[int, float]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for hist in hists.values():
        for bucket, weight in hist.items():
            out[bucket] = out.get(bucket, 0.0) + weight
    return out


def _flattens(ratios: Sequence[float]) -> float | None:
    """The smallest scale below the largest from which the curve gains under one point up to
    the largest; None if none does (it still climbs at the largest)."""
    for scale, ratio in zip(SCALES[:-1], ratios[:-1]):
        if ratios[-1] - ratio < 0.01:
            return scale
    return None
