"""
Command line
============

``ftdist`` is one console script with a subcommand per tool. Each subcommand
lives in the module of its concept and registers itself here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Return the ``ftdist`` argument parser with every subcommand attached."""
    parser = argparse.ArgumentParser(
        prog="ftdist",
        description="Fault-tolerant, reconfigurable process groups for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # Subcommands register here as their issues land (lighthouse, status, demo).
    from ftdist.coordination import lighthouse_cli, status_cli
    from ftdist.demo import cli as demo_cli

    lighthouse_cli.register(sub)
    status_cli.register(sub)
    demo_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ftdist`` console script.

    Raises:
        SystemExit: on ``--help`` or a usage error, as argparse does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
