"""`tierd hash` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse

HELP = "hash (not built yet)."


def configure(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    return 1


def walkthrough() -> int:
    return 1
