"""Dropping the kernel's page cache before a cold-read row of a benchmark."""

from __future__ import annotations

import os


def drop_page_cache() -> bool:
    """Write back dirty pages, then drop the clean ones (needs root); False where it cannot,
    so the caller can say its "cold" figures may be warm."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False
