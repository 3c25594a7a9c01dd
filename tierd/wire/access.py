"""``denied``: why this process may not open one of the daemon's files (its socket, its arena),
naming the file's owner and mode and the fixes (``tierd.daemon.engine_access`` says who may)."""

from __future__ import annotations

import os
import stat


def denied(path: str, what: str) -> str | None:
    """Why this process may not open ``path`` (``what``: "socket" or "arena") for reading and
    writing, naming its owner and mode and the fixes; None if it may, or if ``path`` does not
    exist (the daemon is not there: another message applies)."""
    me = f"uid {os.geteuid()}, groups {sorted({os.getegid(), *os.getgroups()})}"
    fix = ("run the engine as the daemon's user, or start the daemon with engine_group "
           "(TIERD_ENGINE_GROUP) set to a group this engine has (docs/daemon.md, 'Engines in "
           "other containers')")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except PermissionError:
        return (f"this engine ({me}) may not reach the daemon's {what} {path}: its directory "
                f"{os.path.dirname(path)} is not searchable for it; {fix}")
    if os.access(path, os.R_OK | os.W_OK):
        return None
    return (f"the daemon's {what} {path} is owned by uid {st.st_uid}, gid {st.st_gid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}, so this engine ({me}) may not open it; {fix}")
