"""What the daemon and the engine side both import: the block ``layout`` and slot ``geometry``,
the clients (``client``, over gRPC or the ``lane``: ``lane_client``, ``call_threads``,
``call_error``), protobuf conversion (``convert``) into plain ``replies``, the engine's map of the
DRAM ``arena``, the ``presence`` filter's reader, ``access`` (why a daemon file may not be
opened) and ``clip``.
"""
