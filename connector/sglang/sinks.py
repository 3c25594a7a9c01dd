"""The load ``Sink``s (``tierd.connector.core.load``) of SGLang's host pages.

``HostPages``: the v1 zero-copy calls' destination, host pages by page number. Each slot is
checked while it is copied into its page's runs, in one pass (``native.verified_copy`` over
``PageFormat.rows``); without the native helper every slot is verified where it lies, then the
verified ones are copied.

``FlatPages``: the legacy calls' destination, one flat page tensor per key (SGLang's
``get_dummy_flat_data_page``): the slots are verified where they lie, then each verified one is
copied into its flat page in flat order (``PageFormat.slot_to_flat``).

Both copy synchronously (``settle`` has nothing to wait for).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierd.connector.core.arena_slots import ArenaSlots

from .pages import PageFormat


class HostPages:
    """Loads into host pages ``block_ids`` (page numbers of the registered pool)."""

    def __init__(self, fmt: PageFormat) -> None:
        self.format = fmt

    def place(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
              block_ids: Sequence[int]) -> int:
        fmt = self.format
        good = slots.load_verified(slot_ids, checksums, fmt.rows, block_ids)
        if good is None:  # no native helper: verify in place, then copy the verified run
            good = slots.verified(slot_ids, checksums)
            fmt.copy_in(block_ids[:good], [_address(slots, s) for s in slot_ids[:good]])
        return good

    def settle(self) -> None:
        """Nothing to wait for: ``place`` copies synchronously."""


class FlatPages:
    """Loads into ``targets[block_id]``, flat pages of the legacy calls."""

    def __init__(self, fmt: PageFormat, targets: Sequence[torch.Tensor]) -> None:
        self.format, self.targets = fmt, list(targets)

    def place(self, slots: ArenaSlots, slot_ids: Sequence[int], checksums: Sequence[int],
              block_ids: Sequence[int]) -> int:
        good = slots.verified(slot_ids, checksums)
        for slot, target in zip(slot_ids[:good], block_ids[:good]):
            at = slots.geometry.offset(slot)
            self.format.slot_to_flat(slots.arena[at:at + slots.slot_bytes], self.targets[target])
        return good

    def settle(self) -> None:
        """Nothing to wait for: ``place`` copies synchronously."""


def _address(slots: ArenaSlots, slot: int) -> int:
    return slots.arena.data_ptr() + slots.geometry.offset(slot)
