"""The gRPC API's generated Python stubs (``tierd_pb2``, ``tierd_pb2_grpc``) from
``proto/tierd/v1/tierd.proto``, committed; ``make proto`` regenerates them.
"""
