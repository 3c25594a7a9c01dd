"""``DirtyBlocks``: the scheduler side's record of write-back saves (``save_policy:
write_back``): a full block vLLM computes is written to tierd not when it is computed but when
vLLM gives its memory to other tokens, so nothing is copied while vLLM's own cache holds the
working set.

vLLM keeps a freed block's KV (and its hash, as a prefix-cache entry) until it takes the block
from its free queue for new tokens, and that allocation shows in the step's ``SchedulerOutput``:
the block id is among the new block ids of a scheduled request. So the scheduler side keeps,
per vLLM block id, the full block last computed there and not yet saved (``computed``). When
that id comes back among a request's new blocks at a position whose hash is another (the
forward pass or a load is about to write other tokens there), the block is saved first
(``reallocated``): the save goes to the workers in the step's ``evicted``, and each worker
copies it out in its first hook of the step, before anything of that step writes vLLM's KV. An
id listed again under its own hash (a local prefix-cache hit, a resumed request's own blocks)
still holds that KV and stays dirty.

Nothing computed on a failed load is saved: an entry remembers the blocks of loads not yet
reported when it was computed (``SaveSpec.depends_on``); ``failed`` forgets every entry that
sits on a failed one, and an eviction names those still unreported, which the workers check as
for any save.

Bounded: one entry per vLLM block id at most. What is dirty when the engine stops is not saved,
nor what is dirty when vLLM empties its prefix cache with its connector's (``clear``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .metadata import SaveSpec


@dataclass(frozen=True, slots=True)
class _Dirty:
    """A full block computed in a vLLM block and not saved yet."""

    req_id: str                    # the request that computed it
    block_hash: bytes
    depends_on: tuple[int, ...]    # blocks of loads unreported when it was planned


class DirtyBlocks:
    """vLLM block id -> the unsaved full block it holds; see the module doc. Scheduler thread
    only."""

    def __init__(self) -> None:
        self._blocks: dict[int, _Dirty] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def computed(self, spec: SaveSpec) -> None:
        """The step being built completes ``spec``'s blocks: remember them instead of saving."""
        depends = tuple(spec.depends_on)
        for block_id, block_hash in zip(spec.block_ids, spec.block_hashes):
            self._blocks[block_id] = _Dirty(spec.req_id, block_hash, depends)

    def reallocated(self, block_ids: Sequence[int], first: int, hashes: Sequence[bytes],
                    out: dict[str, SaveSpec]) -> None:
        """``block_ids`` are new this step in a request's table from position ``first`` on
        (``hashes``: the request's block hashes): each that holds a dirty block of another
        hash is evicted, its save added to ``out`` (per request that computed it) and
        forgotten."""
        get = self._blocks.get
        known = len(hashes)
        for position, block_id in enumerate(block_ids, first):
            dirty = get(block_id)
            if dirty is None or (position < known and hashes[position] == dirty.block_hash):
                continue
            del self._blocks[block_id]
            spec = out.get(dirty.req_id)
            if spec is None:
                spec = out[dirty.req_id] = SaveSpec(dirty.req_id, [], [], [])
            spec.block_ids.append(block_id)
            spec.block_hashes.append(dirty.block_hash)
            spec.depends_on.extend(b for b in dirty.depends_on if b not in spec.depends_on)

    def clear(self) -> None:
        """Forget every dirty block unsaved (vLLM emptied its prefix cache and asked its
        connector to do likewise)."""
        self._blocks.clear()

    def failed(self, blocks: Collection[int]) -> None:
        """Loads of ``blocks`` failed: forget every dirty block planned on one of them."""
        bad = [block_id for block_id, dirty in self._blocks.items()
               if any(b in blocks for b in dirty.depends_on)]
        for block_id in bad:
            del self._blocks[block_id]

    def unreported(self, specs: dict[str, SaveSpec], loading: Collection[int]
                   ) -> list[SaveSpec]:
        """``specs`` as the step's ``evicted``, each naming only the loads in ``loading``
        (those not reported yet) among the blocks it sits on."""
        for spec in specs.values():
            spec.depends_on[:] = [b for b in spec.depends_on if b in loading]
        return list(specs.values())
