"""Native code of the connector: small C helpers compiled on first use, with Python fallbacks.

- ``build.shared_library``: compile one C file with the host's compiler into the tierd cache
  dir (once per source version) and load it with ctypes; None where there is no compiler.
- ``verified_copy``: a DRAM load in one pass (hash each piece of a slot, copy it while it is in
  cache), the engine side of both connectors; ``load_verified`` answers None when the library
  is unavailable, and the caller verifies, then copies, in two passes.
"""
