"""What a ``TierdTier`` knows of each key between vLLM's lookups and its loads.

Scheduler-thread state only (vLLM's manager lock covers it): no threads, no daemon calls. A key
is *asking* (in this step's batch, or its Acquire is out), *hit* (pinned by a ``Pin``, the
core's ``Lease`` of one Acquire, at an index), *miss*, or *loading* (a load job owns it). A pin
counts the keys that hold it; the methods that drop keys return the pins no key holds any more,
for the caller to release.
A key whose load failed answers miss until it is stored again (``stored``), so vLLM does not
promote it forever; that memory is bounded (``max_failed``, least recently failed forgotten).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from tierd.connector.core.lease import Lease
from tierd.connector.core.link import Session

Answer = Literal["hit", "miss", "retry"]


@dataclass(slots=True)
class Pin:
    """One Acquire's pinned prefix (``lease``, of ``session``). Invariant: ``refs`` == keys
    whose state holds it."""

    session: Session
    lease: Lease
    expires: float
    """Clock time after which its slots are not copied any more (``lease.deadline`` less a
    margin: the pin may lapse mid-copy)."""
    refs: int
    corrupt_from: int | None = None
    """The first of its slots a load found damaged (told to the daemon at release)."""


@dataclass(slots=True)
class KeyState:
    """One key: its phase, the requests that looked it up, and for a hit its pin and its
    place in the pin's lease (``index``)."""

    phase: Literal["asking", "hit", "miss", "loading"]
    requests: set[str] = field(default_factory=set)
    pin: Pin | None = None
    index: int = 0


class LoadPart(NamedTuple):
    """One chunk of a load job: copy slot ``pin.lease.slot_ids[nth]`` into row ``chunk``."""

    key: bytes
    chunk: int
    pin: Pin
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

    def lookup(self, key: bytes, req_context: Any) -> tuple[Answer, list[Pin]]:
        """vLLM's lookup of ``key`` for ``req_context`` (its ``req_id``); a new key joins the
        request's batch and answers retry. Also returns pins to release (a lapsing one)."""
        if key in self._failed:
            return "miss", []
        free: list[Pin] = []
        state = self._keys.get(key)
        if state is not None and state.phase == "hit":
            assert state.pin is not None, "a hit key is pinned"
            if self._clock() >= state.pin.expires:  # its pin is about to lapse: ask again
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
               lease: Lease | None) -> list[Pin]:
        """The daemon pinned the first ``lease.num_blocks`` of ``keys`` (none without
        ``lease``): those still asked for are hits, the rest misses. Returns pins no key
        holds."""
        hits = lease.num_blocks if lease is not None else 0
        pin = None
        if lease is not None and hits:
            assert session is not None, "a lease comes from a session"
            pin = Pin(session, lease, lease.deadline - self._margin, hits)
        free = []
        for i, key in enumerate(keys):
            state = self._keys.get(key)
            asked = state is not None and state.phase == "asking"
            if pin is not None and i < hits:
                if asked and state is not None and state.requests:
                    state.phase, state.pin, state.index = "hit", pin, i
                    continue
                free += self._unref(pin)
            if asked and state is not None:
                if state.requests:
                    state.phase = "miss"
                else:
                    del self._keys[key]
        return free

    def finish(self, req_id: str) -> list[Pin]:
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
            if state is None or state.phase != "hit" or state.pin is None:
                missing.append(key)
                continue
            state.phase = "loading"
            parts.append(LoadPart(key, int(chunk), state.pin, state.index))
        return parts, missing

    def end_load(self, ok: Sequence[bytes], failed: Sequence[bytes],
                 corrupt: Sequence[tuple[Pin, int]]) -> list[Pin]:
        """A load job ended: its keys go, ``failed`` ones answer miss until stored again, and
        each pin learns its first damaged slot. Returns pins no key holds."""
        for pin, index in corrupt:
            pin.corrupt_from = min(index, pin.corrupt_from if pin.corrupt_from is not None
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
        """Keys that hold a pin."""
        return sum(1 for s in self._keys.values() if s.pin is not None)

    def _forget(self, key: bytes, state: KeyState) -> list[Pin]:
        del self._keys[key]
        pin, state.pin = state.pin, None
        return self._unref(pin) if pin is not None else []

    @staticmethod
    def _unref(pin: Pin) -> list[Pin]:
        pin.refs -= 1
        assert pin.refs >= 0, "a pin released more often than taken"
        return [pin] if pin.refs == 0 else []

    def check_integrity(self) -> None:
        """Assert that exactly the hit and loading keys hold a pin, that each pin counts the
        keys holding it, and that every batched key is still being asked for."""
        holders: dict[int, tuple[Pin, int]] = {}
        for state in self._keys.values():
            pinned = state.phase in ("hit", "loading")
            assert (state.pin is not None) == pinned, f"{state.phase} key, pin {state.pin}"
            if state.pin is not None:
                pin, n = holders.get(id(state.pin), (state.pin, 0))
                holders[id(pin)] = (pin, n + 1)
        for pin, n in holders.values():
            assert pin.refs == n, f"a pin counts {pin.refs} keys, {n} hold it"
        for _, keys in self._batches.values():
            assert all(self._keys[k].phase == "asking" for k in keys), "a batched key answered"
        assert len(self._failed) <= self._max_failed, "failed keys beyond their bound"
