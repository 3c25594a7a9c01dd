"""Which processes may use the daemon, and what an engine is told when it may not.

An engine needs to open two of the daemon's files: its Unix socket (write permission, to
connect) and its arena in ``/dev/shm`` (read-write, to map it; the presence filter beside it
likewise). By default both belong to the daemon's user alone (socket as the umask makes it,
arena 0600), so engines must run as that user (or root). With ``engine_group`` set, the daemon
gives both to that group with mode 0660: engines in other containers or pods then run as any
user that has the group (Kubernetes ``supplementalGroups``, ``docker run --group-add``). The
SSD tier stays the daemon's alone.

Engine side, ``tierd.wire.access.denied(path)`` turns a refused open into a message naming the
file, its owner and mode, and both fixes, instead of a misleading "no daemon answers".
"""

from __future__ import annotations

import grp
import os

SHARED_MODE = 0o660
"""Mode of the socket and arena files with an engine group."""


def group_id(group: str) -> int:
    """The gid of ``group``, a group name or a numeric gid; ``ValueError`` naming the fix."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"engine_group {group!r} is not a group of this host: give a group "
                         "name from /etc/group or a numeric gid (e.g. 10001)") from None


def share(path: str | int, gid: int) -> None:
    """Give ``path`` (or an open fd) to group ``gid`` with ``SHARED_MODE``. ``ValueError`` naming
    the fix if this process may not (it must have the group, or CAP_CHOWN)."""
    try:
        os.chown(path, -1, gid)
        os.chmod(path, SHARED_MODE)
    except PermissionError:
        where = path if isinstance(path, str) else f"fd {path}"
        raise ValueError(f"cannot give {where} to group {gid} (engine_group): run the daemon "
                         "with that group among its groups (Kubernetes supplementalGroups or "
                         "runAsGroup, docker run --group-add), or unset engine_group") from None
