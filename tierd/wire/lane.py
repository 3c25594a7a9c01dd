"""The lane: the Tierd service's unary calls over a plain framed Unix socket, beside gRPC's.

A Python gRPC call costs both ends far more than a tierd call's own work (an HTTP/2 stream, its
metadata, a task and several thread hand-offs per call), and an engine makes a few calls per
request: a pin, its release, a save's Reserve and Commit. Engines on the daemon's node send
those calls over the lane instead: the same requests and replies (the protobuf messages of
``tierd.v1``), the same tenants, checks, status codes and metrics, only a cheaper transport.
gRPC stays the daemon's API (health, reflection, TCP, every other client); the lane carries no
KV bytes either.

The lane listens at ``lane_path(socket_path)``, a socket beside the daemon's own, with the same
owner, group and mode. Every frame, both ways, is a 4-byte little-endian length and the body:

* the first frame a client sends is its hello: ``HELLO``, then its bearer token in UTF-8 (empty
  for none: the daemon's default tenant, as a Unix-socket gRPC caller without one); the daemon
  answers it as a call (below) with no reply message: OK, or RESOURCE_EXHAUSTED where it has its
  most connections open (it then closes the connection);
* a call: one byte, the length of the method's name, the name (``Reserve``), the serialized
  request;
* its reply: one byte, the status code (``grpc.StatusCode``'s number: 0 is OK), then the
  serialized reply, or the error's details in UTF-8.

A connection carries one call at a time, answered in order; a client opens as many connections
as it has calls in flight.
"""

from __future__ import annotations

import os
import struct

from google.protobuf.message import Message

from tierd.v1 import tierd_pb2 as pb

HELLO = b"tierd-lane/1\0"
"""The first bytes of a client's hello: the protocol and its version."""

MAX_PATH = 107
"""The longest Unix socket path the kernel takes (``sun_path`` less its terminating NUL)."""

LENGTH = struct.Struct("<I")

SERVICE = pb.DESCRIPTOR.services_by_name["Tierd"]


def lane_path(socket_path: str) -> str | None:
    """The lane's socket beside the daemon's ``socket_path``, or None where that path would be
    too long for a Unix socket (the engines then call over gRPC only)."""
    path = socket_path + ".lane"
    return path if len(os.fsencode(path)) <= MAX_PATH else None


def reply_type(method: str) -> type[Message]:
    """The reply message class of the service's ``method``."""
    return getattr(pb, SERVICE.methods_by_name[method].output_type.name)  # type: ignore[no-any-return]


def request_type(method: str) -> type[Message]:
    """The request message class of the service's ``method``."""
    return getattr(pb, SERVICE.methods_by_name[method].input_type.name)  # type: ignore[no-any-return]
