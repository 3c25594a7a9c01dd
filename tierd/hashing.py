"""The block-hash contract: chained hashes over full token blocks, bit-identical to vLLM.

Block ``i`` of a prompt hashes ``(parent, tuple(block_token_ids), extra_keys or None)`` where the
parent is block ``i-1``'s hash (``NONE_HASH`` for block 0). Only **full** blocks are hashed; the
trailing partial block never is. ``sha256_cbor`` (the default) is SHA-256 over the canonical CBOR
encoding of that 3-tuple, exactly vLLM's ``--prefix-caching-hash-algo sha256_cbor``;
``xxhash_cbor`` is XXH3-128 over the same bytes (opt-in: not collision resistant).

Extra keys come in vLLM's order: LoRA name (every block), ``(identifier, offset from block
start)`` for each multimodal item overlapping the block, ``cache_salt`` (block 0 only; the chain
carries it), SHA-256 of the block's prompt-embeds bytes. See ``docs/hashing.md``.

Speed: for blocks of up to 16 tokens the token array is encoded by hand from a memo of
per-token CBOR codes (0.6-0.75x the cost of cbor2 + hashlib; ``tierd bench hash`` measures it);
longer blocks' token arrays are encoded by ``cbor2``, whose C loop wins there. The parent and the
extra keys (encoded by ``cbor2``) are spliced around it: a CBOR array is its head followed by its
items' encodings, so the result is byte-for-byte what ``cbor2.dumps`` gives for the 3-tuple;
``tests/test_hashing.py`` checks that on random inputs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, cast, get_args

import cbor2
import xxhash

from tierd.types import BlockHash

HashAlgo = Literal["sha256_cbor", "xxhash_cbor"]
"""``sha256_cbor``: SHA-256 of canonical CBOR (32-byte hashes, the default, multi-tenant safe).
``xxhash_cbor``: XXH3-128 of the same bytes (16-byte hashes; trusted single-tenant input only)."""

HASH_ALGOS: Final[tuple[HashAlgo, ...]] = get_args(HashAlgo)
BLOCK_SIZES: Final[tuple[int, ...]] = (8, 16, 32, 64, 128)
DEFAULT_SEED: Final = "vllm-none-hash"
"""vLLM's NONE_HASH seed when ``PYTHONHASHSEED`` is unset; ours whatever the environment says."""
MAX_TOKEN_ID: Final = 2**32 - 1

ExtraKey: TypeAlias = str | bytes | tuple[str, int]
"""LoRA name or cache salt (str), multimodal ``(identifier, offset)``, prompt-embeds digest."""

_log = logging.getLogger(__name__)
_TOKEN_TYPECODE: Final = "I"
assert array(_TOKEN_TYPECODE).itemsize == 4, "array('I') must hold exactly uint32 token ids"
# Token codes memoised below this id: covers 256k vocabularies. Only ids actually seen are kept
# (a few MiB for typical text), 25 MiB if every id below the limit shows up.
_MEMO_LIMIT: Final = 1 << 18
_HAND_ENCODED_MAX: Final = 16  # longest block whose token array is encoded by hand
_NULL: Final = b"\xf6"  # CBOR null: a block without extra keys


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input of a prompt: its content identifier (e.g. vLLM's ``mm_hash``) and
    the placeholder tokens it occupies, ``[offset, offset + length)`` in prompt positions."""

    identifier: str
    offset: int
    length: int


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


def encode_block(
    parent: bytes, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...] | None
) -> bytes:
    """The bytes that get hashed, by ``cbor2`` itself: ``cbor2.dumps((parent,
    tuple(token_ids), extra_keys), canonical=True)``. The reference the fast path must equal."""
    return bytes(cbor2.dumps((parent, tuple(token_ids), extra_keys), canonical=True))


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[ExtraKey, ...] | None = None,
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


def _embeds_digest(prompt_embeds: Any, start: int, end: int) -> bytes:
    """SHA-256 of the raw bytes of ``prompt_embeds[start:end]`` flattened in row-major order,
    as vLLM's ``tensor_data`` gives them (a torch tensor or a NumPy array)."""
    rows = prompt_embeds[start:end]
    if type(rows).__module__.startswith("torch"):
        import torch

        data = rows.detach().flatten().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    else:
        data = rows.tobytes()
    return hashlib.sha256(data).digest()


def _check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block size {block_size!r} is not supported; use one of "
            f"{', '.join(map(str, BLOCK_SIZES))} (16 is vLLM's default)"
        )


def _check_mm(items: Sequence[MultiModalItem]) -> tuple[MultiModalItem, ...]:
    previous = -1
    for item in items:
        if not isinstance(item, MultiModalItem) or not isinstance(item.identifier, str):
            raise ValueError("mm_features must be MultiModalItem(identifier: str, offset, length)")
        if item.offset < 0 or item.length <= 0:
            raise ValueError(f"{item}: give offset >= 0 and length > 0")
        if item.offset < previous:
            raise ValueError("mm_features must be sorted by offset, as vLLM keeps them")
        previous = item.offset
    return tuple(items)


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
    tokens fed so far, whatever the chunking. Not thread-safe; cheap to create (one per request).

    Positions in ``mm_features`` and ``prompt_embeds`` (one row per prompt token) count from the
    first token fed. ``parent`` continues an existing chain: then the first block is not the
    request's block 0, so ``cache_salt`` (block 0 only, as in vLLM) is not added again.
    """

    __slots__ = (
        "block_size", "algo", "num_blocks", "_pending", "_prefix", "_lead", "_exact",
        "_lora", "_salt", "_mm", "_mm_cursor", "_embeds", "_per_block", "_first_code",
        "_rest_code", "_extra", "_extra_code",
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
    ) -> None:
        _check_block_size(block_size)
        self.block_size: Final = block_size
        self.algo: Final = _check_algo(algo)
        self.num_blocks = 0
        """Full blocks hashed so far; the next block starts at token ``num_blocks*block_size``."""
        self._pending: list[int] = []  # fed tokens not yet in a hashed block
        root = parent if parent else none_hash(seed, self.algo)
        self._prefix = b"\x83" + _head(2, len(root)) + root  # array(3) head + parent bytes
        self._lead = b"\x83" + _head(2, 32 if self.algo == "sha256_cbor" else 16)
        self._exact = block_size > _HAND_ENCODED_MAX  # cbor2 encodes the tokens: plain ints
        self._lora = lora_name
        self._salt = cache_salt if cache_salt and not parent else None  # vLLM: truthy salt only
        self._mm = _check_mm(mm_features or ())
        self._mm_cursor = 0
        torch_like = type(prompt_embeds).__module__.startswith("torch")
        if prompt_embeds is not None and not (torch_like or hasattr(prompt_embeds, "tobytes")):
            raise ValueError("prompt_embeds must be a torch tensor or NumPy array [tokens, hidden]")
        self._embeds = prompt_embeds
        # Multimodal items and prompt embeds change per block; LoRA and salt do not, so their
        # encodings are made once: block 0's (LoRA, salt) and every later block's (LoRA,).
        self._per_block = bool(self._mm) or prompt_embeds is not None
        rest = None if lora_name is None else (lora_name,)
        first = (*(rest or ()), self._salt) if self._salt else rest
        self._first_code = _NULL if first is None else cbor2.dumps(first, canonical=True)
        self._rest_code = _NULL if rest is None else cbor2.dumps(rest, canonical=True)
        self._extra: tuple[ExtraKey, ...] | None = None  # last per-block keys, their encoding
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
        """Encoded extra keys of the block starting at ``start``, in vLLM's order."""
        end = start + self.block_size
        keys: list[ExtraKey] = [] if self._lora is None else [self._lora]
        mm, i = self._mm, self._mm_cursor
        while i < len(mm):  # vLLM's walk: items sorted by offset, stop at the first one ahead
            item = mm[i]
            if end <= item.offset:
                break
            if start >= item.offset + item.length:
                i += 1
                continue
            keys.append((item.identifier, item.offset - start))
            if end < item.offset + item.length:
                break
            i += 1
        self._mm_cursor = i
        if start == 0 and self._salt:
            keys.append(self._salt)
        if self._embeds is not None:
            keys.append(_embeds_digest(self._embeds, start, end))
        extra = tuple(keys) if keys else None
        if extra != self._extra:
            self._extra = extra
            self._extra_code = _NULL if extra is None else cbor2.dumps(extra, canonical=True)
        return self._extra_code


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
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a prompt), chained from ``parent`` or
    ``NONE_HASH``; ``len(token_ids) // block_size`` of them. Pure: no state survives the call.
    Raises ValueError for a block size outside 8/16/32/64/128, token ids that are not integers
    in [0, 2**32-1], an unknown algorithm, or unsorted ``mm_features``."""
    hasher = BlockHasher(
        block_size,
        algo=algo,
        seed=seed,
        cache_salt=cache_salt,
        lora_name=lora_name,
        mm_features=mm_features,
        prompt_embeds=prompt_embeds,
        parent=parent,
    )
    return hasher.append(token_ids)
