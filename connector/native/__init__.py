"""Native code of the connector: C helpers built when tierd is installed, with Python fallbacks.

- ``library.shared_library``: the helpers' library (``setup.py`` builds ``verified_copy.c``
  and ``xxh3.c``, xxHash vendored in ``xxhash/``), loaded with ctypes; None (one WARNING) where
  it was not built.
- ``verified_copy``: a DRAM load in one pass (each slot hashed as it is copied), the engine side
  of both connectors; ``load_verified`` answers None when the library is unavailable, and the
  caller verifies, then copies, in two passes.
"""
