"""`tierd serve`: run the node daemon until SIGTERM / Ctrl-C.

Configuration, weakest first: defaults (laptop-sized), the TOML file of ``--config`` (or
``TIERD_CONFIG``), ``TIERD_<KEY>`` environment variables, then these flags. Every flag is also a
TOML key and an environment variable: ``--dram-bytes 2GiB`` = ``dram_bytes = "2GiB"`` =
``TIERD_DRAM_BYTES=2GiB``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

HELP = "Run the node daemon (DRAM + SSD tiers, gRPC on a Unix socket) until SIGTERM."

_BOOL_KEYS = ("allow_remote", "insight_hooks", "lane", "prefault", "remote_tier")


def configure(parser: argparse.ArgumentParser) -> None:
    from tierd.daemon.config import field_help, keys

    parser.epilog = ("Each flag is also a TOML key of --config and a TIERD_<KEY> environment "
                     "variable; flags win over the environment, which wins over the file. "
                     "Byte sizes accept units: 512MiB, 8GiB.")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML config file (default: $TIERD_CONFIG, else none).")
    for key in keys():
        flag = "--" + key.replace("_", "-")
        if key in _BOOL_KEYS:
            parser.add_argument(flag, dest=key, default=None,
                                action=argparse.BooleanOptionalAction, help=field_help(key))
        else:
            parser.add_argument(flag, dest=key, default=None, metavar=key.upper(),
                                help=field_help(key))


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from tierd.daemon.config import keys, load_config
    from tierd.daemon.server import serve

    config = load_config(args.config, overrides={k: getattr(args, k) for k in keys()})
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The event loop hands SSD reads and verification to I/O threads: a GIL switch interval
    # a tenth of the default lets the first read start while a long prefix is still staged.
    sys.setswitchinterval(0.0005)
    asyncio.run(serve(config))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierd.commands.serve`` (what tests and process managers run)."""
    parser = argparse.ArgumentParser(prog="tierd serve", description=HELP)
    configure(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"tierd serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
