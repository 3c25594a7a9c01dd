"""The block-hash contract: chained hashes over full token blocks, bit-identical to vLLM 0.33.

Block ``i`` of a prompt hashes ``(parent, tuple(block_token_ids), extra_keys or None)`` where the
parent is block ``i-1``'s hash (``NONE_HASH`` for block 0). Only **full** blocks are hashed; the
trailing partial block never is. ``sha256_cbor`` (the default) is SHA-256 over the canonical CBOR
encoding of that 3-tuple, exactly vLLM's ``--prefix-caching-hash-algo sha256_cbor``;
``xxhash_cbor`` is XXH3-128 over the same bytes (opt-in: not collision resistant).

Extra keys are vLLM 0.33's tagged tuples, in its order: ``("lora", name, path)`` (every block),
``("mm", identifier, offset from block start)`` per overlapping multimodal item,
``("cache_salt", salt)`` (block 0 only; the chain carries it), ``("prompt_embeds", sha256)``.
They are built in ``tierd.extra_keys``; ``VLLM_HASH_CONTRACT`` names the vLLM release whose
contract this is. See ``docs/hashing.md``.

Every block is encoded by ``cbor2.dumps(..., canonical=True)``, as vLLM encodes it;
``tests/test_hashing.py`` checks known answers, ``tests/vllm/`` checks against vLLM itself.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Literal, cast, get_args

import cbor2
import xxhash

from tierd.extra_keys import (
    EventExtraKey,
    ExtraKey,
    ExtraKeys,
    MultiModalItem,
    request_keys,
    to_event_extra_keys,
)
from tierd.types import BlockHash

__all__ = [
    "BLOCK_SIZES", "DEFAULT_SEED", "HASH_ALGOS", "MAX_TOKEN_ID", "VLLM_HASH_CONTRACT",
    "BlockHasher", "EventExtraKey", "ExtraKey", "ExtraKeys", "HashAlgo", "MultiModalItem",
    "block_hashes", "encode_block", "hash_block", "none_hash", "request_keys",
    "to_event_extra_keys",
]  # fmt: skip

VLLM_HASH_CONTRACT: Final = "0.33"
"""The vLLM release whose block-hash contract tierd speaks (tagged extra keys, the LoRA path).
Blocks with extra keys hash differently under vLLM releases before 0.33 (untagged keys)."""

HashAlgo = Literal["sha256_cbor", "xxhash_cbor"]
"""``sha256_cbor``: SHA-256 of canonical CBOR (32-byte hashes, the default, multi-tenant safe).
``xxhash_cbor``: XXH3-128 of the same bytes (16-byte hashes; trusted single-tenant input only)."""

HASH_ALGOS: Final[tuple[HashAlgo, ...]] = get_args(HashAlgo)
BLOCK_SIZES: Final[tuple[int, ...]] = (8, 16, 32, 64, 128)
DEFAULT_SEED: Final = "vllm-none-hash"
"""vLLM's NONE_HASH seed when ``PYTHONHASHSEED`` is unset (sha256 family); ours whatever the
environment says."""
MAX_TOKEN_ID: Final = 2**32 - 1

_log = logging.getLogger(__name__)
_TOKEN_TYPECODE: Final = "I"
assert array(_TOKEN_TYPECODE).itemsize == 4, "array('I') must hold exactly uint32 token ids"


def _check_algo(algo: str) -> HashAlgo:
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown hash algorithm {algo!r}; use one of {', '.join(HASH_ALGOS)}")
    if algo == "xxhash_cbor":
        _warn_xxhash()
    return algo


@functools.cache
def _warn_xxhash() -> None:
    # functools.cache makes this log once per process.
    _log.warning(
        "xxhash_cbor is not collision resistant: crafted prompts can collide with another "
        "tenant's blocks. Use it only for trusted single-tenant input; sha256_cbor is the default."
    )


def _digest(algo: HashAlgo, data: bytes) -> bytes:
    if algo == "sha256_cbor":
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


@functools.lru_cache(maxsize=16)
def none_hash(seed: str | None = None, algo: HashAlgo = "sha256_cbor") -> BlockHash:
    """``NONE_HASH = H(seed)``: the parent of every chain's block 0.

    ``seed`` defaults to ``"vllm-none-hash"`` and never reads ``PYTHONHASHSEED``, so every
    process agrees. To match a vLLM started with ``PYTHONHASHSEED=S``, pass ``seed="S"``.
    """
    _check_algo(algo)
    text = DEFAULT_SEED if seed is None else seed
    return BlockHash(_digest(algo, cbor2.dumps(text, canonical=True)))


def encode_block(parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> bytes:
    """The bytes that get hashed, by ``cbor2`` itself: ``cbor2.dumps((parent,
    tuple(token_ids), extra_keys), canonical=True)``."""
    return bytes(cbor2.dumps((parent, tuple(token_ids), extra_keys), canonical=True))


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
    *,
    algo: HashAlgo = "sha256_cbor",
    seed: str | None = None,
) -> BlockHash:
    """Hash one full block the way vLLM's ``hash_block_tokens`` does, through ``cbor2``.

    A falsy ``parent`` means block 0 (``NONE_HASH`` for ``seed``). Prompts go through
    ``block_hashes`` / ``BlockHasher``, which validate the token ids.
    """
    algo = _check_algo(algo)
    root = parent if parent else none_hash(seed, algo)
    return BlockHash(_digest(algo, encode_block(root, token_ids, extra_keys)))


def _check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block size {block_size!r} is not supported; use one of "
            f"{', '.join(map(str, BLOCK_SIZES))} (16 is vLLM's default)"
        )


def _as_tokens(token_ids: Iterable[int]) -> list[int]:
    """Token ids as plain ints, checked to be uint32 in one C-level pass (``array('I')``):
    NumPy ints, tensors and bools hash as the ints they equal."""
    tolist = getattr(token_ids, "tolist", None)  # NumPy arrays and torch tensors
    if tolist is not None:
        token_ids = tolist()
    try:
        return array(_TOKEN_TYPECODE, token_ids).tolist()
    except (TypeError, OverflowError) as exc:
        raise ValueError(
            f"token ids must be integers in [0, {MAX_TOKEN_ID}] ({exc}); pass tokenizer ids"
        ) from None


class BlockHasher:
    """Incremental block hashing for one request: feed tokens, get each newly full block's hash.

    ``append`` keeps the partial tail until it fills up, so decode can feed one token at a time;
    a partial block is never hashed. The hashes are identical to ``block_hashes`` over all the
    tokens fed so far, whatever the chunking, and to vLLM 0.33's ``get_request_block_hasher``
    for a request with the same inputs. Not thread-safe; cheap to create (one per request).

    Positions in ``mm_features`` and ``prompt_embeds`` (one row per prompt token) count from the
    first token fed. ``parent`` continues an existing chain: then the first block is not the
    request's block 0, so ``cache_salt`` (block 0 only, as in vLLM) is not added again.
    ``lora_name`` and ``lora_path`` are vLLM's ``LoRARequest`` fields: give both.
    """

    __slots__ = (
        "block_size", "algo", "num_blocks", "keys", "_pending", "_parent", "_digest",
        "_mm_cursor", "_per_block", "_first_keys", "_rest_keys",
    )  # fmt: skip

    def __init__(
        self,
        block_size: int = 16,
        *,
        algo: HashAlgo = "sha256_cbor",
        seed: str | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MultiModalItem] | None = None,
        prompt_embeds: Any = None,
        parent: BlockHash | None = None,
        lora_path: str | None = None,
    ) -> None:
        _check_block_size(block_size)
        self.block_size: Final = block_size
        self.algo: Final = _check_algo(algo)
        self.num_blocks = 0
        """Full blocks hashed so far; the next block starts at token ``num_blocks*block_size``."""
        self.keys: Final = request_keys(
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            mm_features=mm_features,
            prompt_embeds=prompt_embeds,
            from_block_0=not parent,
        )
        """The request's extra-key inputs; ``keys.for_block`` gives any block's extra keys."""
        self._pending: list[int] = []  # fed tokens not yet in a hashed block
        self._parent: bytes = parent if parent else none_hash(seed, self.algo)
        self._digest: Callable[[bytes], bytes] = (
            _sha256 if self.algo == "sha256_cbor" else xxhash.xxh3_128_digest)
        self._mm_cursor = 0
        # Without multimodal items or prompt embeds the keys are block 0's (LoRA, salt) and
        # every later block's (LoRA): found once here.
        self._per_block = self.keys.per_block
        static = not self._per_block
        self._first_keys = self.keys.for_block(0, block_size)[0] if static else None
        self._rest_keys = self.keys.for_block(block_size, 2 * block_size)[0] if static else None

    @property
    def num_pending(self) -> int:
        """Tokens fed after the last full block (always < block_size)."""
        return len(self._pending)

    @property
    def last_hash(self) -> BlockHash | None:
        """Hash of the newest full block, or None before the first one."""
        return BlockHash(self._parent) if self.num_blocks else None

    def append(self, token_ids: Iterable[int]) -> list[BlockHash]:
        """Feed tokens; return the hashes of the blocks they complete, oldest first (often [])."""
        pending = self._pending
        pending += _as_tokens(token_ids)
        size = self.block_size
        if len(pending) < size:
            return []
        full = len(pending) // size * size
        dumps, digest, parent = cbor2.dumps, self._digest, self._parent
        per_block, first, rest = self._per_block, self._first_keys, self._rest_keys
        position = self.num_blocks * size
        out: list[bytes] = []
        for start in range(0, full, size):
            if per_block:
                extra = self._extra_for(position)
            else:
                extra = rest if position else first
            block = tuple(pending[start : start + size])
            parent = digest(dumps((parent, block, extra), canonical=True))
            out.append(parent)
            position += size
        del pending[:full]
        self._parent = parent
        self.num_blocks += len(out)
        return cast(list[BlockHash], out)

    def _extra_for(self, start: int) -> ExtraKeys | None:
        """Extra keys of the block starting at ``start`` (consecutive blocks only: the
        multimodal cursor moves forward)."""
        extra, self._mm_cursor = self.keys.for_block(start, start + self.block_size,
                                                     self._mm_cursor)
        return extra


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def block_hashes(
    token_ids: Iterable[int],
    block_size: int = 16,
    *,
    algo: HashAlgo = "sha256_cbor",
    seed: str | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_features: Sequence[MultiModalItem] | None = None,
    prompt_embeds: Any = None,
    parent: BlockHash | None = None,
    lora_path: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a prompt), chained from ``parent`` or
    ``NONE_HASH``; ``len(token_ids) // block_size`` of them. Pure: no state survives the call.
    Raises ValueError for a block size outside 8/16/32/64/128, token ids that are not integers
    in [0, 2**32-1], an unknown algorithm, unsorted ``mm_features``, or ``lora_path`` without
    ``lora_name``. With prompt embeds, pass the token ids vLLM holds (0 at embedded positions)."""
    hasher = BlockHasher(
        block_size,
        algo=algo,
        seed=seed,
        cache_salt=cache_salt,
        lora_name=lora_name,
        lora_path=lora_path,
        mm_features=mm_features,
        prompt_embeds=prompt_embeds,
        parent=parent,
    )
    return hasher.append(token_ids)
