"""The ``tierd`` console script: one subcommand per module in ``tierd.commands``.

Each command module exposes ``HELP`` (one line), ``configure(parser)`` (adds its flags, every
flag with help text) and ``run(args) -> int`` (exit status). Command modules import heavy
dependencies (torch, grpc) inside ``run`` so that ``tierd --help`` and ``tierd hash`` stay fast,
and so that the daemon's commands run without torch (an engine-side extra, ``tierd[engine]``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand name -> module under tierd.commands, in the order `--help` lists them.
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "plan": "plan",
    "hash": "hash",
    "bench": "bench",
    "route": "route",
    "serve": "serve",
    "stats": "stats",
    "why": "why",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierd",
        description="tierd: multi-tier KV-cache offloading for LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"tierd.commands.{module_name}")
        child = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(child)
        child.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except ValueError as exc:
        # Bad input raises ValueError naming the fix; show it without a traceback.
        print(f"tierd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "torch":
            raise
        print(f"tierd {args.command}: error: this command runs an engine and needs torch: "
              "pip install 'tierd[engine]' (serve, stats, route, hash and plan do not)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
