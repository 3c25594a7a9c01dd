"""Flags that several commands share, spelled once: the daemon's socket is ``--socket-path``
everywhere (as ``tierd serve``, the config key ``socket_path`` and ``TIERD_SOCKET_PATH`` name
it). An earlier spelling is refused with an error that names the new one."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class _Renamed(argparse.Action):
    """Refuses a flag that was renamed, naming the new spelling (a usage error, exit 2)."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "",
                 **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is now {self.new} (one name for the daemon's socket in "
                     f"every command): use {self.new} {values}")


def add_socket_path(parser: argparse.ArgumentParser, help: str) -> None:
    """``--socket-path PATH`` (into ``args.socket``); the earlier ``--socket`` is refused."""
    parser.add_argument("--socket-path", metavar="PATH", dest="socket", default=None, help=help)
    parser.add_argument("--socket", metavar="PATH", dest="socket", action=_Renamed,
                        new="--socket-path", help=argparse.SUPPRESS)
