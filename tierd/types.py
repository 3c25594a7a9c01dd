"""Key types shared by every tier: block hashes and the namespaces that scope them.

Hash keys are their own types, never bare ``bytes``/ints/tuples, so a raw digest cannot be passed
where a tenant-scoped key is expected. Composite keys are built and taken apart only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NewType

BlockHash = NewType("BlockHash", bytes)
"""Digest of one full block, chained over its parent (see ``tierd.hashing``). 32 bytes for
``sha256_cbor``, 16 for ``xxhash_cbor``."""

Namespace = NewType("Namespace", bytes)
"""Opaque scope of an index entry: tenant plus the engine layout's fingerprint. Two models,
two TP ranks or two tenants never share a namespace."""

NamespacedKey = NewType("NamespacedKey", bytes)
"""``namespace || block hash``: the key of a block in a node's index and in the cluster."""


HASH_LENGTHS = (32, 16)
"""Accepted block hash sizes: sha256_cbor (32 bytes) and xxhash_cbor (16 bytes)."""
_LENGTHS = frozenset(HASH_LENGTHS)


def make_keys(namespace: Namespace, hashes: Sequence[BlockHash]) -> list[NamespacedKey]:
    """``make_key`` of each hash, after checking each is ``bytes`` of an accepted length
    (ValueError naming the first that is not)."""
    if not (set(map(type, hashes)) <= {bytes} and set(map(len, hashes)) <= _LENGTHS):
        for i, h in enumerate(hashes):  # find the culprit (a subclass of bytes passes)
            if not isinstance(h, bytes) or len(h) not in HASH_LENGTHS:
                got = len(h) if isinstance(h, bytes) else type(h).__name__
                raise ValueError(f"block hash #{i} has {got} bytes; expected 32 (sha256_cbor) "
                                 "or 16 (xxhash_cbor)")
    return [NamespacedKey(namespace + h) for h in hashes]


def make_key(namespace: Namespace, block_hash: BlockHash) -> NamespacedKey:
    """Join a namespace and a block hash into one index key (namespace is fixed-length)."""
    return NamespacedKey(namespace + block_hash)


def split_key(key: NamespacedKey, namespace_len: int) -> tuple[Namespace, BlockHash]:
    """Undo ``make_key`` for a namespace of ``namespace_len`` bytes."""
    return Namespace(key[:namespace_len]), BlockHash(key[namespace_len:])


Tier = Literal["hbm", "dram", "ssd", "remote"]
"""Where a block lives: engine GPU pool (hot), the daemon's shared-memory arena (warm), its SSD
directory (cold), or the cluster's optional shared remote tier. Ordered fastest first."""

TIERS: tuple[Tier, ...] = ("hbm", "dram", "ssd", "remote")


@dataclass(frozen=True, slots=True)
class Placement:
    """One node's holding of a prompt's chain, as the cluster directory's ``locate`` ranks it
    (here, not in ``tierd.cluster``, so clients read it without importing the Redis side)."""

    node_id: str
    address: str
    prefix_blocks: int              # consecutive blocks from the chain's start it holds
    tiers: tuple[Tier, ...]         # tier of each of those blocks, in chain order
    score: float                    # sum of the tier weights of those blocks
    capacity_bytes: int
    heartbeat_age_s: float
