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

Speed: for blocks of up to 16 tokens the token array is encoded by hand from a memo of
per-token CBOR codes (0.6-0.75x the cost of cbor2 + hashlib; ``tierd bench hash`` measures it);
longer blocks' token arrays are encoded by ``cbor2``, whose C loop wins there. The parent and the
extra keys (encoded by ``cbor2``) are spliced around it: a CBOR array is its head followed by its
items' encodings, so the result is byte-for-byte what ``cbor2.dumps`` gives for the 3-tuple;
``tests/test_hashing.py`` checks that on random inputs, ``tests/vllm/`` against vLLM itself.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
from array import array
from collections.abc import Iterable, Sequence
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
# Token codes memoised below this id: covers 256k vocabularies. Only ids actually seen are kept
# (a few MiB for typical text), 25 MiB if every id below the limit shows up.
_MEMO_LIMIT: Final = 1 << 18
_HAND_ENCODED_MAX: Final = 16  # longest block whose token array is encoded by hand
_NULL: Final = b"\xf6"  # CBOR null: a block without extra keys


def _head(major: int, value: int) -> bytes:
    """CBOR item head (major type, shortest argument), as canonical encoding requires."""
    kind = major << 5
    if value < 24:
        return bytes((kind | value,))
    if value < 0x100:
        return bytes((kind | 24, value))
    if value < 0x10000:
        return bytes((kind | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((kind | 26,)) + value.to_bytes(4, "big")
    return bytes((kind | 27,)) + value.to_bytes(8, "big")


class _TokenCodes(dict[int, bytes]):
    """Memo of token id -> CBOR unsigned-int encoding. Pure cache: entries never change; ids
    below ``_MEMO_LIMIT`` are kept (bounded by the vocabulary), larger ones computed each time."""

    def __missing__(self, token_id: int) -> bytes:
        token_id = operator.index(token_id)  # bools and NumPy ints hash as their int value
        code = _head(0, token_id)
        if token_id < _MEMO_LIMIT:
            self[token_id] = code
        return code


_TOKEN_CODES: Final = _TokenCodes()


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
    tuple(token_ids), extra_keys), canonical=True)``. The reference the fast path must equal."""
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

    A falsy ``parent`` means block 0 (``NONE_HASH`` for ``seed``). Reference path: prompts go
    through ``block_hashes`` / ``BlockHasher``, which validate input and are faster.
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


def _as_tokens(token_ids: Iterable[int], exact: bool) -> Sequence[int]:
    """Validate token ids as uint32 in one C-level pass (``array('I')``). Unless ``exact`` is
    asked for, a list or tuple is then used as it is (its int objects already exist): its bools
    or NumPy ints still hash as their values, since the token-code memo looks them up by value.
    ``exact`` (for cbor2, which encodes a bool as CBOR true) returns a list of plain ints."""
    tolist = getattr(token_ids, "tolist", None)  # NumPy arrays and torch tensors
    if tolist is not None:
        token_ids = tolist()
    try:
        checked = array(_TOKEN_TYPECODE, token_ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(
            f"token ids must be integers in [0, {MAX_TOKEN_ID}] ({exc}); pass tokenizer ids"
        ) from None
    if not exact and (type(token_ids) is list or type(token_ids) is tuple):
        return token_ids
    return checked.tolist()


def _token_arrays(tokens: list[int], size: int) -> list[bytes]:
    """CBOR of each full block's token array (array head + one uint per token).

    Up to ``_HAND_ENCODED_MAX`` tokens a block, joining memoised per-token codes beats cbor2
    (``tierd bench hash``: ~0.7x the cost at 16); for longer blocks cbor2's C loop wins, so it
    encodes them (``tokens`` are then plain ints, see ``_as_tokens``)."""
    if size > _HAND_ENCODED_MAX:
        dumps = cbor2.dumps
        return [dumps(tokens[start : start + size]) for start in range(0, len(tokens), size)]
    codes = list(map(_TOKEN_CODES.__getitem__, tokens))  # one C-level pass
    head, join = _head(4, size), b"".join
    return [head + join(codes[start : start + size]) for start in range(0, len(tokens), size)]


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
        "block_size", "algo", "num_blocks", "keys", "_pending", "_prefix", "_lead", "_exact",
        "_mm_cursor", "_per_block", "_first_code", "_rest_code", "_extra", "_extra_code",
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
        root = parent if parent else none_hash(seed, self.algo)
        self._prefix = b"\x83" + _head(2, len(root)) + root  # array(3) head + parent bytes
        self._lead = b"\x83" + _head(2, 32 if self.algo == "sha256_cbor" else 16)
        self._exact = block_size > _HAND_ENCODED_MAX  # cbor2 encodes the tokens: plain ints
        self._mm_cursor = 0
        # Without multimodal items or prompt embeds the keys are block 0's (LoRA, salt) and
        # every later block's (LoRA): encoded once here.
        self._per_block = self.keys.per_block
        static = not self._per_block
        self._first_code = _encode_keys(self.keys.for_block(0, block_size)[0]) if static else b""
        self._rest_code = (_encode_keys(self.keys.for_block(block_size, 2 * block_size)[0])
                           if static else b"")
        self._extra: ExtraKeys | None = None  # last per-block keys, their encoding
        self._extra_code = _NULL

    @property
    def num_pending(self) -> int:
        """Tokens fed after the last full block (always < block_size)."""
        return len(self._pending)

    @property
    def last_hash(self) -> BlockHash | None:
        """Hash of the newest full block, or None before the first one."""
        return BlockHash(self._prefix[len(self._lead) :]) if self.num_blocks else None

    def append(self, token_ids: Iterable[int]) -> list[BlockHash]:
        """Feed tokens; return the hashes of the blocks they complete, oldest first (often [])."""
        pending = self._pending
        pending += _as_tokens(token_ids, self._exact)
        size = self.block_size
        if len(pending) < size:
            return []
        full = len(pending) // size * size
        bodies = _token_arrays(pending[:full], size)
        del pending[:full]
        sha = self.algo == "sha256_cbor"
        sha256, xxh = hashlib.sha256, xxhash.xxh3_128_digest
        lead, prefix = self._lead, self._prefix
        per_block, first, rest = self._per_block, self._first_code, self._rest_code
        position = self.num_blocks * size
        out: list[bytes] = []
        for body in bodies:
            if per_block:
                extra = self._extra_for(position)
            else:
                extra = rest if position else first
            message = prefix + body + extra
            digest = sha256(message).digest() if sha else xxh(message)
            out.append(digest)
            prefix = lead + digest
            position += size
        self._prefix = prefix
        self.num_blocks += len(out)
        return cast(list[BlockHash], out)

    def _extra_for(self, start: int) -> bytes:
        """Encoded extra keys of the block starting at ``start`` (consecutive blocks only: the
        multimodal cursor moves forward). Equal keys in a row are encoded once."""
        extra, self._mm_cursor = self.keys.for_block(start, start + self.block_size,
                                                     self._mm_cursor)
        if extra != self._extra:
            self._extra = extra
            self._extra_code = _encode_keys(extra)
        return self._extra_code


def _encode_keys(keys: ExtraKeys | None) -> bytes:
    return _NULL if keys is None else bytes(cbor2.dumps(keys, canonical=True))


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
