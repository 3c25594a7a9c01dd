"""Compile a C helper once per source version and load it (ctypes), or say why not.

The library lands in ``<tierd cache dir>/native/<stem>-<hash of source and compiler>.so``,
written under a temporary name and renamed, so concurrent engines never load a half-written
file; later processes (and other clones with the same source) load it without compiling. No
Python headers are needed: the helpers are plain C called through ctypes, which releases the
GIL for the call. ``TIERD_NATIVE=0`` turns every helper off (callers take their Python paths).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from tierd.paths import cache_dir

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}

FLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


def enabled() -> bool:
    """False when ``TIERD_NATIVE=0`` asks for the Python paths."""
    return os.environ.get("TIERD_NATIVE", "1") != "0"


def compiler() -> str | None:
    """``$CC`` or ``cc`` or ``gcc`` on PATH, else None."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def shared_library(source: Path) -> ctypes.CDLL | None:
    """``source`` compiled and loaded; None (one warning naming the fix) when disabled, when
    there is no compiler, or when it does not compile. Thread-safe; compiles at most once per
    process."""
    if not enabled():
        return None
    with _lock:
        if source not in _loaded:
            _loaded[source] = _build(source)
        return _loaded[source]


def _build(source: Path) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        _log.warning("tierd: no C compiler (cc) found: %s falls back to its slower Python path; "
                     "install one (apt-get install gcc) or set CC", source.name)
        return None
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join((cc, *FLAGS, platform.machine())).encode())
    target = cache_dir() / "native" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        tmp = ""
        try:  # a read-only cache dir, a full disk: the Python path, with the reason
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-",
                                       suffix=".so")
            os.close(fd)
            done = subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                _log.warning("tierd: %s did not compile with %s (falling back to Python): %s",
                             source.name, cc, done.stderr.strip()[-2000:])
                return None
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as exc:
            _log.warning("tierd: could not compile %s with %s into %s (falling back to Python; "
                         "set XDG_CACHE_HOME to a writable directory): %s", source.name, cc,
                         target.parent, exc)
            return None
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        _log.warning("tierd: could not load %s (falling back to Python): %s", target, exc)
        return None
