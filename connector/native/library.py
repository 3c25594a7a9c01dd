"""The native helpers' shared library, loaded with ctypes, or None (and why).

``setup.py`` builds ``verified_copy.c`` and ``xxh3.c`` (with ``xxhash/``) into
``_native<suffix>.so`` beside this file when tierd is installed, or in place (``make native``)
for engines that import tierd from a clone. It is plain C: ctypes releases the GIL for each
call, and a library built by any Python of the same machine loads in any other. Where it is
missing, callers take their Python paths, and the first caller logs one WARNING saying so and
how to build it. ``TIERD_NATIVE=0`` asks for the Python paths (no warning).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
from pathlib import Path

_log = logging.getLogger(__name__)
STEM = "_native"


def enabled() -> bool:
    """False when ``TIERD_NATIVE=0`` asks for the Python paths."""
    return os.environ.get("TIERD_NATIVE", "1") != "0"


def find(folder: Path = Path(__file__).parent) -> Path | None:
    """The built library in ``folder``: this Python's extension name first, else any build."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (folder / f"{STEM}{suffix}").is_file():
            return folder / f"{STEM}{suffix}"
    found = sorted(folder.glob(f"{STEM}.*.so"))
    return found[0] if found else None


@functools.cache
def shared_library() -> ctypes.CDLL | None:
    """The library, loaded once per process; None where it is disabled, missing or does not
    load (one WARNING naming the cost and the fix)."""
    if not enabled():
        return None
    path = find()
    if path is None:
        _warn(f"the native helpers are not built (no {STEM}*.so in {Path(__file__).parent})")
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        _warn(f"the native helpers in {path} do not load ({exc})")
        return None


def _warn(why: str) -> None:
    _log.warning("tierd: %s, so tierd takes its Python paths: each DRAM load reads the arena "
                 "twice (verify, then copy) instead of once, stores copy page by page with "
                 "torch, and checksums hold the GIL for spans under 64 KiB (python-xxhash). "
                 "Build them where a C compiler is: pip install tierd (make venv), or make "
                 "native in a clone whose tierd is imported through PYTHONPATH", why)
