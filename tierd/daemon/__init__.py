"""The node daemon (``tierd serve``): the DRAM arena it owns (``arena``) and its slabs
(``slots``), the tier index and LRU policy, the node store and its leases, tenants' quotas, the
SSD tier (``ssd``), the link to the cluster, and the gRPC server that puts them on a socket
(``server``) with the lane beside it (``lane_server``). Engines reach it through
``tierd.wire``, never by importing this package.
"""
