"""TierdTier inside vLLM 0.33's real native tiered offloading (``TieringOffloadingSpec``), with
a real `tierd serve`: what vLLM's scheduler would see (``tier_harness``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from harness import Daemon, model_dir_in
from tier_harness import SLOT, TierEngine, new_keys
from vllm.v1.kv_offload.base import LookupResult

from tierd.connector.core.lease import Lease
from tierd.connector.vllm.tier.lookups import Pin

pytestmark = pytest.mark.vllm


def payloads(n: int) -> list[bytes]:
    return [os.urandom(SLOT) for _ in range(n)]


@pytest.fixture
def engines(daemon: Daemon, model_dir: str) -> Iterator[list[TierEngine]]:
    """Engines A and B: the same model on the same daemon, each its own manager and region."""
    made = [TierEngine(model_dir, daemon.socket_path) for _ in range(2)]
    yield made
    for engine in made:
        engine.close()


def tier_pins(engine: TierEngine) -> int:
    return int(engine.tier._lookups.pinned())


def test_engine_b_loads_what_engine_a_stored(engines: list[TierEngine], daemon: Daemon) -> None:
    """Engine A stores 8 chunks; engine B's lookups answer RETRY, then hit, and its load brings
    back A's bytes; the daemon lists both tier engines under one model; nothing stays pinned."""
    a, b = engines
    keys, data = new_keys(8), payloads(8)
    a.store(keys, data)
    ctx = b.context()
    with b.manager.lock:
        b.manager.on_new_request(ctx)
        assert b.manager.lookup(keys[0], ctx) is LookupResult.RETRY  # never blocks on the daemon
        b.manager.on_request_finished(ctx)
    assert b.load(keys) == data
    b.tier.check_integrity()
    assert tier_pins(b) == 0 and daemon.pinned_blocks() == 0
    with daemon.client() as client:
        stats = client.stats()
    assert [e.engine_name for e in stats.engines].count("vllm-tier") == 2
    (model,) = stats.models
    assert model.blocks["dram"] == 8 and model.model_id == a.tier._layout.model_id


def test_other_weights_of_the_same_shape_get_nothing(daemon: Daemon, engines: list[TierEngine],
                                                     tmp_path: str) -> None:
    """A model with A's config and other weights has another model id: its lookups miss."""
    a, _ = engines
    keys = new_keys(4)
    a.store(keys, payloads(4))
    other = TierEngine(model_dir_in(str(tmp_path), seed=1), daemon.socket_path)
    try:
        assert other.tier._layout.model_id != a.tier._layout.model_id
        assert other.load(keys) == []
    finally:
        other.close()


def test_restart_between_lookup_and_load(engines: list[TierEngine], daemon: Daemon,
                                         model_dir: str) -> None:
    """The daemon is killed and restarted (empty) after B's lookup pinned the chunks and before
    the load runs: the load still brings back A's verified bytes from the mapping B holds; the
    new daemon has nothing, so a third engine misses; B stores again on the new daemon."""
    a, b = engines
    keys, data = new_keys(6), payloads(6)
    a.store(keys, data)

    def restart_once() -> None:
        states = b.tier._lookups.states()
        if states and all(s.phase == "hit" for s in states) \
                and daemon.starts == 1:
            daemon.restart(kill=True)

    assert b.load(keys, between=restart_once) == data
    assert daemon.starts == 2
    third = TierEngine(model_dir, daemon.socket_path)
    try:
        assert third.load(keys) == []
        more, more_data = new_keys(3), payloads(3)
        b.store(more, more_data)
        assert third.load(more) == more_data
    finally:
        third.close()


@pytest.mark.parametrize("daemon", ["", "demote-all"], ids=["dram", "ssd"], indirect=True)
def test_a_probe_asks_for_dram_at_once_and_ssd_in_pieces(engines: list[TierEngine],
                                                          daemon: Daemon, model_dir: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A stores six chunks; they stay in DRAM, or (a daemon that demotes everything) move to
    SSD. B's probe is one Acquire, which pins the DRAM run (all six, or none) and says where
    the rest lies, then one Acquire per SSD piece (here a chunk each), and no Lookup; B loads
    all six byte for byte and leaves nothing pinned."""
    import tierd.connector.vllm.tier.tier as tier_module
    from tierd.bench.vllm_tier import wait_on_ssd

    a, b = engines
    keys, data = new_keys(6), payloads(6)
    a.store(keys, data)
    on_ssd = daemon.demote_all
    if on_ssd:
        wait_on_ssd(b.tier._layout, daemon.socket_path, keys)
    asked: list[tuple[int, bool]] = []
    real_acquire = tier_module.acquire_async

    def counted(client: Any, engine_id: str, hashes: list[bytes], **kw: Any) -> Any:
        asked.append((len(hashes), kw.get("dram_run_only", False)))
        return real_acquire(client, engine_id, hashes, **kw)

    def no_lookup(*args: Any) -> None:
        raise AssertionError("a probe makes no Lookup")

    monkeypatch.setattr(tier_module, "acquire_async", counted)
    monkeypatch.setattr(type(b.tier._session().client), "lookup", no_lookup)
    monkeypatch.setattr(tier_module, "_SSD_PIECE_BYTES", 1)  # one chunk per SSD piece
    assert b.load(keys) == data
    assert asked == [(6, True)] + ([(1, False)] * 6 if on_ssd else [])
    assert not b.tier.has_pending_work() and tier_pins(b) == 0
    assert daemon.pinned_blocks() == 0


@pytest.mark.parametrize("daemon", ["no-ssd"], indirect=True)
def test_stores_after_the_first_copy_into_blank_slots_reserved_ahead(
        engines: list[TierEngine], daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's first store Reserves its chunks, then asks for a stock of as many blank slots (the
    daemon counts them used); the next, smaller store makes no Reserve: it copies into the
    stock (its spare slots freed at the Commit) and a new stock follows; a stock older than
    half its lease is aborted and the store Reserves. B loads every chunk with A's bytes."""
    import tierd.connector.vllm.tier.tier as tier_module

    a, b = engines
    keys, data = new_keys(16), payloads(16)
    reserves: list[int] = []
    real_reserve = tier_module.reserve

    def counted(client: Any, engine_id: str, hashes: list[bytes], **kw: Any) -> Any:
        reserves.append(len(hashes))
        return real_reserve(client, engine_id, hashes, **kw)

    def dram_used(expected: int) -> None:
        deadline = time.monotonic() + 10
        while True:
            with daemon.client() as client:
                used = next(t.used_blocks for t in client.stats().tiers if t.tier == "dram")
            if used == expected:
                return
            assert time.monotonic() < deadline, f"{used} DRAM slots used, not {expected}"
            time.sleep(0.01)

    monkeypatch.setattr(tier_module, "reserve", counted)
    a.store(keys[:8], data[:8])
    dram_used(8 + 8)
    a.store(keys[8:12], data[8:12])
    assert reserves == [8]
    dram_used(12 + 8)
    monkeypatch.setattr(a.tier._stock, "_clock", lambda: time.monotonic() + 1e4)
    a.store(keys[12:], data[12:])
    assert reserves == [8, 4]
    dram_used(16 + 8)
    assert b.load(keys) == data
    assert daemon.pinned_blocks() == 0


def test_probe_pieces() -> None:
    """After the DRAM run (pinned by the first Acquire), pieces of ``ssd_piece`` up to the end
    of the held prefix; nothing after the run, nothing asked."""
    from tierd.connector.vllm.tier.tier import probe_pieces

    assert probe_pieces(3, 8, 3) == [range(3, 6), range(6, 8)]
    assert probe_pieces(0, 3, 2) == [range(0, 2), range(2, 3)]
    assert probe_pieces(5, 5, 2) == []
    assert probe_pieces(0, 0, 2) == []


def test_stalled_then_killed_daemon_never_stalls_vllm(daemon: Daemon, model_dir: str) -> None:
    """The daemon stops answering (SIGSTOP) with a store and lookups in flight, then is killed
    mid-job: every call of vLLM's returns at once, the store ends as a counted failure, the
    lookups end as MISS, and with a daemon back the tier stores and loads again."""
    a = TierEngine(model_dir, daemon.socket_path, tier={"timeout_seconds": 2.0})
    b = TierEngine(model_dir, daemon.socket_path, tier={"timeout_seconds": 2.0})
    try:
        assert a.tier.connect() and b.tier.connect()
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGSTOP)
        keys, slowest = new_keys(16), 0.0
        ctx, asking = a.context(), b.context()
        start = time.monotonic()
        with a.manager.lock:
            a.manager.on_new_request(ctx)
            out = a.manager.prepare_store(keys, ctx)
            assert out is not None
            a.manager.complete_store(keys, ctx, True)  # its Reserve will hang
            a.manager.on_request_finished(ctx)
        with b.manager.lock:
            b.manager.on_new_request(asking)
        for _ in range(20):  # steps while the daemon hangs: lookups go out and wait
            began = time.monotonic()
            assert _prefix(b, keys, asking) is None
            a.step()
            b.step()
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.01)
        assert slowest < 0.2, f"a scheduler call took {slowest:.2f} s"
        daemon.stop(kill=True)  # SIGKILL with the Reserve and the Acquire in flight
        a.settle(timeout=10)
        assert _prefix(b, keys, asking) == 0 or b.lookup(keys, asking, timeout=10) == 0
        assert time.monotonic() - start < 10, "jobs outlived their deadline"
        stats = a.manager.get_stats()
        assert stats is not None and "vllm:kv_offload_tierd_stores_dropped" in str(stats.data)
        with b.manager.lock:
            b.manager.on_request_finished(asking)
        daemon.start()
        keys, data = new_keys(4), payloads(4)
        a.store(keys, data)
        assert b.load(keys) == data
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("daemon", ["no-ssd"], indirect=True)
def test_corrupt_slot_fails_the_load_and_then_misses(engines: list[TierEngine],
                                                     daemon: Daemon, model_dir: str) -> None:
    """A slot damaged after B pinned it: B's load keeps the chunks before it, fails it and
    the rest (vLLM recomputes them); it then answers MISS, and the daemon has dropped it (no
    SSD tier: with one, the write-behind may already hold a good copy, which a third engine
    would rightly load)."""
    a, b = engines
    keys, data = new_keys(5), payloads(5)
    a.store(keys, data)

    def corrupt() -> None:
        state = b.tier._lookups.state(keys[2])
        if state is not None and state.phase == "hit" and state.pin is not None:
            pin = state.pin
            offset = pin.session.slots.geometry.offset(pin.lease.slot_ids[state.index])
            pin.session.arena[offset + 100] ^= 0xFF
            pin.session.arena[offset + 101] ^= 0xFF

    assert b.load(keys, between=corrupt) == data[:2]
    stats = b.manager.get_stats()
    assert stats is not None and "vllm:kv_offload_tierd_checksum_failures" in str(stats.data)
    ctx = b.context()
    with b.manager.lock:
        b.manager.on_new_request(ctx)
        assert b.manager.lookup(keys[2], ctx) is LookupResult.MISS
        b.manager.on_request_finished(ctx)
    third = TierEngine(model_dir, daemon.socket_path)
    try:
        assert third.load(keys) == data[:2]
    finally:
        third.close()
    with daemon.client() as client:
        assert client.stats().checksum_failures >= 1
    assert daemon.pinned_blocks() == 0


def test_a_job_that_raises_still_ends(engines: list[TierEngine], daemon: Daemon,
                                      model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a store's copy or a load's copy (an exception, not a daemon error): the job
    still ends, failed (vLLM never waits on it), nothing stays pinned, and once the copies work
    again the same chunks store and load."""
    import tierd.connector.vllm.tier.tier as tier_module
    from tierd.connector.vllm.tier.jobs import PrimaryRows

    a, b = engines
    keys, data = new_keys(4), payloads(4)

    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the copy")

    with monkeypatch.context() as patch:
        patch.setattr(tier_module, "store_rows", broken)
        a.store(keys, data)  # returns once vLLM has the job's (failed) result
    assert not a.tier.has_pending_work() and daemon.pinned_blocks() == 0
    fresh = [TierEngine(model_dir, daemon.socket_path) for _ in range(2)]
    try:
        fresh[0].store(keys, data)  # stored in full: the failed store's reservation was aborted
        with monkeypatch.context() as patch:
            patch.setattr(PrimaryRows, "place", broken)
            assert b.load(keys) == []
        assert not b.tier.has_pending_work() and tier_pins(b) == 0
        assert daemon.pinned_blocks() == 0
        assert fresh[1].load(keys) == data
    finally:
        for engine in fresh:
            engine.close()


def test_primary_eviction_then_promotion(daemon: Daemon, model_dir: str) -> None:
    """A primary tier of 4 chunks stores 10: the first ones leave it (LRU), and a later
    request finds them in the tier and promotes them back, byte for byte."""
    engine = TierEngine(model_dir, daemon.socket_path, cpu_chunks=4)
    try:
        keys, data = new_keys(10), payloads(10)
        for i in range(0, 10, 2):
            engine.store(keys[i:i + 2], data[i:i + 2])
        assert engine.load(keys[:3]) == data[:3]
        engine.tier.check_integrity()
    finally:
        engine.close()


def test_tp2_rows_hold_both_ranks(daemon: Daemon, model_dir: str) -> None:
    """At TP 2 a row holds both ranks' bytes: another TP-2 engine loads them whole; a TP-1
    engine of the same model (another row format) does not see them."""
    a = TierEngine(model_dir, daemon.socket_path, tp=2)
    b = TierEngine(model_dir, daemon.socket_path, tp=2)
    one = TierEngine(model_dir, daemon.socket_path, tp=1)
    try:
        assert a.tier._layout.tp_size == 2 and a.tier._layout.block_bytes == SLOT
        keys, data = new_keys(4), payloads(4)
        a.store(keys, data)
        assert b.load(keys) == data
        assert one.load(keys) == []
    finally:
        for engine in (a, b, one):
            engine.close()


def test_replicated_rows_are_shared_between_tp_sizes(daemon: Daemon, model_dir: str) -> None:
    """A replicated layout (MLA under TP alone: every rank holds the chunk's whole KV, a row
    one copy): a TP-2 writer's chunks load byte for byte in a TP-4 reader, whose namespace
    holds no TP size; sharded rows of TP 4 hold other bytes and see none of them."""
    writer = TierEngine(model_dir, daemon.socket_path, tp=2, replicated=True)
    reader = TierEngine(model_dir, daemon.socket_path, tp=4, replicated=True)
    sharded = TierEngine(model_dir, daemon.socket_path, tp=4)
    try:
        keys, data = new_keys(4), payloads(4)
        writer.store(keys, data)
        assert reader.load(keys) == data
        assert reader.tier._layout.tp_size == 1 and reader.tier._layout.block_bytes == SLOT
        assert sharded.load(keys) == []
        assert daemon.pinned_blocks() == 0
    finally:
        for engine in (writer, reader, sharded):
            engine.close()


def test_a_starting_tier_keeps_no_request_waiting(daemon: Daemon, model_dir: str) -> None:
    """An engine starts while the daemon does not answer (SIGSTOP): its tier's first connect
    waits, and meanwhile a request's lookup answers MISS at once and vLLM is not kept stepping
    (no pending work). Once the daemon answers, the tier stores and another engine loads."""
    assert daemon.process is not None
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        engine = TierEngine(model_dir, daemon.socket_path, connect=False)
        ctx = engine.context()
        with engine.manager.lock:
            engine.manager.on_new_request(ctx)
            assert engine.manager.lookup(new_keys(1)[0], ctx) is LookupResult.MISS
            assert not engine.manager.has_pending_work()
            engine.manager.on_request_finished(ctx)
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    other = TierEngine(model_dir, daemon.socket_path)
    try:
        assert engine.tier.connect()
        keys, data = new_keys(3), payloads(3)
        engine.store(keys, data)
        assert other.load(keys) == data
    finally:
        engine.close()
        other.close()


def test_no_kv_cache_group_is_refused_naming_the_fix(daemon: Daemon, model_dir: str) -> None:
    """vLLM's config with no KV cache group (``groups=()``) fails the tier's start with a
    ValueError naming the fix, not an IndexError."""
    with pytest.raises(ValueError, match="no KV cache group.*remove the TierdTier entry"):
        TierEngine(model_dir, daemon.socket_path, groups=())


@pytest.mark.parametrize("cpu_chunks", [64, 32])
def test_many_concurrent_requests(daemon: Daemon, model_dir: str, cpu_chunks: int) -> None:
    """24 requests sharing a prefix (51 chunks) look up in the same steps on B and each loads
    the prefix its lookup answered, as vLLM does: all of it when B's primary tier holds every
    promotion (64 chunks), else what vLLM found room to promote (32: the rest is a MISS); every
    loaded chunk holds A's bytes, and no pin or lease is left behind."""
    a = TierEngine(model_dir, daemon.socket_path)
    b = TierEngine(model_dir, daemon.socket_path, cpu_chunks=cpu_chunks)
    try:
        _many_concurrent_requests(a, b, daemon, everything=cpu_chunks >= 51)
    finally:
        a.close()
        b.close()


def _many_concurrent_requests(a: TierEngine, b: TierEngine, daemon: Daemon,
                              everything: bool) -> None:
    shared, data = new_keys(3), payloads(3)
    prompts = [(shared + new_keys(2)) for _ in range(24)]
    contents = [data + payloads(2) for _ in range(24)]
    for keys, chunk_data in zip(prompts, contents):
        a.store(keys, chunk_data)
    contexts = [b.context() for _ in prompts]
    with b.manager.lock:
        for ctx in contexts:
            b.manager.on_new_request(ctx)
    loaded: list[int | None] = [None] * len(prompts)
    deadline = time.monotonic() + 30
    while None in loaded:  # each request loads in the step its lookup answers, as in vLLM
        assert time.monotonic() < deadline
        for i, (keys, ctx) in enumerate(zip(prompts, contexts)):
            hits = None if loaded[i] is not None else _prefix(b, keys, ctx)
            if hits is None:
                continue
            with b.manager.lock:  # vLLM loads the hit prefix only and computes the rest
                spec = b.manager.prepare_load(keys[:hits], ctx)
            rows = b.rows()
            assert [rows[int(c), :SLOT].tobytes() for c in spec.chunk_ids] == contents[i][:hits]
            del rows
            with b.manager.lock:
                b.manager.complete_load(keys[:hits], ctx)
                b.manager.on_request_finished(ctx)
            loaded[i] = hits
        b.step()
        time.sleep(0.002)
    b.settle()
    b.tier.check_integrity()
    assert tier_pins(b) == 0 and daemon.pinned_blocks() == 0
    assert not everything or loaded == [5] * len(prompts), loaded


def _prefix(engine: TierEngine, keys: list, ctx: object) -> int | None:
    hits, deferred = 0, False
    with engine.manager.lock:
        for key in keys:
            result = engine.manager.lookup(key, ctx)
            if result is LookupResult.MISS:
                break
            hits += result is not LookupResult.RETRY
            deferred |= result is not LookupResult.HIT
    return None if deferred else hits


def test_release_not_found_drops_the_session_only_before_the_deadline(
        daemon: Daemon, model_dir: str) -> None:
    """A Release the daemon answers NOT_FOUND: past the lease's deadline it had only lapsed
    (the registration stays); before it, the daemon forgot the engine (dropped, re-registers)."""
    engine = TierEngine(model_dir, daemon.socket_path)
    try:
        tier = engine.tier
        assert tier.connect()
        session = tier._link.session
        lapsed = Lease(session.engine_id, "no-such-lease", [0], [0], time.monotonic() - 1.0)
        tier._release(Pin(session, lapsed, lapsed.deadline, 0))
        assert tier._link.session is session
        forgotten = Lease(session.engine_id, "no-such-lease", [0], [0], time.monotonic() + 30)
        tier._release(Pin(session, forgotten, forgotten.deadline, 0))
        assert tier._link.session is None
        assert tier.connect() and tier._link.session is not session
    finally:
        engine.close()


def test_shutdown_releases_every_view(daemon: Daemon, model_dir: str) -> None:
    """After stores and loads, vLLM's shutdown unmaps its region (a view left by the tier would
    raise BufferError there) and the tier's engine leaves the daemon; drain_jobs is bounded."""
    engine = TierEngine(model_dir, daemon.socket_path)
    keys, data = new_keys(3), payloads(3)
    engine.store(keys, data)
    assert engine.load(keys) == data  # from the primary tier
    region = engine.manager.primary_tier._mmap_region
    with engine.manager.lock:
        engine.tier.drain_jobs()
    engine.close()
    assert region.mmap_obj is None or region.mmap_obj.closed
    with daemon.client() as client:
        assert "vllm-tier" not in [e.engine_name for e in client.stats().engines]


def test_tier_config_errors_name_the_fix(daemon: Daemon, model_dir: str) -> None:
    """An unknown key or a bad value in the tier's entry fails vLLM's start-up with the same
    errors as TierdConnector's config, naming the entry."""
    with pytest.raises(ValueError, match="unknown secondary_tiers entry 'TierdTier' key"):
        TierEngine(model_dir, daemon.socket_path, tier={"sockt_path": "x"})
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        TierEngine(model_dir, daemon.socket_path, tier={"workers": 0})


def test_events_stats_and_config_info(daemon: Daemon, model_dir: str) -> None:
    """With KV events on, stored chunks are announced as BlockStored on STORAGE; config_info
    names the daemon, model id and slot size."""
    engine = TierEngine(model_dir, daemon.socket_path, events=True,
                        tier={"enable_kv_events": True})
    try:
        keys = new_keys(3)
        engine.store(keys, payloads(3))
        deadline = time.monotonic() + 10
        events: list = []
        while not events and time.monotonic() < deadline:
            with engine.manager.lock:
                events = [e for e in engine.manager.take_events() if e.ownership is None
                          and e.medium.name == "STORAGE"]
            time.sleep(0.01)
        assert [k for e in events for k in e.keys] == keys and not events[0].removed
        infos = engine.manager.config_info()
        assert infos[1]["tierd_slot_bytes"] == SLOT
        assert infos[1]["tierd_model_id"].startswith("tiny-llama@")
        assert np.asarray(infos[1]["tierd_target"] == f"unix:{daemon.socket_path}")
    finally:
        engine.close()


def test_reset_cache_with_jobs_in_flight(engines: list[TierEngine]) -> None:
    """vLLM's reset_cache (sleep, weight update) with a store in flight: drain_jobs lets it
    finish, vLLM's own bookkeeping check passes, and after the reset the chunks load again."""
    a, b = engines
    keys, data = new_keys(6), payloads(6)
    ctx = a.context()
    with a.manager.lock:
        a.manager.on_new_request(ctx)
        out = a.manager.prepare_store(keys, ctx)
        assert out is not None
        rows = a.rows()
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            rows[int(chunk), :SLOT] = np.frombuffer(data[keys.index(key)], dtype=np.uint8)
        del rows
        a.manager.complete_store(keys, ctx, True)
        a.manager.on_request_finished(ctx)
        a.manager.reset_cache()  # asserts that no job of any tier is left in flight
        a.manager.on_reset_flushed()
    a.settle()
    a.tier.check_integrity()
    assert b.load(keys) == data
