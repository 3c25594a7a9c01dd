"""Batched reads (``read_many``): mixed hits and misses in request order, adjacent records coalesced
into one preadv, runs split into read tasks by bytes, a bad target rejected before any read."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
from store_kit import BLOCK, NS, aligned, flip, h, payload

from tierd.checksum import block_checksum
from tierd.daemon.ssd import SsdStore
from tierd.daemon.ssd.index import batches
from tierd.daemon.ssd.record import HEADER_BYTES


async def test_read_many_mixed_batch(store: SsdStore) -> None:
    """One batch: intact blocks read back bit-exact, a missing one and a corrupt one are misses
    (the corrupt record dropped and counted), in request order."""
    for i in range(4):
        assert await store.write(NS, h(i), payload(i), block_checksum(payload(i))) is not None
    flip(store, h(2), HEADER_BYTES + 7, 0x01)
    keys = [h(0), h(9), h(2), h(1), h(3)]
    into = [bytearray(BLOCK) for _ in keys]
    futures = store.read_many([(NS, k, memoryview(b)) for k, b in zip(keys, into)])
    assert await asyncio.gather(*futures) == [True, False, False, True, True]
    assert [bytes(into[i]) for i in (0, 3, 4)] == [bytes(payload(i)) for i in (0, 1, 3)]
    assert (store.checksum_failures, store.contains(NS, h(2)), len(store)) == (1, False, 3)
    store.check_integrity(disk=True)


@pytest.mark.parametrize("target", ["aligned", "bytearray"])
async def test_read_many_coalesces_adjacent_records(tmp_path: Path, target: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """24 records written as one batch and one written later, not adjacent, requested
    shuffled: the batch's records are one run read by one preadv (straight into page-aligned
    slots or into plain buffers), the late one a second; every block bit-exact."""
    store = SsdStore(tmp_path, 4 << 20)
    store.open()
    n = 24  # 1.5 MiB: within RUN_BYTES
    src = aligned(n * BLOCK)
    for i in range(n):
        src[i * BLOCK:(i + 1) * BLOCK] = payload(i)
    blocks = [(NS, h(i), src[i * BLOCK:(i + 1) * BLOCK], block_checksum(payload(i)))
              for i in range(n)]
    assert all(await store.write_many(blocks))
    for i in (n + 1, n):  # n + 1 is never read: n is not adjacent to the batch
        assert await store.write(NS, h(i), payload(i), block_checksum(payload(i)))
    order = list(range(n + 1))
    random.Random(7).shuffle(order)
    dst = aligned((n + 1) * BLOCK)
    into = ([dst[i * BLOCK:(i + 1) * BLOCK] for i in range(n + 1)] if target == "aligned"
            else [memoryview(bytearray(BLOCK)) for _ in range(n + 1)])
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    ok = await asyncio.gather(*store.read_many([(NS, h(i), into[i]) for i in order]))
    monkeypatch.undo()
    assert ok == [True] * (n + 1)
    assert all(bytes(into[i]) == bytes(payload(i)) for i in range(n + 1))
    assert sorted(calls) == [2, 2 * n]  # header + payload per record (64 KiB: no padding)
    store.check_integrity(disk=True)
    store.close()


def test_read_tasks_split_runs_by_bytes_none_empty() -> None:
    """Runs go to at most ``most`` tasks of about ``least`` bytes or more, in order: four full
    runs and a small last one get five tasks (the small one alone, not queued behind a full
    one); 128 equal runs get five of 25-26; tasks are never empty nor more than ``most``."""
    full, small = 2047488, 264192  # 31 and 4 records of 64 KiB
    assert batches(list("abcde"), [full] * 4 + [small], 2 << 20, 8) == [
        ["a"], ["b"], ["c"], ["d"], ["e"]]
    assert [len(t) for t in batches(list(range(128)), [66048] * 128, 2 << 20, 8)] == [
        26, 26, 25, 26, 25]
    assert batches(list(range(8)), [1] * 8, 1, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert batches([1, 2, 3], [1, 1, 10], 1, 2) == [[1, 2], [3]]
    assert batches([1], [5], 100, 8) == [[1]] and batches([], [], 100, 8) == []


async def test_read_many_bad_target_starts_nothing(store: SsdStore) -> None:
    """A wrong-sized target anywhere in the batch raises before any read starts."""
    await store.write(NS, h(0), payload(0), block_checksum(payload(0)))
    good = bytearray(BLOCK)
    with pytest.raises(ValueError, match="exactly one slot"):
        store.read_many([(NS, h(0), memoryview(good)), (NS, h(0), memoryview(bytearray(7)))])
    assert good == bytes(BLOCK)
    store.check_integrity(disk=True)

