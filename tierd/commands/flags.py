"""Flags that several commands share, spelled once: the daemon's socket is ``--socket-path``
everywhere (as ``tierd serve``, the config key ``socket_path`` and ``TIERD_SOCKET_PATH`` name
it). Earlier spellings keep working with a warning that names the new one."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class _Renamed(argparse.Action):
    """Stores like the flag it was renamed to and says so on standard error."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "",
                 **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is now {self.new} (one name for the "
              "daemon's socket in every command); the old spelling still works",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_socket_path(parser: argparse.ArgumentParser, help: str) -> None:
    """``--socket-path PATH`` (into ``args.socket``), and the old ``--socket`` alias."""
    parser.add_argument("--socket-path", metavar="PATH", dest="socket", default=None, help=help)
    parser.add_argument("--socket", metavar="PATH", dest="socket", action=_Renamed,
                        new="--socket-path", help=argparse.SUPPRESS)
