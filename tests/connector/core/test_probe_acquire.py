"""``probe_acquire``: a Probe alone for a DRAM hit or a miss; where the held prefix reaches past
the DRAM run, an Acquire of the whole held prefix and a Release of the Probe's lease (so exactly
one lease is left pinned), that Release sent without waiting, even when the Acquire fails."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import grpc
import pytest

from tierd.connector.core.lease import probe_acquire
from tierd.types import BlockHash, Tier
from tierd.wire.replies import AcquiredBlocks

HASHES = [BlockHash(bytes([i]) * 32) for i in range(6)]


class FakeClient:
    """Answers a Probe with ``dram`` pinned blocks and ``after`` held behind them; records the
    calls; an Acquire raises ``fail`` when set."""

    def __init__(self, dram: int, after: list[Tier], fail: grpc.RpcError | None = None) -> None:
        self.dram, self.after, self.fail = dram, after, fail
        self.calls: list[tuple[str, object]] = []

    def probe(self, engine_id: str, hashes: Sequence[BlockHash]) -> AcquiredBlocks:
        self.calls.append(("probe", len(hashes)))
        return AcquiredBlocks("p" if self.dram else "", 30.0, list(range(self.dram)),
                              [7] * self.dram, held_after=list(self.after))

    def acquire(self, engine_id: str, hashes: Sequence[BlockHash]) -> AcquiredBlocks:
        self.calls.append(("acquire", len(hashes)))
        if self.fail is not None:
            raise self.fail
        return AcquiredBlocks("a", 30.0, list(range(len(hashes))), [7] * len(hashes))

    def release_async(self, engine_id: str, lease_id: str, *,
                      corrupt_from: int | None = None) -> Future[bool]:
        self.calls.append(("release", lease_id))
        sent: Future[bool] = Future()
        sent.set_result(False)
        return sent


@pytest.mark.parametrize("dram", [0, 4])
def test_a_dram_hit_or_a_miss_is_one_probe(dram: int) -> None:
    """Nothing held after the DRAM run: the Probe's lease is the answer, no other call."""
    client = FakeClient(dram, [])
    lease = probe_acquire(client, "e", HASHES, clock=lambda: 100.0)  # type: ignore[arg-type]
    assert (lease.lease_id, lease.num_blocks, lease.deadline) == ("p" if dram else "", dram, 130.0)
    assert client.calls == [("probe", 6)]


def test_a_hit_reaching_ssd_acquires_the_held_prefix_and_releases_the_probe() -> None:
    """2 in DRAM, 3 on SSD behind them: Acquire of the 5 held, then Release of the Probe's."""
    client = FakeClient(2, ["ssd", "ssd", "ssd"])
    lease = probe_acquire(client, "e", HASHES, clock=lambda: 0.0)  # type: ignore[arg-type]
    assert (lease.lease_id, lease.num_blocks) == ("a", 5)
    assert client.calls == [("probe", 6), ("acquire", 5), ("release", "p")]


def test_a_failed_acquire_still_releases_the_probe() -> None:
    """The Acquire's error reaches the caller; the Probe's lease was released first."""
    client = FakeClient(2, ["ssd"], fail=grpc.RpcError())
    with pytest.raises(grpc.RpcError):
        probe_acquire(client, "e", HASHES, clock=lambda: 0.0)  # type: ignore[arg-type]
    assert client.calls == [("probe", 6), ("acquire", 3), ("release", "p")]
