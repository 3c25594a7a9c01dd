"""What the daemon and the engine side both import: the block ``layout`` and slot ``geometry``,
the clients (``client``: ``TierdClient``, ``AsyncTierdClient``; their calls sent without waiting,
``call_threads``; their errors, ``call_error``), the lane's frames (``lane``) and its client
(``lane_client``), protobuf conversion (``convert``) into plain ``replies``, the engine's map of
the DRAM ``arena``, the ``presence`` filter's reader, ``access`` (why a daemon file may not be
opened) and ``clip``.
"""
