"""The one save of every front end: Reserve, copy into the reserved slots, Commit or Abort.

``reserve`` asks the daemon for a DRAM slot per block it does not hold yet. The front end
copies each block's bytes into its slot (``write_rows`` for rows staged on the host; vLLM copies
layer by layer, ``vllm.connector``), then ``commit`` names the slots it wrote (``written``
flags) and the daemon checksums those bytes itself, in its own process, off the engine's path;
the blocks become visible to other engines only whole, when the Commit lands. A save that cannot
finish (a layer never arrived, a load it depends on failed) calls ``abort`` instead, or commits
with those blocks' flags False. A reservation that is neither committed nor aborted lapses on
the daemon after its lease time.

Engines never send checksums: the daemon refuses a Commit carrying the retired ``blocks``
field (INVALID_ARGUMENT; the field stays in ``proto/tierd/v1/tierd.proto`` so its number is
never reused).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tierd.connector.core.arena_slots import ArenaSlots
from tierd.types import BlockHash
from tierd.wire.client import CommitRefused, TierdClient
from tierd.wire.replies import ReservedSlots


@dataclass(frozen=True, slots=True)
class Reservation:
    """Slots reserved for a save: ``slot_ids[i]`` is where block ``i`` of the request goes, or
    None (``already_stored[i]``: the daemon holds it; else no room: a future miss)."""

    engine_id: str
    lease_id: str
    slot_ids: list[int | None]
    already_stored: list[bool]
    seconds_left: float = float("inf")
    """The lease the daemon granted (commit or abort before it runs out, counted from when the
    Reserve was sent)."""

    @property
    def targets(self) -> list[int]:
        """Indices of the blocks that have a slot to write."""
        return [i for i, s in enumerate(self.slot_ids) if s is not None]

    def all_written(self) -> list[bool]:
        """``written`` flags for a save that copied every block that had a slot."""
        return [s is not None for s in self.slot_ids]


def reserve(client: TierdClient, engine_id: str, hashes: Sequence[BlockHash], *,
            filtered_query_tokens: int = 0) -> Reservation:
    """One Reserve round trip (see the module doc). ``filtered_query_tokens``: lookups the
    engine answered from the presence filter since its last Reserve, for the node's hit
    ratio. Raises ``grpc.RpcError``."""
    return reservation_of(engine_id, client.reserve(
        engine_id, hashes, filtered_query_tokens=filtered_query_tokens))


def reservation_of(engine_id: str, got: ReservedSlots) -> Reservation:
    """The ``Reservation`` of a Reserve answer ``got`` (``TierdClient.reserve_async``'s)."""
    return Reservation(engine_id, got.lease_id, list(got.slot_ids), list(got.already_stored),
                       got.seconds_left)


def write_rows(slots: ArenaSlots, slot_ids: Sequence[int | None], rows: torch.Tensor) -> None:
    """Copy staged host row ``i`` into ``slot_ids[i]`` (None: skipped). Plain memcpys, no torch
    op: safe on a background thread beside the engine's compute. ``ValueError`` for slot ids
    outside the mapped arena."""
    slots.write(slot_ids, rows)


def commit(client: TierdClient, reservation: Reservation, written: Sequence[bool],
           names: Sequence[BlockHash] = ()) -> int:
    """One Commit round trip publishing the slots flagged in ``written`` (one flag per
    reserved block; a block without a slot must be False); the daemon checksums them.
    ``names``: for blank slots (``core.stock``) the hash of each written slot's block, in slot
    order. Returns how many blocks became stored. Raises ``grpc.RpcError``
    (FAILED_PRECONDITION / NOT_FOUND: the reservation had lapsed)."""
    return client.commit(reservation.engine_id, reservation.lease_id, written, names)


def commit_many(client: TierdClient,
                commits: Sequence[tuple[Reservation, Sequence[bool], Sequence[BlockHash]]]
                ) -> list[int | CommitRefused]:
    """``commit`` of each (reservation, written, names) in one round trip (at most 64, all of
    one engine): per Commit, the blocks stored or its own failure (``CommitRefused``:
    FAILED_PRECONDITION or NOT_FOUND where its reservation had lapsed). Raises
    ``grpc.RpcError`` if the call itself fails."""
    if not commits:
        return []
    return client.commit_many(commits[0][0].engine_id,
                              [(r.lease_id, written, names) for r, written, names in commits])


def commit_async(client: TierdClient, reservation: Reservation,
                 written: Sequence[bool]) -> Future[int]:
    """``commit`` without waiting while the daemon checksums: a future of the blocks stored
    (or of the ``grpc.RpcError``). For a front end whose caller may reuse its memory once the
    copy is done (SGLang's backup): the next batch's copy overlaps this one's checksums. The
    blocks are visible to lookups only when the future is done."""
    return client.commit_async(reservation.engine_id, reservation.lease_id, written)


def abort(client: TierdClient, reservation: Reservation) -> None:
    """One Abort round trip: free the reservation's slots, storing nothing. Raises
    ``grpc.RpcError``."""
    client.abort(reservation.engine_id, reservation.lease_id)
