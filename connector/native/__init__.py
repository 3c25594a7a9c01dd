"""Native code of the connector: C helpers built when tierd is installed (``setup.py``: the one-pass
verified copy, xxh3 from the vendored xxHash), loaded with ctypes by ``library``, with Python
fallbacks and one WARNING where the library was not built; ``verified_copy`` is the DRAM load
both connectors use.
"""
