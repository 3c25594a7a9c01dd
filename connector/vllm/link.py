"""Moved: the daemon link of every front end is ``tierd.connector.core.link.DaemonLink``.

This name stays only until the front ends written against it (issues 19 and 20) import the
core's; it is the same class, not a copy.
"""

from tierd.connector.core.link import DaemonLink, Session

__all__ = ["DaemonLink", "Session"]
