"""
``ftdist run``
==============

A torchrun for fault-tolerant jobs on one machine: runs a script (or ``-m``
module) in ``--nproc-per-node`` processes split into ``--replica-groups``
data-parallel replica groups, and restarts a replica group whose process
fails, up to ``--max-restarts`` times per group, while the other groups
keep running. Processes fork from ftdist's fork server, which has already
imported torch, so a restarted process runs the script's first line within
milliseconds instead of after an interpreter start and a torch import.

Each process sees torchrun's environment for its replica group (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``; the
store is hosted here, as torchrun's agent hosts it) plus torchft's
(``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE`` and
``FTDIST_LIGHTHOUSE``): a script written for ``torchrun`` + torchft runs
unchanged. ``LOCAL_RANK`` is the process's index on the machine, so that
replica groups sharing a machine use different devices. The lighthouse is
``--lighthouse``, else ``$FTDIST_LIGHTHOUSE``/``$TORCHFT_LIGHTHOUSE``, else
one started by this command.

torch is imported only once the command runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from typing import Any

__all__ = ["register"]

START_METHODS = ("forkserver", "spawn", "fork")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to the ``ftdist`` parser.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The subcommand's parser.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "run",
        help="run a training script in fault-tolerant replica groups (a torchrun)",
        description="Run SCRIPT in --nproc-per-node processes on this machine, split into "
        "--replica-groups data-parallel replica groups; restart a failed group from a fork "
        "server that has already imported torch.",
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=int,
        default=1,
        metavar="N",
        help="processes on this machine, all replica groups together (default 1)",
    )
    parser.add_argument(
        "--replica-groups",
        "--replica_groups",
        dest="replica_groups",
        type=int,
        default=1,
        metavar="R",
        help="data-parallel replica groups; each is a torch.distributed world of N/R "
        "processes (default 1: one world, as torchrun)",
    )
    parser.add_argument(
        "--nnodes", default="1", help="machines in the job; only 1 is supported (default 1)"
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="K",
        help="restarts per replica group before the run fails (default 0)",
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default="127.0.0.1",
        help="address the processes reach the stores at (default 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        default=0,
        metavar="PORT",
        help="store port with one replica group (default: a free port, bound here)",
    )
    parser.add_argument(
        "--lighthouse",
        default=None,
        metavar="ADDR",
        help="lighthouse address (default $FTDIST_LIGHTHOUSE, $TORCHFT_LIGHTHOUSE, "
        "else one started here)",
    )
    parser.add_argument(
        "--min-replicas",
        "--min_replicas",
        dest="min_replicas",
        type=int,
        default=1,
        metavar="M",
        help="min_replicas of the lighthouse started here (default 1)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        dest="join_timeout_ms",
        type=int,
        default=100,
        metavar="MS",
        help="join timeout of the lighthouse started here (default 100)",
    )
    parser.add_argument(
        "--start-method",
        "--start_method",
        dest="start_method",
        choices=START_METHODS,
        default="forkserver",
        help="how processes start (default forkserver: ftdist's, torch preloaded)",
    )
    parser.add_argument(
        "--standalone", action="store_true", help="accepted for torchrun compatibility"
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run SCRIPT as a module (python -m SCRIPT)",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(handler=_handle)
    return parser


def _check(args: argparse.Namespace) -> str | None:
    if args.nnodes not in ("1", "1:1"):
        return f"--nnodes {args.nnodes}: ftdist run starts processes on this machine only; use 1"
    if args.nproc_per_node < 1:
        return f"--nproc-per-node must be at least 1, got {args.nproc_per_node}"
    if args.replica_groups < 1 or args.nproc_per_node % args.replica_groups:
        return (
            f"--replica-groups {args.replica_groups} must divide --nproc-per-node "
            f"{args.nproc_per_node}"
        )
    if args.max_restarts < 0:
        return f"--max-restarts must be >= 0, got {args.max_restarts}"
    if not 0 <= args.master_port <= 65535:
        return f"--master-port must be a TCP port, got {args.master_port}"
    if args.master_port and args.replica_groups > 1:
        return "--master-port needs one replica group: each group binds a free port of its own"
    if args.min_replicas < 1:
        return f"--min-replicas must be at least 1, got {args.min_replicas}"
    return None


def _handle(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is not None:
        print(f"ftdist run: {problem}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[ftdist run] %(message)s")
    from datetime import timedelta

    from ftdist.errors import ProcessFailedError
    from ftdist.launch.children import ScriptJob
    from ftdist.launch.config import FaultTolerance
    from ftdist.launch.fault_tolerant import embedded_lighthouse, replica_env
    from ftdist.launch.launcher import process_context
    from ftdist.launch.supervisor import Supervisor

    groups, total = args.replica_groups, args.nproc_per_node
    size = total // groups
    address = FaultTolerance(lighthouse=args.lighthouse).lighthouse_address()
    lighthouse = None
    if address is None:
        lighthouse = embedded_lighthouse(
            args.min_replicas, timedelta(milliseconds=args.join_timeout_ms)
        )
        address = lighthouse.address()
    run_id = uuid.uuid4().hex[:12]
    job = ScriptJob(args.script, list(args.script_args), module=args.module)

    def make_job(rank: int, group: int, attempt: int, port: int) -> tuple[Any, Any]:
        env = replica_env(group, groups, attempt, address, args.max_restarts)
        env.update(
            {
                "RANK": str(rank - group * size),
                "WORLD_SIZE": str(size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(total),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank - group * size),
                "ROLE_WORLD_SIZE": str(size),
                "MASTER_ADDR": args.master_addr,
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": run_id,
            }
        )
        return job, env

    logging.getLogger(__name__).info(
        "%d replica group(s) of %d process(es); lighthouse %s", groups, size, address
    )
    try:
        Supervisor(
            context=process_context(args.start_method),
            groups=groups,
            group_size=size,
            first_rank=0,
            make_job=make_job,
            master_addr=args.master_addr,
            master_port=args.master_port,
            host_stores=True,
            fault_tolerant=True,
            max_restarts=args.max_restarts,
        ).run()
    except ProcessFailedError as exc:
        print(f"ftdist run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    return 0
