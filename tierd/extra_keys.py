"""A request's block-hash extra keys: vLLM 0.33's tagged tuples, built and taken apart here only.

Besides its tokens and its parent, a block's hash covers ``extra_keys``: a tuple of tagged keys,
in this order (vLLM's ``generate_block_hash_extra_keys``), or ``None`` when there are none:

1. ``("lora", name, path)`` on every block of a LoRA request;
2. ``("mm", identifier, offset - block_start)`` for each multimodal item the block overlaps
   (the offset is negative once the item began in an earlier block);
3. ``("cache_salt", salt)`` on block 0 only, when the salt is non-empty (the chain carries it);
4. ``("prompt_embeds", sha256)`` of the raw bytes of the block's rows of the prompt embeds.

vLLM's KV events still publish the untagged pre-0.33 shapes (``to_event_extra_keys``): the LoRA
name alone, ``(identifier, offset)``, the bare salt and the bare digest. See ``docs/hashing.md``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

LoraKey: TypeAlias = tuple[Literal["lora"], str, str | None]
MultiModalKey: TypeAlias = tuple[Literal["mm"], str, int]
SaltKey: TypeAlias = tuple[Literal["cache_salt"], str]
EmbedsKey: TypeAlias = tuple[Literal["prompt_embeds"], bytes]
ExtraKey: TypeAlias = LoraKey | MultiModalKey | SaltKey | EmbedsKey
"""One tagged extra key, exactly the tuple vLLM 0.33 puts in the hashed 3-tuple."""
ExtraKeys: TypeAlias = tuple[ExtraKey, ...]
EventExtraKey: TypeAlias = str | bytes | tuple[str, int]
"""One key as vLLM's KV events publish it: LoRA name or salt (str), (identifier, offset), digest."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input of a prompt: its content identifier (vLLM's
    ``MultiModalFeatureSpec.identifier``) and the placeholder tokens it occupies,
    ``[offset, offset + length)`` in prompt positions (its ``mm_position``)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """Everything a request adds to its blocks' hashes besides the tokens. Build it with
    ``request_keys`` (which validates); ``for_block`` gives one block's extra keys."""

    lora: LoraKey | None
    salt: SaltKey | None
    """Set only for a non-empty salt on a chain that starts at the request's block 0."""
    mm: tuple[MultiModalItem, ...]
    """Sorted by offset, as vLLM keeps ``mm_features``."""
    prompt_embeds: Any
    """A torch tensor or NumPy array, one row per prompt token, or None."""

    @property
    def per_block(self) -> bool:
        """True when keys differ from block to block beyond block 0 (multimodal, embeds)."""
        return bool(self.mm) or self.prompt_embeds is not None

    def for_block(self, start: int, end: int, mm_cursor: int = 0) -> tuple[ExtraKeys | None, int]:
        """The extra keys of the block ``[start, end)`` and the multimodal cursor for the next
        block. ``mm_cursor`` (items before it end before ``start``) only saves work: 0 is always
        correct. Pure: nothing is cached."""
        keys: list[ExtraKey] = [] if self.lora is None else [self.lora]
        mm, i = self.mm, mm_cursor
        while i < len(mm):  # vLLM's walk: items sorted by offset, stop at the first one ahead
            item = mm[i]
            if end <= item.offset:
                break
            if start >= item.offset + item.length:
                i += 1
                continue
            keys.append(("mm", item.identifier, item.offset - start))
            if end < item.offset + item.length:
                break
            i += 1
        if start == 0 and self.salt is not None:
            keys.append(self.salt)
        if self.prompt_embeds is not None:
            keys.append(("prompt_embeds", _embeds_digest(self.prompt_embeds, start, end)))
        return (tuple(keys) if keys else None), i


def request_keys(
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MultiModalItem] | None = None,
    prompt_embeds: Any = None,
    from_block_0: bool = True,
) -> RequestKeys:
    """Validate a request's inputs into ``RequestKeys``. ``from_block_0=False`` (a chain that
    continues from a parent) leaves the salt out: it belongs to the request's block 0.

    Raises ValueError for a ``lora_path`` without ``lora_name``, unsorted or empty multimodal
    items, or prompt embeds that are neither a torch tensor nor a NumPy array. A ``lora_name``
    without ``lora_path`` is accepted (the key then holds ``None``) with a one-time warning: vLLM
    0.33 always has a path, so those hashes match no vLLM block."""
    if lora_path is not None and lora_name is None:
        raise ValueError("lora_path given without lora_name: pass both (vLLM's LoRARequest "
                         "lora_name and lora_path)")
    if lora_name is not None and lora_path is None:
        _warn_no_lora_path()
    torch_like = type(prompt_embeds).__module__.startswith("torch")
    if prompt_embeds is not None and not (torch_like or hasattr(prompt_embeds, "tobytes")):
        raise ValueError("prompt_embeds must be a torch tensor or NumPy array [tokens, hidden]")
    return RequestKeys(
        lora=None if lora_name is None else ("lora", lora_name, lora_path),
        salt=("cache_salt", cache_salt) if cache_salt and from_block_0 else None,  # vLLM: truthy
        mm=_check_mm(mm_features or ()),
        prompt_embeds=prompt_embeds,
    )


def to_event_extra_keys(keys: ExtraKeys | None) -> tuple[EventExtraKey, ...] | None:
    """One block's keys in the untagged form vLLM 0.33's KV events publish (its
    ``to_event_extra_keys``): the tag dropped, and the LoRA path with it."""
    if keys is None:
        return None
    out: list[EventExtraKey] = []
    for key in keys:
        if key[0] == "mm":
            out.append((key[1], key[2]))
        else:
            out.append(key[1])
    return tuple(out)


@functools.cache
def _warn_no_lora_path() -> None:
    # functools.cache makes this log once per process.
    _log.warning(
        "lora_name without lora_path: vLLM 0.33 hashes ('lora', name, path), so these block "
        "hashes match no vLLM block; pass lora_path (the LoRARequest's lora_path)"
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


def _embeds_digest(prompt_embeds: Any, start: int, end: int) -> bytes:
    """SHA-256 of the raw bytes of ``prompt_embeds[start:end]`` flattened in row-major order,
    as vLLM's ``tensor_data`` gives them (a torch tensor or a NumPy array). Rows past the end
    are an empty slice, as in vLLM."""
    rows = prompt_embeds[start:end]
    if type(rows).__module__.startswith("torch"):
        import torch

        data = rows.detach().flatten().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    else:
        data = rows.tobytes()
    return hashlib.sha256(data).digest()
