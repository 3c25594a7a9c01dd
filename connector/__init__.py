"""The engine side of tierd, one room per front end: ``core`` (what every front end shares:
settings, the daemon link, lease, load, save, slot stock, sinks, arena slots), ``vllm`` (the KV
connector and the offloading tier), ``sglang`` (HiCache's L3 backend), ``reference`` (the
reference engine and its hooks) and ``native`` (C helpers). It imports the daemon only through
``tierd.wire``.
"""
