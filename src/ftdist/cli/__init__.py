"""
Command line
============

``ftdist`` is one console script with a subcommand per tool; each lives in a
module of this package and registers itself here: ``lighthouse``
(:mod:`~ftdist.cli.lighthouse`), ``status`` (:mod:`~ftdist.cli.status`), ``demo``
(:mod:`~ftdist.cli.demo`), ``run`` (:mod:`~ftdist.cli.run`) and ``chaos``
(:mod:`~ftdist.cli.chaos`). Nothing here imports torch until a
subcommand needs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Return the ``ftdist`` argument parser with every subcommand attached."""
    parser = argparse.ArgumentParser(
        prog="ftdist",
        description="Fault-tolerant, reconfigurable process groups for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from ftdist.cli import chaos, demo, lighthouse, run, status

    lighthouse.register(sub)
    status.register(sub)
    demo.register(sub)
    run.register(sub)
    chaos.register(sub)
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
