"""``TierdHiCacheStorage``: tierd as SGLang HiCache's L3 storage backend (docs/sglang.md).

SGLang builds it as ``cls(storage_config, kwargs)`` when launched with
``--hicache-storage-backend dynamic`` and an extra config naming this class, registers its host
pool (``register_mem_pool_host``), then calls it from three background threads (prefetch
query, prefetch I/O, backup), up to 128 pages a call:

- ``batch_exists`` -> one Lookup: how many leading pages tierd holds (DRAM or SSD).
- ``batch_get_v1`` -> one Acquire (SSD hits staged into DRAM, the prefix pinned), each slot
  verified as it is copied into its host page, one Release (naming the first page that failed
  its checksum, which the daemon re-checks and drops), queued on the runner: a copy counts
  if it ended before the lease's deadline (``core.load``).
- ``batch_set_v1`` -> one Reserve, the pages copied into their slots, one Commit (the daemon
  checksums them); pages tierd already holds, or another engine is writing, count as stored
  without a copy. The call returns once the copy is done (SGLang may then reuse the host
  pages) and the Commit is queued on the backend's ``core.runner.Runner``: the daemon
  checksums one batch while the next is copied. At most ``PENDING_COMMITS`` Commits are in
  flight; a Commit that fails leaves its pages unstored (later misses, recomputed), logged.
  This backend's own ``batch_exists`` and gets wait for its Commits in flight first, so an
  engine always finds what it stored.
- ``get``/``set``/``batch_get``/``batch_set``/``exists``: the same through SGLang's flat pages
  (without ``"interface_v1": 1``).

Every call answers; none raises for a daemon that is down, restarting or refusing: a miss
(0, False) and a warning, with the next attempt to reach it ``retry_seconds`` later
(``DaemonLink``). A lease taken is always given back (Release or Abort), on every path.
The daemon calls, the load and the save are the engine-side core's (``tierd.connector.core``:
``acquire`` + ``load_leased`` through the ``sinks`` of this package, ``reserve`` / ``commit`` /
``abort``), and so is the one classification of a failed call (``DaemonLink.failed``).
Thread-safety: the three threads share the link (thread-safe); each call keeps the ``Session``
it started with, whose arena mapping stays valid if another thread drops the link meanwhile (a
call on its closed channel then fails like any call: ``ChannelClosed``, a miss).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from tierd.connector.core.errors import describe
from tierd.connector.core.lease import Lease, Release, acquire, release
from tierd.connector.core.link import DaemonLink, Session
from tierd.connector.core.load import Sink, load_leased
from tierd.connector.core.runner import Runner
from tierd.connector.core.save import Reservation, abort, commit, reserve
from tierd.types import BlockHash

from .base import HiCacheStorage
from .config import TierdSglangConfig
from .identity import model_identity_from_sglang
from .pages import PageFormat, Shard, bytes_at, page_format
from .sinks import FlatPages, HostPages

_log = logging.getLogger(__name__)

SGLANG_VERSIONS_TESTED = ("0.5.23",)

PENDING_COMMITS = 1
"""Commits a backend leaves in flight when ``batch_set_v1`` returns: one overlaps the next
batch's copy; more would only queue behind the daemon's checksums."""
PENDING_RELEASES = 8
"""Releases a backend leaves in flight after a get (each a fraction of a millisecond)."""
RUNNER_THREADS = 2
"""Threads of a backend's runner: a Commit and a Release may run at once."""


class TierdHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on a tierd daemon. See the module docstring."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        """Parse tierd's keys of the extra config and derive the model id; ``ValueError``
        naming the fix for settings tierd cannot serve. Nothing is sent to the daemon yet."""
        sc = storage_config
        self.config = TierdSglangConfig.from_extra_config(sc.extra_config)
        if getattr(sc, "dcp_size", 1) > 1 or getattr(sc, "should_split_heads", False):
            raise ValueError("tierd does not support decode context parallel or split-head "
                             "(tp_lcm_size) HiCache storage; drop those settings")
        self.identity = model_identity_from_sglang(
            sc.model_name, model_id=self.config.link.model_id, model_path=self.config.model_path)
        self.shard = Shard(sc.tp_rank, sc.tp_size, sc.pp_rank, sc.pp_size,
                           getattr(sc, "attn_cp_rank", 0), getattr(sc, "attn_cp_size", 1))
        self.writer: bool = bool(getattr(sc, "is_storage_writer", True))
        self.format: PageFormat | None = None
        self._link: DaemonLink | None = None
        self._runner = Runner(RUNNER_THREADS, "tierd-hicache", ("release", "commit"))
        _log.info("tierd: model id %s (%s)", self.identity.model_id, self.identity.source)

    # --- registration ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool: its page format and the namespace (``ValueError`` naming
        the fix for a pool tierd cannot store), then try the daemon once."""
        super().register_mem_pool_host(mem_pool_host)
        self.format = page_format(mem_pool_host, self.shard, self.identity.model_id)
        s = self.shard
        name = f"{self.config.link.engine_name}-tp{s.tp_rank}" + (
            f"-pp{s.pp_rank}" if s.pp_size > 1 else "")
        self._link = DaemonLink(self.config.link, self.format.layout, name, attach=True)
        self._link.connect()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models' extra pools (Mamba, SWA, indexer, ...) are refused: ``ValueError``.
        The KV pool itself (registered again by SGLang's hybrid controller) is fine."""
        if host_pool is not getattr(self, "mem_pool_host", None):
            raise ValueError(f"tierd stores the KV pool only, not SGLang's {host_pool_name} "
                             "pool: hybrid models (Mamba/SWA/sparse state) need another "
                             "HiCache storage backend")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def flush(self) -> None:
        """Wait for this backend's Commits and Releases in flight (each ends within the daemon
        call deadline): what ``batch_set_v1`` stored is then visible to every engine, and no
        lease of this backend is held."""
        self._settle(("commit", "release"), 0)

    def close(self) -> None:
        """``flush``, then end the runner and unregister from the daemon (best effort)."""
        self.flush()
        self._runner.stop(self.config.link.timeout_seconds + 1.0)
        if self._link is not None:
            self._link.close()

    # --- v1 (zero-copy) ----------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` tierd holds: one Lookup (0 if the daemon is down)."""
        self._settle(("commit",), 0)  # what this engine stored is visible to its own reads
        session = self._session()
        if session is None or not keys:
            return 0
        try:
            return len(session.client.lookup(session.engine_id, _hashes(keys)))
        except grpc.RpcError as exc:
            self._failed(exc, session)
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Load the leading held pages of ``keys`` into the host pages at ``host_indices``
        (``page_size`` indices per key); True for each page loaded and verified."""
        fmt = self._format()
        return self._load(keys, lambda n: fmt.pages_of(host_indices, n), HostPages(fmt))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pages at ``host_indices`` under ``keys``; True for each page tierd
        now holds (already held ones included)."""
        fmt = self._format()
        if not self.writer:  # MLA: one copy for all ranks, written by SGLang's writer rank
            return [True] * len(keys)
        pages = fmt.pages_of(host_indices, len(keys))
        return self._store(keys, lambda addresses: fmt.store(pages, addresses))

    # --- legacy (flat pages) -----------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """Fill the flat page ``target_location`` with ``key``'s page; None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill each flat page of ``target_locations``; the leading held pages come back, the
        rest are None."""
        fmt = self._format()
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise ValueError("batch_get needs one target page per key")
        loaded = self._load(keys, lambda n: list(range(n)), FlatPages(fmt, targets))
        return [t if ok else None for t, ok in zip(targets, loaded)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages ``values`` under ``keys``; True if tierd now holds all of them."""
        fmt = self._format()
        if not self.writer:
            return True
        flats = [fmt.flat_to_slot(v) for v in values]

        def write(addresses: Sequence[int | None]) -> list[bool]:
            for flat, address in zip(flats, addresses):
                if address is not None:
                    torch.from_numpy(bytes_at(address, fmt.page_bytes)).copy_(flat)
            return [a is not None for a in addresses]

        return all(self._store(keys, write))

    def clear(self) -> bool:
        """tierd's tiers are shared with other engines and evict on their own: nothing is
        cleared from here (False)."""
        _log.warning("tierd: HiCache clear leaves the daemon's blocks (shared with other "
                     "engines); they age out by LRU")
        return False

    def get_stats(self) -> None:
        return None

    # --- the daemon calls --------------------------------------------------------------------

    def _load(self, keys: Sequence[str], pages_of: Callable[[int], list[int]],
              sink: Sink) -> list[bool]:
        """Acquire, then ``core.load``: each leased slot checked as ``sink`` copies it into
        page ``pages_of(n)[i]``, then Release (naming the first page that failed, which the
        daemon re-checks and drops); True for each leading page in place."""
        self._settle(("commit",), 0)  # what this engine stored is visible to its own reads
        session = self._session()
        if session is None or not keys:
            return [False] * len(keys)
        assert session.slots is not None, "the link attaches the arena"
        try:
            lease = acquire(session.client, session.engine_id, _hashes(keys),
                            clock=time.monotonic)
        except grpc.RpcError as exc:
            self._failed(exc, session)
            return [False] * len(keys)
        done = load_leased(lease, pages_of(lease.num_blocks), session.slots, sink,
                           self._release_later(session), time.monotonic)
        if done.corrupt:
            _log.warning("tierd: page %d of %d failed its checksum; SGLang recomputes it",
                         done.verified, done.acquired)
        return [i < done.placed for i in range(len(keys))]

    def _store(self, keys: Sequence[str],
               write: Callable[[Sequence[int | None]], list[bool]]) -> list[bool]:
        """Reserve -> ``write`` (copies into the reserved slots' addresses, returns the
        ``written`` flags) -> Commit sent (module doc), the reservation aborted if the copy
        raised; then wait until at most ``PENDING_COMMITS`` Commits are in flight."""
        session = self._session()
        if session is None or not keys:
            return [False] * len(keys)
        slots = session.slots
        assert slots is not None, "the link attaches the arena"
        try:
            reserved = reserve(session.client, session.engine_id, _hashes(keys))
        except grpc.RpcError as exc:
            self._failed(exc, session)
            return [False] * len(keys)
        base, offset = slots.arena.data_ptr(), slots.geometry.offset
        try:
            written = write([None if s is None else base + offset(s) for s in reserved.slot_ids])
        except BaseException:
            self._abort(session, reserved)
            raise
        self._runner.submit("commit", lambda: self._commit(session, reserved, written))
        self._settle(("commit",), PENDING_COMMITS)
        return _stored(reserved.already_stored, reserved.slot_ids, True)

    def _commit(self, session: Session, reserved: Reservation, written: list[bool]) -> None:
        """The Commit job (a runner thread); a failure leaves the pages unstored, logged."""
        try:
            commit(session.client, reserved, written)
        except grpc.RpcError as exc:
            _log.warning("tierd: a Commit failed (%s); its pages are not stored", describe(exc))
            self._failed(exc, session, names_lease=True)

    def _release(self, session: Session, lease: Lease, corrupt_from: int | None) -> None:
        """The Release job (a runner thread); a failed one lets the lease lapse by itself."""
        try:
            release(session.client, lease, corrupt_from)
        except grpc.RpcError as exc:
            self._failed(exc, session, names_lease=True)

    def _settle(self, kinds: tuple[str, ...], keep: int) -> None:
        """Wait until at most ``keep`` jobs of ``kinds`` are queued or running (each ends
        within the daemon call deadline)."""
        if not self._runner.drain(2 * self.config.link.timeout_seconds + 1.0, kinds, keep):
            _log.warning("tierd: a daemon call of the HiCache backend outlived its deadline")

    def _release_later(self, session: Session) -> Release:
        """The ``core.load.Release`` of a get: the Release sent without waiting (None: the
        lease's deadline alone decides whether the copy counts), then at most
        ``PENDING_RELEASES`` left in flight."""
        def later(lease: Lease, corrupt_from: int | None) -> None:
            if lease.num_blocks:
                self._runner.submit("release",
                                    lambda: self._release(session, lease, corrupt_from))
            self._settle(("release",), PENDING_RELEASES)
        return later

    def _abort(self, session: Session, reserved: Reservation) -> None:
        try:
            abort(session.client, reserved)
        except grpc.RpcError as exc:  # it lapses on the daemon after its lease time
            self._failed(exc, session, names_lease=True)

    def _session(self) -> Session | None:
        """The current registration (registering first if needed), or None while the daemon
        is down. A call keeps the session it started with (its channel and arena mapping
        stay valid even if another thread drops the link meanwhile)."""
        link = self._link
        if link is None or not link.connect():
            return None
        return link.session

    def _failed(self, exc: grpc.RpcError, session: Session, *, names_lease: bool = False) -> None:
        """A failed daemon call of ``session``: ``DaemonLink.failed`` classifies it."""
        assert self._link is not None
        self._link.failed(exc, session, names_lease=names_lease)

    def _format(self) -> PageFormat:
        assert self.format is not None, "SGLang registers its host pool before any transfer"
        return self.format


def _stored(held: Sequence[bool], slots: Sequence[int | None], committed: bool) -> list[bool]:
    """Which pages of a Reserve tierd holds or will hold: held already, written and committed,
    or being written by another engine. Reserve gives no slot to a page another lease is
    writing (engines backing up one shared prefix at once), nor to any page after the first it
    had no room for (docs/daemon.md), so a page without a slot followed by a page with one is
    another engine's write, not a lack of room."""
    last_slot = max((i for i, s in enumerate(slots) if s is not None), default=-1)
    return [h or (s is not None and committed) or (s is None and i < last_slot and committed)
            for i, (h, s) in enumerate(zip(held, slots))]


def _hashes(keys: Sequence[str]) -> list[BlockHash]:
    """SGLang's page keys (64 hex digits of sha256) as tierd block hashes."""
    return [BlockHash(bytes.fromhex(k)) for k in keys]
