"""The one-pass store (``checksummed_copy``): strided engine rows land in their slots back to
back, with the checksums every reader computes."""

from __future__ import annotations

import pytest
import torch

from tierd.checksum import block_checksum
from tierd.connector.native import checksummed_copy
from tierd.connector.native.verified_copy import BlockRows, available


@pytest.mark.skipif(not available(), reason="no C compiler: the Python path is used")
@pytest.mark.parametrize("threads", [1, 2])
def test_strided_rows_land_in_slot_order_with_their_checksums(threads: int) -> None:
    """Blocks 3, 0, 5 of a [layers=4, blocks=6, heads=2, row=4096] pool (K/V-like head pairs
    inside each layer) land in three slots in (layer, head) order; each checksum is the slot's."""
    pool = torch.randint(0, 256, (4, 6, 2, 4096), dtype=torch.uint8)
    rows = BlockRows(pool.data_ptr(), 6, 4, 2, 1, 4096, *[pool.stride(0), pool.stride(1),
                                                         pool.stride(2)], 0)
    slots = torch.zeros(3, 4 * 2 * 4096, dtype=torch.uint8)
    sums = checksummed_copy.store_checksummed(rows, [3, 0, 5],
                                              [slots[i].data_ptr() for i in range(3)],
                                              threads=threads)
    for i, block in enumerate([3, 0, 5]):
        assert torch.equal(slots[i], pool[:, block].reshape(-1))
    assert sums == [block_checksum(slots[i].numpy().tobytes()) for i in range(3)]


def test_block_ids_out_of_range_are_refused() -> None:
    """A block id outside the pool is a ValueError, nothing copied."""
    rows = BlockRows(0, 2, 1, 1, 1, 64, 0, 64, 0, 0)
    with pytest.raises(ValueError, match="engine block ids"):
        checksummed_copy.store_checksummed(rows, [2], [0])
