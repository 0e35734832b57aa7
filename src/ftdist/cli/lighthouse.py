"""
``ftdist lighthouse``
=====================

Runs a lighthouse in the foreground until SIGINT or SIGTERM, logging every
quorum change and, while no quorum can form, why. Flags take torchft's
spellings too (``--min_replicas`` as well as ``--min-replicas``), so scripts
written for ``torchft_lighthouse`` work unchanged.

``--token-file`` (or ``FTDIST_JOB_TOKEN``/``FTDIST_JOB_TOKEN_FILE``) makes
every call need the job's token; ``--tls-cert``/``--tls-key`` (or
``FTDIST_TLS_CERT``/``FTDIST_TLS_KEY``) serve gRPC over TLS
(docs/security.md).

``--etcd URLS --job NAME`` runs one replica of a replicated lighthouse
(:mod:`ftdist.lighthouse.replica`); start two or three on different hosts and
give trainers every replica's address, comma-separated.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ftdist.errors import EtcdError
from ftdist.lighthouse.config import CLI_DEFAULTS, ENV_VARS, resolve_lighthouse_config
from ftdist.lighthouse.server import LighthouseServer

__all__ = ["lighthouse_main", "register", "run"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``lighthouse`` subcommand to the ``ftdist`` parser.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The subcommand's parser.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lighthouse",
        help="run the lighthouse (quorum server) of a fault-tolerant job",
        description=(
            "Run the lighthouse every replica group of a job heartbeats and asks for the "
            "quorum. Unset flags fall back to FTDIST_LIGHTHOUSE_* environment variables, "
            "then to torchft_lighthouse's defaults."
        ),
    )

    def option(*names: str, key: str, help_text: str, **kwargs: Any) -> None:
        default = CLI_DEFAULTS.get(key)
        shown = "" if default is None else f"; default {default}"
        suffix = f" [env {ENV_VARS[key]}{shown}]"
        parser.add_argument(*names, dest=key, default=None, help=help_text + suffix, **kwargs)

    option("--bind", key="bind", metavar="HOST:PORT", help_text="gRPC address to listen on")
    option(
        "--min-replicas",
        "--min_replicas",
        key="min_replicas",
        type=int,
        metavar="N",
        help_text="fewest replica groups a new quorum needs (required)",
    )
    option(
        "--join-timeout-ms",
        "--join_timeout_ms",
        key="join_timeout_ms",
        type=int,
        metavar="MS",
        help_text="how long to wait for heartbeating stragglers to join before a quorum",
    )
    option(
        "--quorum-tick-ms",
        "--quorum_tick_ms",
        key="quorum_tick_ms",
        type=int,
        metavar="MS",
        help_text="how often to re-check the quorum and the heartbeats",
    )
    option(
        "--heartbeat-timeout-ms",
        "--heartbeat_timeout_ms",
        key="heartbeat_timeout_ms",
        type=int,
        metavar="MS",
        help_text="silence after which a replica group counts as dead",
    )
    option(
        "--http-port",
        "--http_port",
        key="http_port",
        type=int,
        metavar="PORT",
        help_text="dashboard port on the bind host; 0 picks one, -1 turns it off",
    )
    option(
        "--kill-token",
        key="kill_token",
        metavar="TOKEN",
        help_text="enable the dashboard's kill button, guarded by this shared secret "
        "(prefer the environment variable: flags show up in ps); the job token enables "
        "and authorizes it too",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        default=None,
        help="file holding the job token every call must carry "
        "[env FTDIST_JOB_TOKEN, then FTDIST_JOB_TOKEN_FILE; default: none, open to anyone]",
    )
    parser.add_argument(
        "--tls-cert",
        metavar="PEM",
        default=None,
        help="serve gRPC over TLS with this certificate chain [env FTDIST_TLS_CERT]",
    )
    parser.add_argument(
        "--tls-key",
        metavar="PEM",
        default=None,
        help="the private key of --tls-cert [env FTDIST_TLS_KEY]",
    )
    option(
        "--etcd",
        key="etcd",
        metavar="URLS",
        help_text="run as one replica of a replicated lighthouse, electing a leader through "
        "this etcd cluster (comma-separated http(s)://host:port); start two or three "
        "replicas with the same --job on different hosts",
    )
    option(
        "--job",
        key="job",
        metavar="NAME",
        help_text="the job's name (with --etcd): replicas of the same job elect one leader",
    )
    option(
        "--lease-ttl-ms",
        key="lease_ttl_ms",
        type=int,
        metavar="MS",
        help_text="the etcd lease TTL of each replica (with --etcd): a dead leader is "
        "replaced about this long after its last renewal",
    )
    option(
        "--takeover-grace-ms",
        key="takeover_grace_ms",
        type=int,
        metavar="MS",
        help_text="how long a new leader learns who is alive before it forms a quorum other "
        "than the previous one asked again (with --etcd)",
    )
    option("--etcd-ca", key="etcd_ca", metavar="PEM", help_text="CA certificates of etcd's TLS")
    option("--etcd-cert", key="etcd_cert", metavar="PEM", help_text="client certificate for etcd")
    option("--etcd-key", key="etcd_key", metavar="PEM", help_text="the key of --etcd-cert")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level [default: INFO]",
    )
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a lighthouse until SIGINT or SIGTERM.

    Args:
        args: the parsed ``ftdist lighthouse`` arguments.

    Returns:
        0 after a clean stop, 1 if a port cannot be bound, 2 on a
        configuration error (an unreadable token or TLS file, or an etcd
        that does not answer, included).

    Errors are reported on stderr and in the exit status.
    """
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s.%(msecs)03d [%(levelname)s] [%(name)s] - %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    try:
        config = resolve_lighthouse_config(
            defaults=CLI_DEFAULTS,
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            http_port=args.http_port,
            kill_token=args.kill_token,
            token_file=args.token_file,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            etcd=args.etcd,
            job=args.job,
            lease_ttl_ms=args.lease_ttl_ms,
            takeover_grace_ms=args.takeover_grace_ms,
            etcd_ca=args.etcd_ca,
            etcd_cert=args.etcd_cert,
            etcd_key=args.etcd_key,
        )
    except (ValueError, TypeError, OSError) as exc:
        print(f"ftdist lighthouse: error: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logging.getLogger("ftdist.lighthouse.server").info(
            "Received %s, stopping", signal.Signals(signum).name
        )
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = LighthouseServer(config=config)
        except EtcdError as exc:
            print(f"ftdist lighthouse: error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"ftdist lighthouse: error: {exc}", file=sys.stderr)
            return 1
        try:
            print(
                f"ftdist lighthouse serving on {server.address()} "
                f"(dashboard: {server.dashboard_address() or 'off'})",
                flush=True,
            )
            while not stop.wait(1.0):
                pass
        finally:
            server.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def lighthouse_main(argv: Sequence[str] | None = None) -> int:
    """Run a lighthouse in the foreground: torchft's ``torchft_lighthouse``.

    The ``ftdist_lighthouse`` console script runs this; it is
    ``ftdist lighthouse`` and takes torchft's flags (``--min_replicas``,
    ``--join_timeout_ms``, ``--quorum_tick_ms``, ``--heartbeat_timeout_ms``,
    ``--bind``) as well as ftdist's. torchft names it
    ``torchft._torchft.lighthouse_main``, and so does :mod:`ftdist._torchft`.

    Args:
        argv: the flags (default: ``sys.argv[1:]``).

    Returns:
        The exit status of ``ftdist lighthouse``.

    Raises:
        SystemExit: on ``--help`` or a usage error, as argparse does.
    """
    from ftdist.cli import main

    args = list(sys.argv[1:] if argv is None else argv)
    return main(["lighthouse", *args])
