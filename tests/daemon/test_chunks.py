"""Big Reserves and Commits run in steps of ``STEP_BLOCKS`` blocks: the same answers as in one
go, and another client's call is served between two steps of them (a real daemon on a real
socket)."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import grpc
import pytest

from tierd.daemon import chunks
from tierd.daemon.chunks import STEP_BLOCKS, run_now, run_steps

BIG = 3000  # blocks: about 12 steps; under the 16 MiB arena's 3640 blocks of 4 KiB
ATTEMPTS = 20  # commits tried until a lookup lands between two of a commit's steps: on a busy
#                host most commits show none, and the test is about whether any can


def test_a_big_reserve_and_commit_answer_as_one_step_would(
        make_daemon: Any, kit: Any, workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same 3000-block chain (every third block stored beforehand, some hashes repeated) is
    reserved and committed on a daemon that steps and on one that runs each call in one go:
    the same slots (already stored, no slot for repeats), the same blocks stored, the same
    tiers afterwards, and every table consistent."""
    answers = []
    for stepped in (True, False):
        if not stepped:  # the servicer drives the steps to the end at once
            async def at_once(steps: chunks.Steps[Any]) -> Any:
                return run_now(steps)
            monkeypatch.setattr("tierd.daemon.server.run_steps", at_once)
        name = "stepped" if stepped else "at-once"
        daemon = make_daemon(socket_path=os.path.join(workdir, f"{name}.sock"),
                             ssd_dir=os.path.join(workdir, name))
        chain = kit.chain(BIG, seed=3)
        asked = chain + chain[:5]  # repeats within the request get no slot
        with daemon.client() as client:
            engine = client.register_engine(kit.layout)
            arena = kit.attach(engine)
            assert kit.store_blocks(client, engine, arena, chain[::3]) == len(chain[::3])
            res = client.reserve(engine.engine_id, asked)
            stored = client.commit(engine.engine_id, res.lease_id,
                                   [s is not None for s in res.slot_ids])
            tiers = client.lookup(engine.engine_id, chain)
            answers.append(([s is None for s in res.slot_ids], res.already_stored, stored, tiers))
            arena.close()
        daemon.check_integrity()
    assert answers[0] == answers[1]
    no_slot, already, stored, tiers = answers[0]
    assert already == [i % 3 == 0 for i in range(BIG)] + [i % 3 == 0 for i in range(5)]
    assert no_slot == [i % 3 == 0 for i in range(BIG)] + [True] * 5
    assert stored == BIG - len(range(0, BIG, 3)) and tiers == ["dram"] * BIG


def test_another_clients_call_is_served_between_the_steps_of_a_commit(
        make_daemon: Any, kit: Any) -> None:
    """While one client commits 3000 blocks, another looks the same chain up again and again:
    some lookup is answered between two steps of the commit (a partial prefix, a multiple of
    the step, is DRAM), so the small call did not wait for the whole big one."""
    daemon = make_daemon()
    seen: set[int] = set()
    with daemon.client() as writer, daemon.client() as reader:
        engine = writer.register_engine(kit.layout)
        watcher = reader.register_engine(kit.layout)
        for attempt in range(ATTEMPTS):
            hashes = kit.chain(BIG, seed=10 + attempt)
            res = writer.reserve(engine.engine_id, hashes)
            done, started = threading.Event(), threading.Event()

            def watch(hashes: list[Any] = hashes) -> None:
                while not done.is_set():
                    seen.add(len(reader.lookup(watcher.engine_id, hashes)))
                    started.set()

            thread = threading.Thread(target=watch)
            thread.start()
            try:
                started.wait(10)  # the reader is under way before the commit is sent
                writer.commit(engine.engine_id, res.lease_id, [True] * BIG)
            finally:
                done.set()
                thread.join()
            if any(0 < n < BIG for n in seen):
                break
    partial = sorted(n for n in seen if 0 < n < BIG)
    assert partial, f"no lookup was answered during a commit (prefixes seen: {sorted(seen)})"
    assert all(n % STEP_BLOCKS == 0 for n in partial)
    daemon.check_integrity()


def test_a_commit_in_progress_cannot_be_committed_or_aborted_again(make_daemon: Any,
                                                                   kit: Any) -> None:
    """Between two steps of a commit its lease is still live, and a second Commit or an Abort
    of it is FAILED_PRECONDITION; the commit then finishes and stores every block."""
    daemon = make_daemon()
    store = daemon.daemon.store
    with daemon.client() as client:
        engine = client.register_engine(kit.layout)
        res = client.reserve(engine.engine_id, kit.chain(STEP_BLOCKS * 2, seed=7))

        async def interleaved() -> tuple[int, list[str]]:
            steps = store.commit_steps(res.lease_id, [1] * (STEP_BLOCKS * 2),
                                       engine_id=engine.engine_id)
            next(steps)  # the first step published; the lease holds the second's slots
            refused = []
            for again in (lambda: store.abort(res.lease_id, engine_id=engine.engine_id),
                          lambda: run_now(store.commit_steps(
                              res.lease_id, [1] * (STEP_BLOCKS * 2),
                              engine_id=engine.engine_id))):
                try:
                    again()
                except Exception as exc:  # noqa: BLE001  (the test names the kind below)
                    refused.append(type(exc).__name__)
            store.check_integrity()
            return await run_steps(steps), refused

        stored, refused = daemon.call(interleaved())
    assert stored == STEP_BLOCKS * 2 and refused == ["FailedPrecondition"] * 2
    with pytest.raises(grpc.RpcError) as info, daemon.client() as client:
        client.commit(engine.engine_id, res.lease_id, [True] * (STEP_BLOCKS * 2))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_lease_that_ends_between_steps_stops_them(make_daemon: Any, kit: Any) -> None:
    """A reserve whose engine is unregistered between two steps is NOT_FOUND and leaves no slot
    behind; a commit whose lease expires between two steps keeps the blocks its first step
    published and frees the rest. Every table is consistent after each."""
    daemon = make_daemon(lease_seconds=0.5)
    store = daemon.daemon.store
    with daemon.client() as client:
        gone = client.register_engine(kit.layout)
        engine = client.register_engine(kit.layout)
        res = client.reserve(engine.engine_id, kit.chain(STEP_BLOCKS * 2, seed=9))

        async def interleaved() -> tuple[str, int, list[str]]:
            steps = store.reserve_steps(gone.engine_id, kit.chain(STEP_BLOCKS * 2, seed=8))
            next(steps)
            store.unregister_engine(gone.engine_id)
            ended = _next_step(steps)
            store.check_integrity()
            commit = store.commit_steps(res.lease_id, [1] * (STEP_BLOCKS * 2),
                                        engine_id=engine.engine_id)
            next(commit)
            await asyncio.sleep(0.6)
            store.stats()  # expires the lease: its second half is freed
            stored = run_now(commit)
            store.check_integrity()
            return ended, stored, store.lookup(engine.engine_id, kit.chain(STEP_BLOCKS * 2,
                                                                           seed=9)).tiers

        ended, stored, tiers = daemon.call(interleaved())
    assert ended == "NotFound"
    assert stored == STEP_BLOCKS and tiers == ["dram"] * STEP_BLOCKS


def test_a_blank_reserve_runs_in_steps_and_stops_when_its_engine_goes(make_daemon: Any,
                                                                       kit: Any) -> None:
    """A blank Reserve of two steps' slots yields between them: unregistering its engine
    there is NOT_FOUND and leaves no slot and no quota hold behind; driven to the end, it grants
    every slot, each a different one, and a Commit names them all."""
    daemon = make_daemon()
    store = daemon.daemon.store
    count = STEP_BLOCKS + STEP_BLOCKS // 2
    with daemon.client() as client:
        gone = client.register_engine(kit.layout)
        engine = client.register_engine(kit.layout)

        async def interleaved() -> tuple[str, Any]:
            steps = store.reserve_blank_steps(gone.engine_id, count)
            next(steps)
            store.check_integrity()
            store.unregister_engine(gone.engine_id)
            ended = _next_step(steps)
            store.check_integrity()
            res = await run_steps(store.reserve_blank_steps(engine.engine_id, count))
            store.check_integrity()
            return ended, res

        ended, res = daemon.call(interleaved())
        assert ended == "NotFound"
        slots = [s for s in res.slot_ids if s is not None]
        assert len(slots) == count == len(set(slots))
        names = kit.chain(count, seed=7)
        client.commit(engine.engine_id, res.lease_id, [True] * count, names=names)
        assert client.lookup(engine.engine_id, names) == ["dram"] * count
    daemon.check_integrity()


def _next_step(steps: Any) -> str:
    """Run one more step: "went on", or the name of the exception it raised."""
    try:
        next(steps)
    except Exception as exc:  # noqa: BLE001  (the tests name the kind)
        return type(exc).__name__
    return "went on"
