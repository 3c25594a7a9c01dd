"""The optional shared remote tier: whole blocks stored in Redis, under a byte budget.

Off by default (the daemon builds a ``RemoteTier`` only when configured). A block lives at
``<prefix>r:k:<namespace||hash>`` as a 24-byte header (magic ``TDR1``, flags, xxh3-64 checksum of
the uncompressed payload, payload length) followed by the payload, lz4-compressed only when
that is smaller. Eviction is LRU under ``budget_bytes`` (counted in stored bytes, headers
included), done atomically by the put script: ``<prefix>r:lru`` (ZSET key -> access tick),
``<prefix>r:size`` (HASH key -> stored bytes), ``<prefix>r:used`` (total), ``<prefix>r:tick``
(the access counter). No TTL: the budget alone bounds memory; set Redis ``maxmemory`` above the
budget as a backstop.

A fetched block whose header or checksum does not verify is deleted and reported as a miss.
Every Redis failure is a miss (or a skipped put) and marks the shared ``Directory`` stale;
nothing raises. Because a slow fetch can lose to recomputing, ``should_fetch`` compares the
fetch time predicted from an EWMA of measured bandwidth against the caller's recompute time.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import lz4.block

from tierd.checksum import block_checksum
from tierd.cluster.directory import Directory
from tierd.types import BlockHash, Namespace, make_key

_log = logging.getLogger(__name__)

_HEADER: Final = struct.Struct("<4sB3xQQ")      # magic, flags, checksum, payload length
_MAGIC: Final = b"TDR1"
_LZ4: Final = 1

# KEYS: blob, lru zset, size hash, used counter, tick counter. ARGV: value, budget.
# Returns the number of blocks evicted, or -1 if the value alone is over the budget.
_PUT: Final = """
local size, budget = string.len(ARGV[1]), tonumber(ARGV[2])
if size > budget then return -1 end
local old = redis.call('HGET', KEYS[3], KEYS[1])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), KEYS[1])
local used, evicted = redis.call('INCRBY', KEYS[4], size), 0
while used > budget do
  local victim = redis.call('ZPOPMIN', KEYS[2])[1]
  used = redis.call('DECRBY', KEYS[4], tonumber(redis.call('HGET', KEYS[3], victim)))
  redis.call('HDEL', KEYS[3], victim)
  redis.call('DEL', victim)
  evicted = evicted + 1
end
return evicted
"""

# KEYS: blob, lru zset, tick counter. A hit moves the block to the LRU's young end.
_GET: Final = """
local value = redis.call('GET', KEYS[1])
if value then redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[3]), KEYS[1]) end
return value
"""

# KEYS: blob, lru zset, size hash, used counter.
_DROP: Final = """
local size = redis.call('HGET', KEYS[3], KEYS[1])
if not size then return 0 end
redis.call('DECRBY', KEYS[4], size)
redis.call('HDEL', KEYS[3], KEYS[1]); redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('DEL', KEYS[1])
return 1
"""


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The remote tier's budget and policy (the tier exists only when the daemon enables it)."""

    budget_bytes: int = 1 << 30
    compression: Literal["off", "auto"] = "auto"    # auto: lz4 where it makes the block smaller
    bandwidth_alpha: float = 0.2                    # EWMA weight of the newest fetch sample
    fetch_margin: float = 1.0       # fetch only if predicted time * margin < recompute time

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix for an inconsistent value."""
        if self.budget_bytes <= _HEADER.size:
            raise ValueError(f"remote budget_bytes must exceed {_HEADER.size}, "
                             f"got {self.budget_bytes}")
        if self.compression not in ("off", "auto"):
            raise ValueError(f"remote compression must be 'off' or 'auto', "
                             f"got {self.compression!r}")
        if not 0 < self.bandwidth_alpha <= 1 or self.fetch_margin <= 0:
            raise ValueError("need 0 < bandwidth_alpha <= 1 and fetch_margin > 0")


@dataclass(slots=True)
class RemoteStats:
    """Counters a daemon exports as metrics."""

    puts: int = 0
    compressed_puts: int = 0
    put_failures: int = 0           # bad checksum, over budget, or Redis failed
    evictions: int = 0
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0      # fetched blocks that did not verify (deleted, missed)
    fetch_decisions: int = 0        # should_fetch said yes
    skip_decisions: int = 0         # should_fetch said recompute
    bandwidth_bps: float = 0.0      # EWMA of fetch throughput; 0 = no sample yet


class RemoteTier:
    """Blocks shared by every node through Redis. Uses the directory's connection and its
    stale handling: a down Redis makes every call a fast miss. One event loop only."""

    def __init__(self, directory: Directory, config: RemoteConfig, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        config.validate()
        self.directory = directory
        self.config = config
        self._clock = clock
        prefix = directory.config.key_prefix.encode() + b"r:"
        self._prefix = prefix
        self._lru, self._sizes = prefix + b"lru", prefix + b"size"
        self._used, self._tick = prefix + b"used", prefix + b"tick"
        redis = directory.redis
        self._put = redis.register_script(_PUT)
        self._get = redis.register_script(_GET)
        self._drop = redis.register_script(_DROP)
        self._deciding_fetch: bool | None = None
        self.stats = RemoteStats()

    def _key(self, namespace: Namespace, block_hash: BlockHash) -> bytes:
        return self._prefix + b"k:" + make_key(namespace, block_hash)

    def encode(self, payload: bytes | memoryview, checksum: int) -> bytes:
        """The stored form of a block: header + payload, lz4 when that is smaller."""
        flags, body = 0, bytes(payload)
        if self.config.compression == "auto":
            packed = lz4.block.compress(payload, store_size=False)
            if len(packed) < len(body):
                flags, body = _LZ4, packed
        return _HEADER.pack(_MAGIC, flags, checksum, len(payload)) + body

    async def put(self, namespace: Namespace, block_hash: BlockHash,
                  payload: bytes | memoryview, checksum: int) -> bool:
        """Store one block (replacing any copy), evicting LRU blocks to stay in budget. One
        round trip. False if ``checksum`` does not match the payload, the block alone exceeds
        the budget, or Redis failed. Blocks only for the lz4 attempt and the round trip."""
        if block_checksum(payload) != checksum:
            self.stats.put_failures += 1
            _log.warning("remote tier: refusing a block whose checksum does not match")
            return False
        value = self.encode(payload, checksum)
        keys = [self._key(namespace, block_hash), self._lru, self._sizes, self._used, self._tick]
        evicted = await self.directory.guarded("remote put", lambda: self._put(
            keys=keys, args=[value, self.config.budget_bytes]))
        if evicted is None or int(evicted) < 0:
            self.stats.put_failures += 1
            return False
        self.stats.puts += 1
        self.stats.compressed_puts += value[4] == _LZ4
        self.stats.evictions += int(evicted)
        return True

    async def get_many(self, namespace: Namespace,
                       hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Fetch blocks in one round trip (a pipeline), each verified: a block that is absent,
        truncated or fails its checksum is None (and a bad one is deleted). Feeds the
        bandwidth measure with the bytes received over the elapsed time."""
        if not hashes:
            return []
        keys = [self._key(namespace, h) for h in hashes]

        async def fetch() -> list[bytes | None]:
            async with self.directory.redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    await self._get(keys=[key, self._lru, self._tick], client=pipe)
                return list(await pipe.execute())

        start = self._clock()
        values = await self.directory.guarded("remote get", fetch)
        if values is None:
            self.stats.misses += len(hashes)
            return [None] * len(hashes)
        received = sum(len(v) for v in values if v is not None)
        if received:
            self.record_fetch(received, self._clock() - start)
        blocks = [self._decode(v) for v in values]
        for key, value, block in zip(keys, values, blocks):
            if value is not None and block is None:
                await self.directory.guarded("remote drop", lambda k=key: self._drop(  # type: ignore[misc]
                    keys=[k, self._lru, self._sizes, self._used]))
        self.stats.hits += sum(b is not None for b in blocks)
        self.stats.misses += sum(b is None for b in blocks)
        return blocks

    async def get(self, namespace: Namespace, block_hash: BlockHash) -> bytes | None:
        """Fetch and verify one block; None is a miss (see ``get_many``)."""
        return (await self.get_many(namespace, [block_hash]))[0]

    async def get_into(self, namespace: Namespace, block_hash: BlockHash,
                       into: memoryview) -> bool:
        """Fetch one block into ``into`` (e.g. a DRAM arena slot). True only if it was found,
        verified and has exactly ``len(into)`` bytes; ``into`` is untouched otherwise."""
        block = await self.get(namespace, block_hash)
        if block is None or len(block) != len(into):
            return False
        into[:] = block
        return True

    def _decode(self, value: bytes | None) -> bytes | None:
        if value is None or len(value) < _HEADER.size:
            return None
        magic, flags, checksum, length = _HEADER.unpack_from(value)
        body = value[_HEADER.size:]
        if magic != _MAGIC or flags not in (0, _LZ4):
            self.stats.checksum_failures += 1
            return None
        if flags == _LZ4:
            try:
                body = lz4.block.decompress(body, uncompressed_size=length)
            except lz4.block.LZ4BlockError:
                body = b""
        if len(body) != length or block_checksum(body) != checksum:
            self.stats.checksum_failures += 1
            _log.warning("remote tier: a fetched block failed its checksum; dropped (a miss)")
            return None
        return body

    def record_fetch(self, nbytes: int, seconds: float) -> None:
        """Add one measured fetch to the bandwidth EWMA (called by ``get_many``; callers that
        time a whole fetch-and-copy may add their own)."""
        if nbytes <= 0 or seconds <= 0:
            return
        sample = nbytes / seconds
        old = self.stats.bandwidth_bps
        alpha = self.config.bandwidth_alpha
        self.stats.bandwidth_bps = sample if old == 0 else alpha * sample + (1 - alpha) * old

    def should_fetch(self, nbytes: int, recompute_seconds: float) -> bool:
        """Whether fetching ``nbytes`` from the remote tier is predicted to beat recomputing
        them in ``recompute_seconds``. With no measurement yet it says yes (to get one).
        Counts every decision and logs when the answer changes. No I/O."""
        bandwidth = self.stats.bandwidth_bps
        predicted = 0.0 if bandwidth == 0 else nbytes / bandwidth
        fetch = predicted * self.config.fetch_margin < recompute_seconds
        if fetch:
            self.stats.fetch_decisions += 1
        else:
            self.stats.skip_decisions += 1
        _log.debug("remote tier: %s %d bytes (fetch ~%.2f ms at %.0f MB/s, recompute %.2f ms)",
                   "fetch" if fetch else "skip", nbytes, predicted * 1e3, bandwidth / 1e6,
                   recompute_seconds * 1e3)
        if fetch != self._deciding_fetch:
            self._deciding_fetch = fetch
            _log.info("remote tier: now %s (%.0f MB/s measured; %d bytes predicted %.2f ms vs "
                      "recompute %.2f ms)", "fetching" if fetch else "recomputing instead",
                      bandwidth / 1e6, nbytes, predicted * 1e3, recompute_seconds * 1e3)
        return fetch

    async def used_bytes(self) -> int | None:
        """Stored bytes counted against the budget; None if Redis failed."""
        async def used() -> int:
            return int(await self.directory.redis.get(self._used) or 0)
        return await self.directory.guarded("remote used", used)

    async def check_integrity(self) -> None:
        """The byte counter equals the sum of the sizes, which equals the stored values'
        lengths; the LRU and the size table name the same blocks; the budget holds. Reads the
        whole remote tier: for tests and `tierd` diagnostics, not the request path."""
        redis = self.directory.redis
        sizes = {k: int(v) for k, v in (await redis.hgetall(self._sizes)).items()}
        members = set(await redis.zrange(self._lru, 0, -1))
        used = int(await redis.get(self._used) or 0)
        assert members == set(sizes), "the LRU and the size table disagree on the blocks held"
        assert used == sum(sizes.values()), f"used counter {used} != sum of sizes"
        assert used <= self.config.budget_bytes, f"remote tier over budget: {used}"
        for key, size in sizes.items():
            assert await redis.strlen(key) == size, f"stored size of {key!r} is wrong"
