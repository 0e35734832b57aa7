"""
``ftdist status``
=================

Prints a lighthouse's current quorum in a terminal: quorum id and age, each
member's step, world size, heartbeat age and manager address (members behind
the max step are marked ``recovering``), the requests waiting for the next
quorum and why it is or is not ready, and every replica group's last
heartbeat. It needs only the lighthouse's gRPC address, the one managers use
(``--lighthouse``, ``FTDIST_LIGHTHOUSE``/``TORCHFT_LIGHTHOUSE``), and asks it
with ftdist's ``Status`` call, so it works where the dashboard port is closed
or off. torchft's lighthouse does not serve that call; use its dashboard.

A lighthouse with a job token needs it: ``--token-file`` or
``FTDIST_JOB_TOKEN``/``FTDIST_JOB_TOKEN_FILE``; ``--tls-ca`` (or
``FTDIST_TLS_CA``, or an ``https://`` address) talks TLS.

A replicated lighthouse (``ftdist lighthouse --etcd ... --job ...``) is
given as its replicas' addresses, comma-separated. The replica that answers
may be a follower, which holds no quorum: ``ftdist status`` then asks the
leader it names, and prints the leader's document. Any replica's document
adds a "replicas" section: the job, the leader, each replica and its role,
the etcd endpoints' health, the lease and the last failovers. Given one
replica's address, it prints that replica's document.

``--json`` prints the raw document (the dashboard's ``/status.json``),
``--watch SECONDS`` refreshes until Ctrl-C. Exit status: 0 on success, 1 if
the lighthouse could not be asked within ``--timeout``, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from ftdist._auth import job_token, tls_files
from ftdist.cli.status_text import render
from ftdist.errors import CoordinationTimeoutError, FtdistError
from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.config import lighthouse_address
from ftdist.lighthouse.following import parse_addresses

__all__ = ["main", "register", "render", "run"]

_PROG = "ftdist status"
_DEFAULT_TIMEOUT_S = 5.0
_DESCRIPTION = (
    "Print a lighthouse's current quorum: quorum id and age, each member's step, world "
    "size, heartbeat age and manager address, why the next quorum is or is not ready, "
    "and the last heartbeat of every replica group. Exit status: 0 on success, 1 if the "
    "lighthouse could not be asked within --timeout, 2 on a usage error."
)
# Home the cursor and clear the screen: a watched status redraws in place,
# like watch(1), instead of scrolling.
_CLEAR = "\x1b[H\x1b[2J"
# The newest failovers printed; the document holds up to 20.


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "addr",
        nargs="?",
        metavar="ADDR",
        help="the lighthouse's gRPC address, host:port or http://host:port; a replicated "
        "lighthouse's replicas comma-separated "
        "[default: $FTDIST_LIGHTHOUSE, then $TORCHFT_LIGHTHOUSE]",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=_DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"give up on an unreachable lighthouse after this long [default: {_DEFAULT_TIMEOUT_S:g}]",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        default=None,
        help="file holding the job token [default: $FTDIST_JOB_TOKEN, then $FTDIST_JOB_TOKEN_FILE]",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=None,
        help="talk TLS, trusting these certificates [default: $FTDIST_TLS_CA]",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the raw status document (the dashboard's /status.json); "
        "with --watch, one line per refresh",
    )
    parser.add_argument(
        "--watch",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS until Ctrl-C",
    )
    parser.set_defaults(handler=run)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``status`` subcommand to the ``ftdist`` parser.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The subcommand's parser.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="print a lighthouse's current quorum",
        description=_DESCRIPTION,
    )
    _add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ftdist status`` on its own, without the ``ftdist`` parser.

    Args:
        argv: the arguments after ``status``; None reads ``sys.argv``.

    Returns:
        The exit status (see :func:`run`).

    Raises:
        SystemExit: on ``--help`` or a usage error, as argparse does.
    """
    parser = argparse.ArgumentParser(prog=_PROG, description=_DESCRIPTION)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Print the status of the lighthouse at ``args.addr``.

    Args:
        args: the parsed ``ftdist status`` arguments (``addr``, ``timeout``,
            ``json``, ``watch``, ``token_file``, ``tls_ca``).

    Returns:
        0 on success (and when Ctrl-C ends ``--watch``), 1 if the lighthouse
        could not be asked in time or refused, 2 if the address is missing or
        malformed.

    Errors are reported on stderr, one line each, and in the exit status.
    """
    addr = args.addr or lighthouse_address()
    if not addr:
        _error(
            "no lighthouse address: pass ADDR (host:port or http://host:port) "
            "or set FTDIST_LIGHTHOUSE"
        )
        return 2
    try:
        parse_addresses(addr)
        token = job_token(token_file=getattr(args, "token_file", None))
        tls_files(ca=getattr(args, "tls_ca", None)).root()  # unreadable: a usage error
    except (ValueError, OSError) as exc:
        _error(str(exc))
        return 2
    fetcher = _Fetcher(addr, timedelta(seconds=args.timeout), token, getattr(args, "tls_ca", None))
    try:
        if args.watch is None:
            return _once(fetcher, args.json)
        return _watch(fetcher, args.json, args.watch)
    except KeyboardInterrupt:
        return 0 if args.watch is not None else 130
    except BrokenPipeError:
        # The reader (`| head`) is gone; say nothing more. stdout is pointed
        # at /dev/null so the interpreter's final flush does not complain.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        fetcher.close()


def _error(message: str) -> None:
    # One line, whatever the server's details held: scripts read stderr too.
    flat = " ".join(message.split())
    print(f"{_PROG}: error: {flat}", file=sys.stderr, flush=True)


class _Fetcher:
    """Asks a lighthouse for its status, connecting on first use and
    reconnecting after a failed connect (a --watch outlives restarts).

    Given several replicas of a replicated lighthouse, one client asks them
    (it moves on from a replica that is down); when the replica that answers
    is not the leader, the leader it names is asked too, with a client of
    its own, for the leader alone holds the quorum and heartbeats.
    """

    def __init__(
        self, addr: str, timeout: timedelta, token: str | None, tls_ca: str | None
    ) -> None:
        self.addr = addr
        # The address of the replica whose document fetch() returned last.
        self.source = addr
        self.timeout = timeout
        self._token = token
        self._tls_ca = tls_ca
        self._replicated = len(parse_addresses(addr)) > 1
        self._client: LighthouseClient | None = None
        self._leader: tuple[str, LighthouseClient] | None = None

    def fetch(self) -> dict[str, Any]:
        """The status document; the leader's, given several replicas and
        the leader can be asked in time.

        Raises:
            FtdistError: with a one-line message, if it cannot be had within
                the timeout.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self._client is None:
            try:
                self._client = LighthouseClient(
                    self.addr, self.timeout, token=self._token, tls_ca=self._tls_ca
                )
            except FtdistError as exc:
                raise FtdistError(
                    f"cannot reach the lighthouse at {self.addr} within "
                    f"{self.timeout.total_seconds():g} s; check the address (the lighthouse's "
                    "gRPC port, not its dashboard) and that it is running, or raise --timeout"
                ) from exc
        remaining = max(0.001, deadline - time.monotonic())
        try:
            document = self._client.status(timedelta(seconds=remaining))
        except CoordinationTimeoutError as exc:
            raise FtdistError(
                f"no answer from the lighthouse at {self.addr} within "
                f"{self.timeout.total_seconds():g} s; it may be down or restarting, "
                "or raise --timeout"
            ) from exc
        self.source = self.addr
        replication = document.get("replication")
        if not self._replicated or not isinstance(replication, Mapping):
            return document
        # Which of the replicas answered: the heading names it.
        self.source = str(replication.get("address") or self.addr)
        if replication.get("role") == "leader":
            return document
        leader = replication.get("leader")
        address = leader.get("address") if isinstance(leader, Mapping) else None
        if not isinstance(address, str) or not address:
            return document  # an election: no leader to ask yet
        if self.addr.lstrip().startswith("https://") and address.startswith("http://"):
            # A replica advertises http://; the user's https:// asks for TLS,
            # which the leader speaks as well as the replica that answered.
            address = "https://" + address.removeprefix("http://")
        try:
            leaders = self._ask_leader(address, deadline)
        except (FtdistError, ValueError):
            # The follower's document still names the leader and the replicas;
            # the leader may be failing over right now.
            return document
        leader_replication = leaders.get("replication")
        if not isinstance(leader_replication, Mapping) or leader_replication.get("role") != (
            "leader"
        ):
            return document  # it stepped down since: no better view to show
        self.source = address
        return leaders

    def _ask_leader(self, address: str, deadline: float) -> dict[str, Any]:
        """The document of the replica at ``address``, within ``deadline``.

        Raises:
            FtdistError: it could not be asked in time.
            ValueError: ``address`` is malformed.
        """
        if self._leader is not None and self._leader[0] != address:
            self._leader[1].close()
            self._leader = None
        if self._leader is None:
            wait = timedelta(seconds=max(0.001, deadline - time.monotonic()))
            client = LighthouseClient(address, wait, token=self._token, tls_ca=self._tls_ca)
            self._leader = (address, client)
        try:
            return self._leader[1].status(
                timedelta(seconds=max(0.001, deadline - time.monotonic()))
            )
        except FtdistError:
            # The next fetch connects again, to whichever replica leads then.
            self._leader[1].close()
            self._leader = None
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._leader is not None:
            self._leader[1].close()
            self._leader = None


def _once(fetcher: _Fetcher, as_json: bool) -> int:
    try:
        document = fetcher.fetch()
    except FtdistError as exc:
        _error(str(exc))
        return 1
    if as_json:
        print(json.dumps(document, indent=2, sort_keys=True), flush=True)
    else:
        print(render(document, fetcher.source), end="", flush=True)
    return 0


def _watch(fetcher: _Fetcher, as_json: bool, period_s: float) -> int:
    # Ctrl-C is how a watch ends. A process started with SIGINT ignored
    # (by a parent that ignores it: nohup, some supervisors and test
    # runners) inherits that, and Python then leaves it ignored.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    out = sys.stdout
    redraw = out.isatty() and not as_json
    while True:
        started = time.monotonic()
        try:
            document: dict[str, Any] | None = fetcher.fetch()
            problem = ""
        except FtdistError as exc:
            document, problem = None, str(exc)
        if as_json:
            # JSON lines: one document (or error object) per refresh, for pipes.
            line = document if document is not None else {"error": problem}
            print(json.dumps(line, sort_keys=True), file=out, flush=True)
        else:
            stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            header = f"Every {period_s:g} s: {_PROG} {fetcher.addr}    {stamp}\n\n"
            body = (
                render(document, fetcher.source)
                if document is not None
                else (f"error: {problem}\n")
            )
            frame = (_CLEAR if redraw else "") + header + body + ("" if redraw else "\n")
            out.write(frame)
            out.flush()
        # A failed fetch has already waited up to the timeout; the period
        # counts from the start of the refresh so the rhythm stays steady.
        time.sleep(max(0.0, period_s - (time.monotonic() - started)))


# -- rendering ---------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
