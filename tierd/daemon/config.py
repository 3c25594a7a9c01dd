"""`tierd serve`'s one configuration object, and the only place ``TIERD_*`` variables are read.

Sources, weakest first: the field defaults (they run on a laptop: DRAM 1 GiB, SSD under the
user's cache dir bounded at 8 GiB, Unix socket only, no Redis), a TOML file (``--config`` or
``TIERD_CONFIG``), ``TIERD_<KEY>`` environment variables, then command-line flags. Every key has
the same name in all three (``dram_bytes`` = ``TIERD_DRAM_BYTES`` = ``--dram-bytes``). Byte sizes
accept an int or a string with a unit ("512MiB", "8GiB", "1.5GB").
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from tierd.daemon.engine_access import group_id
from tierd.daemon.node_types import EngineCaps, NodeConfig
from tierd.daemon.quotas import TenantQuotas
from tierd.paths import cache_dir, client_socket_path, default_socket_path
from tierd.wire.presence import check_cells

__all__ = ["TierdConfig", "cache_dir", "client_socket_path", "default_socket_path", "field_help",
           "keys", "load_config", "parse_bytes"]

Compression = Literal["off", "lz4", "auto"]

_MIB = 1 << 20
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class TierdConfig:
    """Everything `tierd serve` needs. Field docs are also the ``--help`` text of each flag."""

    socket_path: str = dataclasses.field(default_factory=default_socket_path,
                                         metadata={"help": "Unix socket to listen on ('' = none)."})
    lane: bool = dataclasses.field(default=True, metadata={
        "help": "Also take the engines' calls on the lane, a framed Unix socket beside "
                "socket_path (SOCKET.lane): the same calls and checks at a fraction of gRPC's "
                "cost per call."})
    tcp_port: int | None = dataclasses.field(default=None, metadata={
        "help": "Also listen on TCP at this port (bearer token required; 0 = any free port)."})
    tcp_host: str = dataclasses.field(default="127.0.0.1", metadata={
        "help": "TCP address; must be loopback unless --allow-remote."})
    allow_remote: bool = dataclasses.field(default=False, metadata={
        "help": "Allow a non-loopback --tcp-host (tokens then travel unencrypted)."})
    token_file: str | None = dataclasses.field(default=None, metadata={
        "help": "TOML file of 'TOKEN = \"tenant\"' lines; TCP callers must send one."})
    tcp_token: str = dataclasses.field(default="", metadata={
        "help": "A bearer token of the default tenant, so TCP callers need no token file (set "
                "TIERD_TCP_TOKEN from a secret; a flag would show in ps)."})
    default_tenant: str = dataclasses.field(default="default", metadata={
        "help": "Tenant of Unix-socket callers that send no token."})
    engine_group: str = dataclasses.field(default="", metadata={
        "help": "Group (name or gid) whose members may use the daemon: its socket and arena get "
                "this group and mode 0660, for engines running as other users ('' = the "
                "daemon's user only)."})
    tenant_quotas: TenantQuotas = dataclasses.field(default_factory=TenantQuotas, metadata={
        "help": "DRAM and SSD each tenant is guaranteed, as an inline TOML table: "
                "'{ team-a = { dram = \"512MiB\", ssd = \"4GiB\" }, \"*\" = { dram = "
                "\"10%%\" } }' (\"*\": every tenant not named; none: plain LRU across "
                "tenants). See docs/daemon.md, Tenant quotas."})
    loop_share_wait_seconds: float = dataclasses.field(default=0.002, metadata={
        "help": "Longest a call of a tenant over its share of the daemon's event loop waits "
                "for the calls of tenants within theirs (0 = no waiting; see docs/daemon.md, "
                "Loop time)."})
    admin_token: str = dataclasses.field(default="", metadata={
        "help": "Bearer token whose Stats show every tenant's usage and quota; it serves no "
                "other call ('' = none). Prefer TIERD_ADMIN_TOKEN or the config file to this "
                "flag, which other users can read in the process list."})
    dram_bytes: int = dataclasses.field(default=1 * _GIB, metadata={
        "help": "Size of the shared-memory DRAM arena."})
    slab_bytes: int = dataclasses.field(default=64 * _MIB, metadata={
        "help": "Arena slab size; each slab holds slots of one block size (must hold a block)."})
    arena_directory: str = dataclasses.field(default="/dev/shm", metadata={
        "help": "Directory of the arena file (a tmpfs)."})
    prefault: bool = dataclasses.field(default=True, metadata={
        "help": "Touch every arena page at start-up so first use is not slow."})
    ssd_dir: str = dataclasses.field(default_factory=lambda: str(cache_dir() / "ssd"), metadata={
        "help": "SSD tier directory ('' = DRAM only)."})
    ssd_bytes: int = dataclasses.field(default=8 * _GIB, metadata={
        "help": "Bound of the SSD tier's files, compaction headroom included."})
    ssd_compression: Compression = dataclasses.field(default="off", metadata={
        "help": "SSD record compression: off, lz4 or auto (lz4 only where it shrinks)."})
    ssd_io_threads: int = dataclasses.field(default=32, metadata={
        "help": "Threads reading the SSD, each with reads of its own in flight (32: the "
                "queue depth of vLLM's fs tier; one more thread appends)."})
    lease_seconds: float = dataclasses.field(default=30.0, metadata={
        "help": "Lifetime of acquire leases and reservations."})
    dram_high_watermark: float = dataclasses.field(default=0.90, metadata={
        "help": "DRAM fill fraction above which the flusher demotes LRU blocks to SSD."})
    dram_low_watermark: float = dataclasses.field(default=0.75, metadata={
        "help": "DRAM fill fraction the flusher demotes down to."})
    ssd_min_hits: int = dataclasses.field(default=0, metadata={
        "help": "Hits a DRAM block needs to be demoted to SSD rather than dropped."})
    max_blocks_per_request: int = dataclasses.field(default=4096, metadata={
        "help": "Most hashes in one request (RESOURCE_EXHAUSTED above)."})
    blank_fraction: float = dataclasses.field(default=0.25, metadata={
        "help": "Most of the DRAM arena held in blank slots at once, all engines together "
                "(slots engines reserve ahead of their next store; 0 = none)."})
    max_leases_per_engine: int = dataclasses.field(default=1024, metadata={
        "help": "Most live leases (Acquire and Reserve) one engine may hold "
                "(RESOURCE_EXHAUSTED above)."})
    max_leases: int = dataclasses.field(default=16_384, metadata={
        "help": "Most live leases of all engines together (RESOURCE_EXHAUSTED above)."})
    max_lease_keys: int = dataclasses.field(default=1 << 18, metadata={
        "help": "Most blocks named by all live leases together, about 100 bytes of daemon "
                "memory each (RESOURCE_EXHAUSTED above; >= max_blocks_per_request)."})
    min_block_bytes: int = dataclasses.field(default=1024, metadata={
        "help": "Smallest block a layout may have (INVALID_ARGUMENT at RegisterEngine below)."})
    block_overhead_bytes: int = dataclasses.field(default=512, metadata={
        "help": "Daemon memory counted per DRAM block (its index entry) against dram_bytes: "
                "at most dram_bytes / (block bytes + this) blocks are held at once."})
    max_size_classes: int = dataclasses.field(default=64, metadata={
        "help": "Most distinct block sizes in use at once (registered engines' or held in "
                "DRAM; RESOURCE_EXHAUSTED at RegisterEngine above)."})
    max_message_bytes: int = dataclasses.field(default=16 * _MIB, metadata={
        "help": "Largest gRPC message accepted (RESOURCE_EXHAUSTED above)."})
    presence_cells: int = dataclasses.field(default=1 * _MIB, metadata={
        "help": "One-byte counters of the presence filter engines read to skip the round trip "
                "of a certain miss (a power of two from 1024 to 2**32; 0 = no filter). Not "
                "published with remote_tier (a local miss may still be fetched)."})
    maintain_seconds: float = dataclasses.field(default=1.0, metadata={
        "help": "Period of the background pass that expires leases and demotes."})
    write_behind_seconds: float = dataclasses.field(default=2.0, metadata={
        "help": "Committed DRAM blocks are written to SSD in the background within about this "
                "many seconds, so a kill -9 loses at most that window (0 = off: only demotion "
                "and a graceful stop write them)."})
    stop_flush_seconds: float = dataclasses.field(default=10.0, metadata={
        "help": "At a graceful stop (SIGTERM), time for writing DRAM-only blocks to SSD, most "
                "recently used first (0 = write none)."})
    engine_idle_seconds: float = dataclasses.field(default=600.0, metadata={
        "help": "An engine that makes no call for this long is unregistered (leases ended, HBM "
                "report dropped); it must register again."})
    max_engines_per_tenant: int = dataclasses.field(default=256, metadata={
        "help": "Most engines one tenant may have registered (RESOURCE_EXHAUSTED above)."})
    max_name_bytes: int = dataclasses.field(default=256, metadata={
        "help": "Longest engine_name accepted, in UTF-8 bytes (INVALID_ARGUMENT above)."})
    max_models: int = dataclasses.field(default=1024, metadata={
        "help": "Most namespaces (tenant and model) kept in models.json for per-model stats; "
                "more only while that many have an engine registered."})
    metrics_port: int | None = dataclasses.field(default=None, metadata={
        "help": "Serve Prometheus metrics at this port (0 = any free port)."})
    metrics_host: str = dataclasses.field(default="127.0.0.1", metadata={
        "help": "Address of the metrics server (0.0.0.0 in a pod, so Prometheus can scrape)."})
    redis_url: str = dataclasses.field(default="", metadata={
        "help": "Redis of the cluster directory, e.g. redis://redis:6379/0 ('' = no cluster)."})
    node_id: str = dataclasses.field(default_factory=socket.gethostname, metadata={
        "help": "This node's name in the cluster directory (default: the host name)."})
    node_address: str = dataclasses.field(default="", metadata={
        "help": "Where routers reach this daemon, as published ('' = tcp HOST:PORT if "
                "listening on TCP, else unix:SOCKET_PATH)."})
    cluster_heartbeat_seconds: float = dataclasses.field(default=5.0, metadata={
        "help": "Period of the node's heartbeat in the directory."})
    cluster_node_ttl_seconds: float = dataclasses.field(default=15.0, metadata={
        "help": "A node silent this long is dead for Locate (> heartbeat)."})
    cluster_block_ttl_seconds: float = dataclasses.field(default=600.0, metadata={
        "help": "Lifetime of a published block entry; refreshed every third of it while held."})
    remote_tier: bool = dataclasses.field(default=False, metadata={
        "help": "Share blocks evicted from this node through Redis and fetch remote hits "
                "(needs redis_url)."})
    remote_tier_bytes: int = dataclasses.field(default=1 * _GIB, metadata={
        "help": "Byte budget of the shared remote tier in Redis (LRU beyond it)."})
    remote_queue_bytes: int = dataclasses.field(default=64 * _MIB, metadata={
        "help": "Bound of evicted blocks waiting for the maintain pass to put them remote "
                "(past it, evicted blocks are not shared)."})
    recompute_tokens_per_second: float = dataclasses.field(default=10_000.0, metadata={
        "help": "Prefill speed of the engines, to judge a remote fetch against recomputing "
                "(a 7-8B model on one H100 prefills ~10-20k tokens/s)."})
    insight_hooks: bool = dataclasses.field(default=True, metadata={
        "help": "Queue each lookup and acquire for the what-if curves, the savings counters and "
                "the per-model hit ratios (tierd stats); --no-insight-hooks keeps none of "
                "them (tierd why still answers)."})
    log_level: str = dataclasses.field(default="INFO", metadata={
        "help": "Logging level: DEBUG, INFO, WARNING, ERROR."})

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix for any inconsistent value."""
        if not self.socket_path and self.tcp_port is None:
            raise ValueError("nothing to listen on: set socket_path or tcp_port")
        if self.tcp_port is not None and not 0 <= self.tcp_port < 65536:
            raise ValueError(f"tcp_port must be in [0, 65536), got {self.tcp_port}")
        if self.tcp_port is not None and not self.allow_remote and not _is_loopback(self.tcp_host):
            raise ValueError(f"tcp_host {self.tcp_host!r} is not loopback: use 127.0.0.1, or pass "
                             "--allow-remote to listen on it knowingly")
        if self.tcp_port is not None and self.token_file is None and not self.tcp_token:
            raise ValueError("TCP needs bearer tokens: set tcp_token (TIERD_TCP_TOKEN) or "
                             "token_file (--token-file)")
        if self.dram_bytes <= 0 or self.slab_bytes <= 0 or self.slab_bytes > self.dram_bytes:
            raise ValueError(f"need 0 < slab_bytes ({self.slab_bytes}) <= dram_bytes "
                             f"({self.dram_bytes})")
        if self.ssd_dir and self.ssd_bytes <= 0:
            raise ValueError(f"ssd_bytes must be positive, got {self.ssd_bytes} (or ssd_dir='')")
        if self.ssd_compression not in get_args(Compression):
            raise ValueError(f"ssd_compression must be one of {get_args(Compression)}")
        for name in ("maintain_seconds", "max_message_bytes", "ssd_io_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_overhead_bytes < 0:
            raise ValueError(f"block_overhead_bytes must be >= 0, got {self.block_overhead_bytes}")
        if not 0 <= self.loop_share_wait_seconds <= 1:
            raise ValueError("loop_share_wait_seconds must be in [0, 1], got "
                             f"{self.loop_share_wait_seconds}")
        self.node_config().validate()  # watermarks, lease, write-behind, engine caps
        if not self.default_tenant:
            raise ValueError("default_tenant must not be empty")
        if self.engine_group:
            group_id(self.engine_group)
        if self.presence_cells:
            try:
                check_cells(self.presence_cells)
            except ValueError:
                raise ValueError(f"presence_cells={self.presence_cells} must be a power of two "
                                 "from 1024 to 2**32 (e.g. 1048576), or 0 for no filter") from None
        self._validate_cluster()

    def _validate_cluster(self) -> None:
        if self.remote_tier and not self.redis_url:
            raise ValueError("remote_tier needs the cluster: set redis_url (--redis-url)")
        if not self.redis_url:
            return
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url {self.redis_url!r} must start with redis://, rediss:// "
                             "or unix:// (e.g. redis://redis:6379/0)")
        if not self.node_id:
            raise ValueError("node_id must not be empty with redis_url set (use the host name)")
        if self.node_address and not _has_port(self.node_address) and self.tcp_port is None:
            raise ValueError(f"node_address {self.node_address!r} has no port and the daemon "
                             "listens on no TCP port, so routers could not dial it: set tcp_port "
                             "(with tcp_token; in a pod tcp_host 0.0.0.0 and allow_remote), "
                             "write node_address as HOST:PORT, or leave it empty")
        if not self.node_address and self.tcp_port is not None and _is_wildcard(self.tcp_host):
            raise ValueError(f"tcp_host {self.tcp_host!r} listens on every address, none of "
                             "which routers could be told: set node_address to this node's "
                             "address (in a pod, TIERD_NODE_ADDRESS from status.podIP)")
        if not 0 < self.cluster_heartbeat_seconds < self.cluster_node_ttl_seconds:
            raise ValueError("need 0 < cluster_heartbeat_seconds < cluster_node_ttl_seconds, "
                             f"got {self.cluster_heartbeat_seconds} and "
                             f"{self.cluster_node_ttl_seconds}")
        for name in ("cluster_block_ttl_seconds", "remote_tier_bytes", "remote_queue_bytes",
                     "recompute_tokens_per_second"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def node_config(self) -> NodeConfig:
        """The node store's settings: each ``NodeConfig`` key this config has, by name."""
        shared = {f.name: getattr(self, f.name) for f in fields(NodeConfig) if f.name in keys()}
        return NodeConfig(**shared, event_log_events=0,  # nobody takes them: listeners see all
                          engines=EngineCaps(self.engine_idle_seconds,
                                             self.max_engines_per_tenant, self.max_name_bytes))

    def published_address(self, tcp_port: int | None) -> str:
        """Where routers dial this daemon (``tcp_port``: the bound port): ``node_address``, with
        that port added when it names a host only; else ``tcp_host:port``; else the socket."""
        if self.node_address:
            if tcp_port is not None and not _has_port(self.node_address):
                return f"{_bracket(self.node_address)}:{tcp_port}"
            return self.node_address
        if tcp_port is not None:
            return f"{_bracket(self.tcp_host)}:{tcp_port}"
        return f"unix:{self.socket_path}"


def _has_port(address: str) -> bool:
    """Whether ``address`` says where to connect in full: ``host:port``, ``[v6]:port`` or
    ``unix:PATH`` (not a bare host name, IPv4 or IPv6 address)."""
    if address.startswith(("unix:", "[")):
        return address.startswith("unix:") or "]:" in address
    return address.count(":") == 1


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_bytes(value: str | int) -> int:
    """``"8GiB"`` -> 8589934592; ``"1.5GB"`` -> 1500000000; ints pass through."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if match is None:
        raise ValueError(f"not a byte size: {value!r} (write e.g. 1073741824, '512MiB', '8GiB')")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


_BYTE_KEYS = {"dram_bytes", "slab_bytes", "ssd_bytes", "max_message_bytes", "remote_tier_bytes",
              "remote_queue_bytes", "min_block_bytes", "block_overhead_bytes"}


def _coerce(name: str, raw: Any) -> Any:
    """Convert a TOML/env/flag value to the field's type, ``ValueError`` naming the key."""
    kind = {f.name: f.type for f in fields(TierdConfig)}[name]
    try:
        if name == "tenant_quotas":
            return TenantQuotas.parse(raw)
        if name in _BYTE_KEYS:
            return parse_bytes(raw)
        if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none") and
                           "None" in str(kind)):
            return None
        if "bool" in str(kind):
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if "int" in str(kind):
            return int(raw)
        if "float" in str(kind):
            return float(raw)
        return str(raw)
    except ValueError as exc:
        raise ValueError(f"config key {name}: {exc}") from None


def keys() -> list[str]:
    """Every config key, in declaration order."""
    return [f.name for f in fields(TierdConfig)]


def field_help(name: str) -> str:
    """The documentation of one key (the ``--help`` text of its flag)."""
    return str({f.name: f.metadata.get("help", "") for f in fields(TierdConfig)}[name])


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> TierdConfig:
    """Build and validate a ``TierdConfig``: defaults < TOML file < ``TIERD_*`` env < overrides.

    ``path`` defaults to ``$TIERD_CONFIG`` (no file if unset); ``env`` defaults to ``os.environ``;
    ``overrides`` are flag values (``None`` entries mean "flag not given"). Unknown TOML keys
    raise ``ValueError`` naming them, so a typo in the file is never silently ignored.
    """
    env = os.environ if env is None else env
    known = set(keys())
    values: dict[str, Any] = {"socket_path": default_socket_path(env),
                              "ssd_dir": str(cache_dir(env) / "ssd")}
    path = path if path is not None else env.get("TIERD_CONFIG")
    if path:
        with open(path, "rb") as f:
            table = tomllib.load(f)
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"{path}: unknown config keys {unknown}; known: {sorted(known)}")
        values.update({k: _coerce(k, v) for k, v in table.items()})
    for var, raw in env.items():
        if not var.startswith("TIERD_") or var == "TIERD_CONFIG":
            continue
        key = var.removeprefix("TIERD_").lower()
        if key not in known:  # other tierd components read their own TIERD_* variables
            continue
        values[key] = _coerce(key, raw)
    for key, raw in (overrides or {}).items():
        if raw is not None:
            values[key] = _coerce(key, raw)
    config = TierdConfig(**values)
    config.validate()
    return config
