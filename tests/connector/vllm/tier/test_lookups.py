"""TierdTier's per-key state (``Lookups``) on its own: answers, leases, failed loads, lapses.
(``tests/vllm/test_tier.py`` runs it inside vLLM with a daemon.)"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tierd.connector.core.lease import Lease
from tierd.connector.vllm.tier.lookups import Lookups

SESSION: Any = SimpleNamespace()  # a lease only carries its session along


def ctx(req_id: str, positions: dict[bytes, int] | None = None) -> Any:
    return SimpleNamespace(req_id=req_id,
                           get_offload_key_position=lambda k: (positions or {}).get(k))


def got(n: int, seconds: float = 30.0, asked: float | None = None) -> Lease:
    """An Acquire's lease of ``n`` blocks, asked at ``asked`` (default now)."""
    asked = time.monotonic() if asked is None else asked
    return Lease("engine", "lease", list(range(10, 10 + n)), list(range(n)), asked + seconds)


def test_new_keys_retry_then_answer_from_the_pinned_prefix() -> None:
    """Unknown keys answer retry and go out in chunk-position order, cut in pieces; the
    daemon's pinned prefix answers hit (with its slot), the rest miss; the request's end
    releases the lease once."""
    lookups = Lookups()
    keys = [bytes([i]) * 36 for i in range(5)]
    request = ctx("r", {k: 16 * (5 - i) for i, k in enumerate(keys)})  # recorded in reverse
    assert [lookups.lookup(k, request)[0] for k in keys] == ["retry"] * 5
    assert lookups.take_batches(2) == [keys[::-1][:2], keys[::-1][2:4], keys[::-1][4:]]
    assert lookups.take_batches(2) == []
    ordered = keys[::-1]
    assert lookups.answer(ordered, SESSION, got(3)) == []
    assert [lookups.lookup(k, request)[0] for k in ordered] == ["hit"] * 3 + ["miss"] * 2
    state = lookups.state(ordered[2])
    assert state is not None and state.pin is not None and state.index == 2
    lookups.check_integrity()
    freed = lookups.finish("r")
    assert len(freed) == 1 and freed[0].refs == 0 and lookups.states() == []


def test_failed_load_answers_miss_until_stored_again() -> None:
    """A load that verified two keys and failed the third: the lease learns its bad slot, is
    freed with the job, and the failed key answers miss until it is stored again."""
    lookups = Lookups()
    keys = [bytes([i]) * 36 for i in range(3)]
    request = ctx("r")
    for k in keys:
        lookups.lookup(k, request)
    lookups.take_batches(8)
    lookups.answer(keys, SESSION, got(3))
    parts, missing = lookups.start_load(keys, [7, 8, 9])
    assert missing == [] and [p.chunk for p in parts] == [7, 8, 9]
    freed = lookups.end_load(keys[:2], keys[2:], [(parts[2].pin, 2)])
    assert len(freed) == 1 and freed[0].corrupt_from == 2
    assert lookups.lookup(keys[2], ctx("s"))[0] == "miss"
    lookups.stored([keys[2]])
    assert lookups.lookup(keys[2], ctx("s"))[0] == "retry"
    lookups.check_integrity()


def test_a_lapsing_lease_is_asked_again_and_unasked_answers_free_their_pins() -> None:
    """A hit whose lease is about to lapse is asked again (its lease freed); keys nobody waits
    for any more when the answer comes are dropped and their pins freed at once."""
    now = [0.0]
    lookups = Lookups(margin=1.0, clock=lambda: now[0])
    key, other = b"k" * 36, b"o" * 36
    lookups.lookup(key, ctx("r"))
    lookups.take_batches(8)
    lookups.answer([key], SESSION, got(1, seconds=5.0, asked=0.0))
    now[0] = 4.5
    answer, freed = lookups.lookup(key, ctx("r"))
    assert answer == "retry" and len(freed) == 1
    lookups.lookup(other, ctx("q"))
    lookups.take_batches(8)
    assert lookups.finish("q") == []  # still being asked: kept until answered
    assert len(lookups.answer([other], SESSION, got(1))) == 1
    assert lookups.state(other) is None
    lookups.check_integrity()
