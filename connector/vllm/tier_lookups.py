"""What a ``TierdTier`` knows of each key between vLLM's lookups and its loads.

Scheduler-thread state only (vLLM's manager lock covers it): no threads, no daemon calls. A key
is *asking* (in this step's batch, or its Acquire is out), *hit* (pinned by a ``Lease`` at an
index), *miss*, or *loading* (a load job owns it). A lease counts the keys that hold it; the
methods that drop keys return the leases no key holds any more, for the caller to release.
A key whose load failed answers miss until it is stored again (``stored``), so vLLM does not
promote it forever; that memory is bounded (``max_failed``, least recently failed forgotten).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from tierd.daemon.client import AcquiredBlocks

from .tier_daemon import Session

Answer = Literal["hit", "miss", "retry"]


@dataclass(slots=True)
class Lease:
    """One Acquire's pinned prefix. Invariant: ``refs`` == keys whose state holds it."""

    session: Session
    got: AcquiredBlocks
    expires: float
    """Clock time after which its slots are not copied any more (the pin may lapse)."""
    refs: int
    corrupt_from: int | None = None
    """The first of its slots a load found damaged (told to the daemon at release)."""


@dataclass(slots=True)
class KeyState:
    """One key: its phase, the requests that looked it up, and for a hit its lease and its
    place in the lease (``index``)."""

    phase: Literal["asking", "hit", "miss", "loading"]
    requests: set[str] = field(default_factory=set)
    lease: Lease | None = None
    index: int = 0


class LoadPart(NamedTuple):
    """One chunk of a load job: copy slot ``lease.got.slot_ids[nth]`` into row ``chunk``."""

    key: bytes
    chunk: int
    lease: Lease
    nth: int


class Lookups:
    """The per-key state of one tier (module doc)."""

    def __init__(self, *, max_failed: int = 1 << 16, margin: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._keys: dict[bytes, KeyState] = {}
        self._batches: dict[str, tuple[Any, list[bytes]]] = {}
        self._req_keys: dict[str, set[bytes]] = {}
        self._failed: OrderedDict[bytes, None] = OrderedDict()
        self._max_failed, self._margin, self._clock = max_failed, margin, clock

    def lookup(self, key: bytes, req_context: Any) -> tuple[Answer, list[Lease]]:
        """vLLM's lookup of ``key`` for ``req_context`` (its ``req_id``); a new key joins the
        request's batch and answers retry. Also returns leases to release (a lapsing one)."""
        if key in self._failed:
            return "miss", []
        free: list[Lease] = []
        state = self._keys.get(key)
        if state is not None and state.phase == "hit":
            assert state.lease is not None, "a hit key is pinned by a lease"
            if self._clock() >= state.lease.expires:  # its pin is about to lapse: ask again
                free = self._forget(key, state)
                state = None
        if state is None:
            state = self._keys[key] = KeyState("asking")
            self._batches.setdefault(req_context.req_id, (req_context, []))[1].append(key)
        state.requests.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if state.phase == "hit":
            return "hit", free
        return ("miss" if state.phase == "miss" else "retry"), free

    def take_batches(self, piece: int) -> list[list[bytes]]:
        """This step's new keys to ask the daemon for: per request, in the order it will load
        them (its chunk positions where vLLM recorded them), cut into pieces of ``piece``."""
        batches, self._batches = self._batches, {}
        out = []
        for req_context, keys in batches.values():
            where = [req_context.get_offload_key_position(k) for k in keys]
            if None not in where:
                keys = [k for _, k in sorted(zip(where, keys), key=lambda p: p[0])]
            out += [keys[i:i + piece] for i in range(0, len(keys), piece)]
        return out

    def answer(self, keys: Sequence[bytes], session: Session | None,
               got: AcquiredBlocks | None) -> list[Lease]:
        """The daemon pinned the first ``got.num_blocks`` of ``keys`` (none without ``got``):
        those still asked for are hits, the rest misses. Returns leases no key holds."""
        hits = got.num_blocks if got is not None else 0
        lease = None
        if got is not None and hits:
            assert session is not None, "a lease comes from a session"
            lease = Lease(session, got, self._clock() + got.seconds_left - self._margin, hits)
        free = []
        for i, key in enumerate(keys):
            state = self._keys.get(key)
            asked = state is not None and state.phase == "asking"
            if lease is not None and i < hits:
                if asked and state is not None and state.requests:
                    state.phase, state.lease, state.index = "hit", lease, i
                    continue
                free += self._unref(lease)
            if asked and state is not None:
                if state.requests:
                    state.phase = "miss"
                else:
                    del self._keys[key]
        return free

    def finish(self, req_id: str) -> list[Lease]:
        """A request ended: its hits and misses go unless another request holds them (keys it
        is still asking for stay until answered: another request may wait on them)."""
        free = []
        for key in self._req_keys.pop(req_id, ()):
            state = self._keys.get(key)
            if state is None:
                continue
            state.requests.discard(req_id)
            if not state.requests and state.phase in ("hit", "miss"):
                free += self._forget(key, state)
        return free

    def start_load(self, keys: Sequence[bytes], chunks: Sequence[int]
                   ) -> tuple[list[LoadPart], list[bytes]]:
        """A load job takes its hit keys (now loading); keys that are not hits fail."""
        parts, missing = [], []
        for key, chunk in zip(keys, chunks):
            state = self._keys.get(key)
            if state is None or state.phase != "hit" or state.lease is None:
                missing.append(key)
                continue
            state.phase = "loading"
            parts.append(LoadPart(key, int(chunk), state.lease, state.index))
        return parts, missing

    def end_load(self, ok: Sequence[bytes], failed: Sequence[bytes],
                 corrupt: Sequence[tuple[Lease, int]]) -> list[Lease]:
        """A load job ended: its keys go, ``failed`` ones answer miss until stored again, and
        each lease learns its first damaged slot. Returns leases no key holds."""
        for lease, index in corrupt:
            lease.corrupt_from = min(index, lease.corrupt_from if lease.corrupt_from is not None
                                     else index)
        free = []
        for key in [*ok, *failed]:
            state = self._keys.get(key)
            if state is not None and state.phase == "loading":
                free += self._forget(key, state)
        for key in failed:
            self._failed[key] = None
            self._failed.move_to_end(key)
        while len(self._failed) > self._max_failed:
            self._failed.popitem(last=False)
        return free

    def stored(self, keys: Sequence[bytes]) -> None:
        """``keys`` are being stored again: failed loads of them no longer answer miss."""
        for key in keys:
            self._failed.pop(key, None)

    def state(self, key: bytes) -> KeyState | None:
        """What is known of ``key`` (None: nothing), for diagnostics and tests."""
        return self._keys.get(key)

    def states(self) -> list[KeyState]:
        return list(self._keys.values())

    def pinned(self) -> int:
        """Keys that hold a lease."""
        return sum(1 for s in self._keys.values() if s.lease is not None)

    def _forget(self, key: bytes, state: KeyState) -> list[Lease]:
        del self._keys[key]
        lease, state.lease = state.lease, None
        return self._unref(lease) if lease is not None else []

    @staticmethod
    def _unref(lease: Lease) -> list[Lease]:
        lease.refs -= 1
        assert lease.refs >= 0, "a lease released more often than taken"
        return [lease] if lease.refs == 0 else []

    def check_integrity(self) -> None:
        """Assert that exactly the hit and loading keys hold a lease, that each lease counts
        the keys holding it, and that every batched key is still being asked for."""
        holders: dict[int, tuple[Lease, int]] = {}
        for state in self._keys.values():
            pinned = state.phase in ("hit", "loading")
            assert (state.lease is not None) == pinned, f"{state.phase} key, lease {state.lease}"
            if state.lease is not None:
                lease, n = holders.get(id(state.lease), (state.lease, 0))
                holders[id(lease)] = (lease, n + 1)
        for lease, n in holders.values():
            assert lease.refs == n, f"a lease counts {lease.refs} keys, {n} hold it"
        for _, keys in self._batches.values():
            assert all(self._keys[k].phase == "asking" for k in keys), "a batched key answered"
        assert len(self._failed) <= self._max_failed, "failed keys beyond their bound"
