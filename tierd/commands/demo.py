"""`tierd demo`: the main job (`make demo`)."""

from __future__ import annotations

import argparse

HELP = "Run the end-to-end demo on embedded defaults (no Redis needed)."


def configure(parser: argparse.ArgumentParser) -> None:
    del parser  # no flags yet


def run(args: argparse.Namespace) -> int:
    # Until the daemon and the reference engine exist, the demo is a `tierd plan` walk-through.
    from tierd.commands import plan

    return plan.walkthrough()
