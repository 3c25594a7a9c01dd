"""The cluster directory: which node holds which namespaced block, in which tier, kept in Redis.

Data model (all under ``config.key_prefix``, default ``tierd:``; see ``docs/cluster.md``):

- ``<prefix>b:<namespace||hash>`` (binary key) -> HASH ``{node_id: "<tier code><expiry ms>"}``,
  tier codes ``h`` ``d`` ``s`` ``r``. Each field expires on its own (the expiry is in the value,
  Redis server time); the key's PTTL is raised to the longest field's so Redis frees it after the
  last holder stops refreshing. Publishing a key also drops its expired fields.
- ``<prefix>nodes`` -> HASH ``{node_id: JSON NodeRecord (address, capacity_bytes)}``.
- ``<prefix>hb`` -> HASH ``{node_id: last heartbeat, server ms}``. A node whose heartbeat is older
  than ``node_ttl_s`` is dead for ``locate`` at once, whatever its block entries say.

Every operation is one Redis round trip: publish, unpublish, heartbeat and locate are Lua scripts
(EVALSHA, loaded again automatically after a Redis restart). Only a single Redis (with replicas)
is supported: the scripts touch computed keys, which Redis Cluster would reject.

Failure behaviour: no method raises on a Redis failure. A failed or slow call (over
``timeout_s``) marks the directory ``stale`` and returns the empty outcome (``[]``, ``False``,
``None``); while stale, calls return at once without touching Redis except one probe per
backoff interval (``backoff_min_s`` doubling to ``backoff_max_s``). ``outages`` counts the
healthy->stale transitions so a publisher can tell that it must re-publish what it holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from tierd.types import TIERS, BlockHash, Namespace, NamespacedKey, Placement, Tier, make_key

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

TIER_CODES: Final[dict[Tier, bytes]] = {"hbm": b"h", "dram": b"d", "ssd": b"s", "remote": b"r"}
_CODE_TIERS: Final[dict[int, Tier]] = {code[0]: tier for tier, code in TIER_CODES.items()}
DEFAULT_WEIGHTS: Final[dict[Tier, float]] = {"hbm": 1.0, "dram": 0.8, "ssd": 0.6, "remote": 0.4}
"""Score of one prefix block by the tier it is held in (llm-d: GPU 1.0, CPU 0.8)."""


@dataclass(frozen=True, slots=True)
class DirectoryConfig:
    """How to reach Redis and how long entries live."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tierd:"
    timeout_s: float = 0.5          # a Redis call slower than this counts as a failure
    block_ttl_s: float = 600.0      # a block entry not re-published within this is gone
    node_ttl_s: float = 15.0        # a node without a heartbeat within this is dead for locate
    backoff_min_s: float = 0.1      # first retry delay after a failure, doubled per failure
    backoff_max_s: float = 10.0
    weights: tuple[tuple[Tier, float], ...] = tuple(DEFAULT_WEIGHTS.items())

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix for an inconsistent value."""
        for name in ("timeout_s", "block_ttl_s", "node_ttl_s", "backoff_min_s", "backoff_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cluster {name} must be positive, got {getattr(self, name)}")
        if self.backoff_min_s > self.backoff_max_s:
            raise ValueError("cluster backoff_min_s must not exceed backoff_max_s")
        if set(dict(self.weights)) != set(TIERS):
            raise ValueError(f"cluster weights need exactly the tiers {TIERS}")


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node tells the cluster about itself (the heartbeat is kept beside it)."""

    node_id: str
    address: str            # where engines or routers reach its daemon, e.g. "10.0.0.7:50051"
    capacity_bytes: int = 0

    def to_json(self) -> bytes:
        return json.dumps({"address": self.address, "capacity_bytes": self.capacity_bytes},
                          sort_keys=True).encode()


# KEYS: block keys. ARGV: node id, ttl ms, one tier code per key.
_PUBLISH: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local node, ttl, codes = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local expiry = string.format('%d', now + ttl)
for i, key in ipairs(KEYS) do
  if redis.call('HLEN', key) > 0 then
    local all = redis.call('HGETALL', key)
    for j = 1, #all, 2 do
      if all[j] ~= node and tonumber(string.sub(all[j + 1], 2)) <= now then
        redis.call('HDEL', key, all[j])
      end
    end
  end
  redis.call('HSET', key, node, string.sub(codes, i, i) .. expiry)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return #KEYS
"""

# KEYS: block keys. ARGV: node id.
_UNPUBLISH: Final = """
for _, key in ipairs(KEYS) do redis.call('HDEL', key, ARGV[1]) end
return #KEYS
"""

# KEYS: nodes hash, heartbeat hash. ARGV: node id, record JSON, prune-after ms.
# Returns 1 if the node's heartbeat was there (Redis kept our state), 0 if it was missing.
_HEARTBEAT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local existed = redis.call('HEXISTS', KEYS[2], ARGV[1])
local prune = tonumber(ARGV[3])
local beats = redis.call('HGETALL', KEYS[2])
for i = 1, #beats, 2 do
  if now - tonumber(beats[i + 1]) > prune then
    redis.call('HDEL', KEYS[2], beats[i]); redis.call('HDEL', KEYS[1], beats[i])
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], string.format('%d', now))
return existed
"""

# KEYS: nodes hash, heartbeat hash, then the chain's block keys in order. ARGV: node ttl ms.
# Returns {now, node, tier codes, record JSON, heartbeat ms, node, ...} for every live node
# holding the chain's first block; the tier string's length is its consecutive prefix.
_LOCATE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {string.format('%d', now)}
if #KEYS < 3 then return out end
local first = redis.call('HGETALL', KEYS[3])
local candidates, tiers = {}, {}
for i = 1, #first, 2 do
  local v = first[i + 1]
  if tonumber(string.sub(v, 2)) > now then
    candidates[#candidates + 1] = first[i]
    tiers[first[i]] = {string.sub(v, 1, 1)}
  end
end
if #candidates == 0 then return out end
local beats = redis.call('HMGET', KEYS[2], unpack(candidates))
local records = redis.call('HMGET', KEYS[1], unpack(candidates))
local alive, info = {}, {}
for j, node in ipairs(candidates) do
  if beats[j] and records[j] and now - tonumber(beats[j]) <= tonumber(ARGV[1]) then
    alive[#alive + 1] = node
    info[node] = {records[j], beats[j]}
  end
end
local holders = alive
for k = 4, #KEYS do
  if #alive == 0 then break end
  local vals = redis.call('HMGET', KEYS[k], unpack(alive))
  local still = {}
  for j, node in ipairs(alive) do
    local v = vals[j]
    if v and tonumber(string.sub(v, 2)) > now then
      still[#still + 1] = node
      local ts = tiers[node]
      ts[#ts + 1] = string.sub(v, 1, 1)
    end
  end
  alive = still
end
for _, node in ipairs(holders) do
  out[#out + 1] = node
  out[#out + 1] = table.concat(tiers[node])
  out[#out + 1] = info[node][1]
  out[#out + 1] = info[node][2]
end
return out
"""


@dataclass(slots=True)
class _Health:
    """Stale-state bookkeeping: whether the last call failed and when to probe again."""

    stale: bool = False
    outages: int = 0
    failures: int = 0
    delay_s: float = 0.0
    next_probe: float = 0.0
    last_error: str = ""


@dataclass(slots=True)
class DirectoryStats:
    """Counters a daemon exports as metrics."""

    published_blocks: int = 0
    unpublished_blocks: int = 0
    locates: int = 0
    skipped_stale: int = 0          # calls answered empty without touching Redis (stale)
    failures: int = 0               # Redis calls that failed or timed out
    outages: int = 0


class Directory:
    """A Redis client for the cluster directory. Safe to share between tasks of one event loop.

    Blocking: every coroutine does at most one Redis round trip, bounded by ``timeout_s``; none
    raises for a Redis failure (see the module docstring). ``ValueError`` only for bad input.
    """

    def __init__(self, config: DirectoryConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Connect lazily to ``config.redis_url`` (no I/O here). ``clock`` paces the backoff."""
        config.validate()
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.config = config
        self._clock = clock
        self._redis: Any = Redis.from_url(
            config.redis_url, socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s, retry=Retry(NoBackoff(), 0))
        self._weights = dict(config.weights)
        prefix = config.key_prefix.encode()
        self._block_prefix = prefix + b"b:"
        self._nodes_key = prefix + b"nodes"
        self._beats_key = prefix + b"hb"
        self._publish = self._redis.register_script(_PUBLISH)
        self._unpublish = self._redis.register_script(_UNPUBLISH)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._locate = self._redis.register_script(_LOCATE)
        self._health = _Health(delay_s=config.backoff_min_s)
        self.stats = DirectoryStats()

    @property
    def stale(self) -> bool:
        """True since a Redis call failed, until one succeeds again."""
        return self._health.stale

    @property
    def outages(self) -> int:
        """How many times the directory went from healthy to stale (a publisher re-publishes
        everything it holds after each)."""
        return self._health.outages

    @property
    def last_error(self) -> str:
        """The last Redis failure, e.g. ``"probe: ConnectionError: ..."`` ('' if none)."""
        return self._health.last_error

    def block_key(self, key: NamespacedKey) -> bytes:
        """The Redis key of one namespaced block."""
        return self._block_prefix + key

    async def publish(self, node_id: str, entries: Sequence[tuple[NamespacedKey, Tier]]) -> bool:
        """Record that ``node_id`` holds each key in the given tier (overwriting its previous
        tier), valid for ``block_ttl_s``. One round trip for the whole batch. False on failure."""
        if not entries:
            return True
        keys = [self.block_key(k) for k, _ in entries]
        codes = b"".join(TIER_CODES[tier] for _, tier in entries)
        ttl_ms = int(self.config.block_ttl_s * 1000)
        done = await self.guarded("publish", lambda: self._publish(
            keys=keys, args=[node_id, ttl_ms, codes]))
        if done is None:
            return False
        self.stats.published_blocks += len(entries)
        return True

    async def unpublish(self, node_id: str, keys: Sequence[NamespacedKey]) -> bool:
        """Forget that ``node_id`` holds these keys. One round trip. False on failure (the
        entries then expire with their TTL)."""
        if not keys:
            return True
        redis_keys = [self.block_key(k) for k in keys]
        done = await self.guarded("unpublish", lambda: self._unpublish(
            keys=redis_keys, args=[node_id]))
        if done is None:
            return False
        self.stats.unpublished_blocks += len(keys)
        return True

    async def heartbeat(self, record: NodeRecord) -> bool | None:
        """Write the node record and its heartbeat (server time); prune nodes silent for 10
        node TTLs. Returns True if Redis still had this node's heartbeat, False if it did not
        (Redis restarted or was flushed: re-publish everything), None on failure."""
        prune_ms = int(self.config.node_ttl_s * 10_000)
        existed = await self.guarded("heartbeat", lambda: self._heartbeat(
            keys=[self._nodes_key, self._beats_key],
            args=[record.node_id, record.to_json(), prune_ms]))
        return None if existed is None else bool(existed)

    async def remove_node(self, node_id: str) -> bool:
        """Withdraw a node at shutdown: locate ignores it at once; its block entries expire."""
        async def remove() -> object:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hdel(self._nodes_key, node_id).hdel(self._beats_key, node_id)
                return await pipe.execute()
        return await self.guarded("remove_node", remove) is not None

    async def locate(self, namespace: Namespace, hashes: Sequence[BlockHash]) -> list[Placement]:
        """Rank the live nodes holding a prefix of the chain ``hashes`` (in chain order) by score
        (sum of tier weights over their longest consecutive prefix), best first; ties by longer
        prefix, then node id. One Redis round trip. ``[]`` when nobody holds the first block,
        and also when Redis fails or the directory is stale (check ``stale``)."""
        self.stats.locates += 1
        if not hashes:
            return []
        keys = [self._nodes_key, self._beats_key]
        keys += [self.block_key(make_key(namespace, h)) for h in hashes]
        node_ttl_ms = int(self.config.node_ttl_s * 1000)
        reply = await self.guarded("locate", lambda: self._locate(keys=keys, args=[node_ttl_ms]))
        if reply is None:
            return []
        return self._rank(reply)

    def _rank(self, reply: list[bytes]) -> list[Placement]:
        now_ms = int(reply[0])
        placements = []
        for i in range(1, len(reply), 4):
            node, codes, record, beat = reply[i:i + 4]
            tiers = tuple(_CODE_TIERS[c] for c in codes)
            fields = json.loads(record)
            placements.append(Placement(
                node_id=node.decode(), address=str(fields["address"]), prefix_blocks=len(tiers),
                tiers=tiers, score=round(sum(self._weights[t] for t in tiers), 6),
                capacity_bytes=int(fields["capacity_bytes"]),
                heartbeat_age_s=max(0, now_ms - int(beat)) / 1000))
        placements.sort(key=lambda p: (-p.score, -p.prefix_blocks, p.node_id))
        return placements

    async def probe(self) -> bool:
        """One PING, if the backoff allows one now (always when healthy). True if Redis
        answered; clears ``stale``."""
        return await self.guarded("probe", lambda: self._redis.ping()) is not None

    async def close(self) -> None:
        """Close the connection pool. Never raises for Redis."""
        from redis.exceptions import RedisError

        try:
            await self._redis.aclose()
        except (RedisError, OSError) as exc:
            _log.debug("cluster directory: closing the Redis client: %s", exc)

    @property
    def redis(self) -> Any:
        """The redis-py asyncio client (shared by the remote tier). Call it through
        ``guarded`` so failures mark the directory stale instead of raising."""
        return self._redis

    async def guarded(self, what: str, op: Callable[[], Awaitable[_T]]) -> _T | None:
        """Run one Redis operation under the timeout; the single place failures are caught.
        Returns the operation's result, or None if it failed, timed out or was skipped.

        While stale, only one call per backoff interval reaches Redis (as a probe); the rest
        return None at once so a down Redis never slows the daemon's request path."""
        from redis.exceptions import RedisError

        health = self._health
        now = self._clock()
        if health.stale and now < health.next_probe:
            self.stats.skipped_stale += 1
            return None
        try:
            result = await asyncio.wait_for(op(), self.config.timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed(what, exc)
            return None
        if health.stale:
            _log.info("cluster directory: Redis is back after %d failed calls", health.failures)
        health.stale, health.failures, health.delay_s = False, 0, self.config.backoff_min_s
        return result

    def _failed(self, what: str, exc: BaseException) -> None:
        health = self._health
        self.stats.failures += 1
        health.failures += 1
        health.last_error = f"{what}: {type(exc).__name__}: {exc}"
        if not health.stale:
            health.stale = True
            health.outages += 1
            self.stats.outages += 1
            _log.warning("cluster directory stale (%s); serving locally, retrying with backoff",
                         health.last_error)
        else:
            health.delay_s = min(health.delay_s * 2, self.config.backoff_max_s)
        health.next_probe = self._clock() + health.delay_s

    def check_integrity(self) -> None:
        """Local invariants of the stale bookkeeping (there is no local index to check)."""
        health = self._health
        assert health.stale or health.failures == 0, "a healthy directory counts no failures"
        assert self.config.backoff_min_s <= health.delay_s <= self.config.backoff_max_s, (
            "the backoff delay left its [min, max] range")
        assert health.outages == self.stats.outages, "outage counters disagree"

