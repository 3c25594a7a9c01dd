"""``clip``: a caller's input as an error message may repeat it, bounded, on either side of the
wire (a 16 KiB id must not become a 16 KiB status trailer)."""

from __future__ import annotations

CLIP_CHARS = 64
"""Most characters of a caller's input an error message repeats (ids are 16-32 characters)."""


def clip(value: str | bytes, limit: int = CLIP_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with its full length said: an error message
    never echoes unbounded input (a 16 KiB id must not become a 16 KiB status trailer)."""
    if len(value) <= limit:
        return repr(value)
    unit = "bytes" if isinstance(value, bytes) else "chars"
    return f"{value[:limit]!r}... ({len(value)} {unit})"
