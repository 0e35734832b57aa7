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
from ftdist._rpc import common as _rpc
from ftdist.errors import CoordinationTimeoutError, FtdistError
from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.config import lighthouse_address

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
        help="the lighthouse's gRPC address, host:port or http://host:port "
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
        _rpc.grpc_target(addr)
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
    """Asks one lighthouse for its status, connecting on first use and
    reconnecting after a failed connect (a --watch outlives restarts)."""

    def __init__(
        self, addr: str, timeout: timedelta, token: str | None, tls_ca: str | None
    ) -> None:
        self.addr = addr
        self.timeout = timeout
        self._token = token
        self._tls_ca = tls_ca
        self._client: LighthouseClient | None = None

    def fetch(self) -> dict[str, Any]:
        """The status document.

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
            return self._client.status(timedelta(seconds=remaining))
        except CoordinationTimeoutError as exc:
            raise FtdistError(
                f"no answer from the lighthouse at {self.addr} within "
                f"{self.timeout.total_seconds():g} s; it may be down or restarting, "
                "or raise --timeout"
            ) from exc

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _once(fetcher: _Fetcher, as_json: bool) -> int:
    try:
        document = fetcher.fetch()
    except FtdistError as exc:
        _error(str(exc))
        return 1
    if as_json:
        print(json.dumps(document, indent=2, sort_keys=True), flush=True)
    else:
        print(render(document, fetcher.addr), end="", flush=True)
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
                render(document, fetcher.addr) if document is not None else (f"error: {problem}\n")
            )
            frame = (_CLEAR if redraw else "") + header + body + ("" if redraw else "\n")
            out.write(frame)
            out.flush()
        # A failed fetch has already waited up to the timeout; the period
        # counts from the start of the refresh so the rhythm stays steady.
        time.sleep(max(0.0, period_s - (time.monotonic() - started)))


# -- rendering ---------------------------------------------------------------


def _clean(value: object) -> str:
    """``value`` as text safe for a terminal.

    Replica ids and addresses come from any client of the lighthouse; control
    characters in them must not move the cursor or recolour the screen.
    """
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _duration(seconds: object) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    s = float(seconds)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d {int(s % 86400 // 3600):02d}h"


def _ago(seconds: object) -> str:
    text = _duration(seconds)
    return text if text == "-" else f"{text} ago"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()
) -> list[str]:
    """Columns padded to their widest cell; columns in ``right`` right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return ("  " + "  ".join(padded)).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _number(value: object) -> str:
    return "-" if value is None else _clean(value)


def _member_state(member: Mapping[str, Any]) -> str:
    flags = []
    if member.get("recovering"):
        flags.append("recovering")
    if member.get("shrink_only"):
        flags.append("shrink-only")
    failures = member.get("commit_failures") or 0
    if failures:
        flags.append(_plural(int(failures), "commit failure"))
    return ", ".join(flags) or "ok"


def _settings_line(settings: Mapping[str, Any]) -> str:
    parts = []
    if "min_replicas" in settings:
        parts.append(f"min_replicas {_clean(settings['min_replicas'])}")
    for key, label in (
        ("join_timeout_ms", "join timeout"),
        ("heartbeat_timeout_ms", "heartbeat timeout"),
    ):
        value = settings.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {_duration(value / 1000)}")
    return ", ".join(parts)


def render(document: Mapping[str, Any], address: str) -> str:
    """Render a status document as the text ``ftdist status`` prints.

    Keys the document lacks are skipped, so documents from older or newer
    lighthouses render too.

    Args:
        document: a document from :meth:`LighthouseClient.status`
            (:func:`ftdist.lighthouse.status.build_status`).
        address: the lighthouse address, for the heading.

    Returns:
        The text, ending in a newline.
    """
    lines: list[str] = []
    heading = f"Lighthouse {_clean(address)}"
    facts = []
    if "uptime_s" in document:
        facts.append(f"up {_duration(document['uptime_s'])}")
    if "quorums_total" in document:
        facts.append(f"{_plural(int(document['quorums_total']), 'quorum')} formed")
    if document.get("member_failures_total"):
        facts.append(_plural(int(document["member_failures_total"]), "member failure"))
    settings = _settings_line(document.get("settings") or {})
    if settings:
        facts.append(settings)
    lines.append(heading + (f" ({'; '.join(facts)})" if facts else ""))

    quorum = document.get("quorum")
    if not quorum:
        lines.append("Quorum: none formed yet")
    else:
        members = list(quorum.get("members") or [])
        created = quorum.get("created")
        when = ""
        if isinstance(created, str):
            with contextlib.suppress(ValueError):
                when = (
                    " ("
                    + dt.datetime.fromisoformat(created).strftime("%Y-%m-%d %H:%M:%S UTC")
                    + ")"
                )
        title = f"Quorum {_clean(quorum.get('quorum_id'))}"
        if "age_s" in quorum:
            title += f", formed {_ago(quorum['age_s'])}{when}"
        title += f"; {_plural(len(members), 'member')}"
        if "max_step" in quorum:
            title += f", max step {_clean(quorum['max_step'])}"
        lines.append(title)
        if members:
            lines.append("")
            rows = [
                [
                    _clean(m.get("replica_id")),
                    _number(m.get("step")),
                    _number(m.get("world_size")),
                    _member_state(m),
                    _ago(m.get("heartbeat_age_s")),
                    _clean(m.get("address")) or "-",
                ]
                for m in members
            ]
            lines.extend(
                _table(
                    ["REPLICA", "STEP", "WORLD", "STATE", "HEARTBEAT", "MANAGER"],
                    rows,
                    right=frozenset({1, 2}),
                )
            )
    lines.append("")
    next_quorum = document.get("next_quorum") or {}
    if next_quorum:
        state = "ready" if next_quorum.get("ready") else "not ready"
        reason = _clean(next_quorum.get("reason"))
        lines.append(f"Next quorum: {state}" + (f": {reason}" if reason else ""))
    waiting = list(document.get("waiting") or [])
    if waiting:
        lines.append(f"Waiting for the next quorum: {_plural(len(waiting), 'request')}")
        lines.extend(
            _table(
                ["REPLICA", "STEP", "WAITED"],
                [
                    [
                        _clean(w.get("replica_id")),
                        _number(w.get("step")),
                        _duration(w.get("waited_s")),
                    ]
                    for w in waiting
                ],
                right=frozenset({1}),
            )
        )
    elif next_quorum:
        lines.append("Waiting for the next quorum: none")

    heartbeats = list(document.get("heartbeats") or [])
    lines.append("")
    if not heartbeats:
        lines.append("Heartbeats: none")
    else:
        healthy = sum(1 for h in heartbeats if h.get("healthy"))
        lines.append(
            f"Heartbeats: {_plural(len(heartbeats), 'replica group')}, {healthy} within the "
            "heartbeat timeout"
        )
        lines.extend(
            _table(
                ["REPLICA", "LAST HEARTBEAT", ""],
                [
                    [
                        _clean(h.get("replica_id")),
                        _ago(h.get("age_s")),
                        "" if h.get("healthy") else "expired",
                    ]
                    for h in heartbeats
                ],
            )
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
