"""One step's save in a vLLM worker, as ``worker.WorkerSide`` carries it from the Reserve sent
before the forward pass (or the slots taken from its stock) to the Commit handed over at
``wait_for_save``: ``Asked`` (the Reserve in flight), ``PendingSave`` (its answer, or the stock's
slots, laid out for the copy), ``StepSave`` (the step's
whole save state) and ``LateSave`` (a step's save closed after the step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from tierd.connector.core.link import Session
from tierd.connector.core.save import Reservation
from tierd.types import BlockHash
from tierd.wire.geometry import SlotGeometry
from tierd.wire.replies import ReservedSlots
from tierd.wire.sent import Sent

from .kv_tensors import Run, runs
from .metadata import SaveSpec
from .sinks import DeviceLoads
from .step_stock import Taken


@dataclass(slots=True)
class PendingSave:
    """One step's reservation while the layers are being copied into it."""

    reservation: Reservation
    targets: list[tuple[int, int]]      # (index in the reservation, slot byte offset)
    block_runs: list[Run]
    owners: list[str]                   # per target, the request it belongs to
    renew_at: float                     # half its lease gone: re-offered at ``finish_save``
    counts: list[tuple[str, int]]       # what reserving it counted (undone if re-offered)
    device: DeviceLoads | None = None   # CUDA: its transfer holds the open save
    taken: Taken | None = None          # its slots are a stock's (``step_stock``), named ...
    names: list[BlockHash] = field(default_factory=list)  # ... with these hashes once written

    @classmethod
    def stocked(cls, taken: Taken, geometry: SlotGeometry, saves: list[SaveSpec],
                block_ids: list[int], slot_bytes: int) -> PendingSave:
        """``saves``' blocks (``block_ids``, in order) laid out for the copy into the stock's
        slots ``taken``."""
        reservation = taken.stock.reservation
        assert reservation is not None
        first = taken.first
        offset = geometry.offset
        offsets = [offset(cast(int, slot))
                   for slot in reservation.slot_ids[first:first + taken.count]]
        return cls(reservation, list(zip(range(first, first + taken.count), offsets)),
                   runs(block_ids, offsets, slot_bytes),
                   [spec.req_id for spec in saves for _ in spec.block_ids],
                   taken.stock.renew_at, [], taken=taken,
                   names=cast("list[BlockHash]",  # NewType of bytes: the same objects
                              [h for spec in saves for h in spec.block_hashes]))

    def written(self) -> list[bool]:
        """The Commit's written flags: True where a slot was reserved (and every layer copied
        into it); the daemon checksums those slots itself."""
        out = [False] * len(self.reservation.slot_ids)
        for index, _ in self.targets:
            out[index] = True
        return out

    def owner_of_each(self) -> list[str]:
        """Per reserved block, the request it belongs to ("" for one without a slot)."""
        out = [""] * len(self.reservation.slot_ids)
        for (index, _), req_id in zip(self.targets, self.owners):
            out[index] = req_id
        return out


@dataclass(frozen=True, slots=True)
class Asked:
    """A step's Reserve in flight, and what its answer is for."""

    session: Session
    reply: Sent[ReservedSlots]
    asked: float                        # clock time it was sent (its lease runs from here)
    block_ids: list[int]                # vLLM block of each hash asked for
    owners: list[str]                   # per hash asked for, the request it belongs to
    counts: list[tuple[str, int]]       # what the save counted so far


@dataclass(slots=True)
class StepSave:
    """This step's save: ``tried`` once its saves were taken and their Reserve sent (``asked``
    until answered, then ``pending``: None if it failed or nothing is to be written);
    ``layers``: those handed over by ``save_layer``; ``lease_lost``: the step's saves are
    dropped."""

    tried: bool = False
    asked: Asked | None = None
    pending: PendingSave | None = None
    layers: set[int] = field(default_factory=set)
    lease_lost: bool = False            # a lease of this step's (CUDA) loads ran out
    saves: list[SaveSpec] = field(default_factory=list)  # the step's accepted saves


@dataclass(frozen=True, slots=True)
class LateSave:
    """A step's save (host KV) after ``wait_for_save``: closed (answer read, copy, Commit) by
    the committer thread, or at the next step's ``begin`` if that comes first."""

    step: StepSave
    lease_lost: bool                    # the step's saves are dropped
    number: int                         # the step (``TierdConnectorMetadata.step``)
