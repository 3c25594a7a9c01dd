"""The native helpers (``connector/native``: the verified copy and xxHash's xxh3) as one shared
library, ``tierd/connector/native/_native*.so``, built when tierd is installed (``pip install``,
``make venv``) or in place (``make native``, for engines that import tierd from a clone).

The extension is optional: without a C compiler the install goes on, and tierd takes its Python
paths with a warning when they are used. It is plain C loaded with ctypes (no Python headers).
Everything else about the package is in ``pyproject.toml``.
"""

import platform

from setuptools import Extension, setup

NATIVE = "connector/native"
SOURCES = [f"{NATIVE}/verified_copy.c", f"{NATIVE}/xxh3.c"]
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    SOURCES.append(f"{NATIVE}/xxhash/xxh_x86dispatch.c")

setup(ext_modules=[Extension(
    "tierd.connector.native._native", sources=SOURCES, optional=True,
    depends=[f"{NATIVE}/xxh3_api.h", f"{NATIVE}/xxhash/xxhash.h",
             f"{NATIVE}/xxhash/xxh_x86dispatch.h"],
    extra_compile_args=["-O2", "-pthread", "-fvisibility=hidden"], extra_link_args=["-pthread"],
)])
