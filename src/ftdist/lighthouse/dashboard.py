"""
Lighthouse dashboard
====================

A small HTTP server next to the lighthouse, for people and for monitoring:

``GET /``
    A self-contained page (no external scripts) that polls ``/status.json``
    every second: the current quorum (id, age, members with step, manager and
    store address, world size; members behind the max step are marked
    ``recovering``), why the next quorum is or is not ready, and heartbeat ages.
    A replica of a replicated lighthouse adds a "Lighthouse replicas" panel:
    the job, this replica and its role, the leader (linked to its
    dashboard), every live replica, the etcd endpoints' health, the lease and
    why this replica serves or not, and the failover history. A follower
    holds no quorum: a notice at the top says so and links to the leader's
    dashboard.
    Below them, the job's history (:mod:`ftdist.lighthouse.history`), drawn
    by the page's own script as SVG: participating groups over time with
    failure, leave, rejoin and failover marks; committed steps per second;
    one bar per heal split into its phases; heals in flight; the events.
``GET /status.json``
    The same data as JSON (:func:`~ftdist.lighthouse.status.build_status`).
``GET /metrics``
    Prometheus text format: quorum id, members, heartbeating replicas, waiting
    requests, totals and the quorum latency histogram; on a replica of a
    replicated lighthouse also whether it leads and serves, the replicas and
    failovers etcd holds, its lease's time left and each etcd endpoint's
    health.
``POST /replica/<replica_id>/kill``
    Calls that member's manager ``Kill`` RPC, as torchft's dashboard does. It
    is off unless the lighthouse has a job token or a ``kill_token``, and then
    needs one of them, as ``Authorization: Bearer <token>`` or
    ``X-Ftdist-Token: <token>`` (401 otherwise): anyone who can reach the port
    could otherwise stop a training job. The lighthouse presents the job
    token to the manager.

Bounds (a client never holds more than its share, and never the
lighthouse's thread): at most 64 connections at once (more are answered 503
and closed), 16 KiB of request line and headers (431), 64 KiB of body (413;
a negative, malformed or repeated ``Content-Length`` is a 400, chunked
bodies are refused), 10 s per socket read or write and 30 s per request,
idle keep-alive waits included. Concurrent status requests share one
computation on the lighthouse's thread, computations are spaced by their
own duration, and every request gets a document computed after it arrived.

Deviation from torchft: torchft serves this on the gRPC port; here it has its
own port (see :mod:`ftdist.lighthouse.server`). ``/status`` is JSON
rather than an HTML fragment.

Page hooks for browser tests: ``#quorum-id``, ``#num-members``,
``#max-step``, ``#quorum-age``, ``#num-heartbeating``, ``#num-waiting``,
``#next-reason``, ``#error``, ``#members`` with one
``.member[data-replica-id]`` per member (class ``recovering`` when behind;
fields ``.rid``, ``dd.step``, ``dd.manager``, ``dd.store``,
``dd.world-size``, ``dd.heartbeat-age``), ``#heartbeats`` with one
``.heartbeat[data-replica-id]`` each (class ``old`` when expired),
``button.kill[data-replica-id]`` and the ``#kill-token`` input. Replicated
only (``#replication`` and ``#follower-notice`` are hidden otherwise):
``#repl-job``, ``#repl-self``, ``#repl-role``, ``#repl-leader``,
``#repl-lease``, ``#repl-serving``, ``#repl-error``, ``#follower-notice``
(with ``a#leader-link`` when the leader's dashboard is known), ``#replicas``
with one ``tr.replica[data-name]`` per replica (classes ``role-<role>``,
``self`` for this one; cells ``td.name``, ``td.role``, ``td.address``,
``td.dashboard``), ``#etcd`` with one ``tr.etcd-member[data-endpoint]`` per
endpoint (class ``down`` when its probe failed; cells ``td.health``,
``td.version``, ``td.raft``, ``td.latency``) and ``#failovers`` with one
``tr.failover`` per record, newest first (``td.time``, ``td.leader``,
``td.previous``). History: ``#participants-chart`` (``path#participants-line``
with ``data-points``; ``circle.failure-mark`` and ``circle.leave-mark`` with
``data-replica-id`` and ``data-cause``, ``circle.rejoin-mark``,
``line.failover-mark``), ``#steps-chart`` (``rect.rate-bar[data-rate]``),
``#heals`` (``div.heal`` with ``data-replica-id``, ``data-step``,
``data-total``, class ``failed`` when it failed, and one ``rect.phase`` per
phase with ``data-phase`` and ``data-seconds``), ``#heals-in-flight``
(``div.heal-progress[data-replica-id][data-phase]``) and ``#history-events``
(one ``li.event.event-<kind>`` each).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from importlib import resources
from typing import Any

from ftdist._auth import bearer, token_matches
from ftdist._http_base import DualStackHTTPServer
from ftdist.lighthouse.status import render_metrics

__all__ = ["DashboardServer"]

logger = logging.getLogger("ftdist.lighthouse.dashboard")


_MAX_CONNECTIONS = 64
_MAX_HEAD_BYTES = 16 * 1024
_MAX_BODY_BYTES = 64 * 1024
_IO_TIMEOUT_S = 10.0
_REQUEST_DEADLINE_S = 30.0
_STATUS_WAIT_S = 10.0
_CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: 44\r\nConnection: close\r\n\r\n"
    b'{"error": "too many dashboard connections"}\n'
)


def _page() -> bytes:
    return resources.files("ftdist.lighthouse").joinpath("dashboard.html").read_bytes()


class _HeadLimit:
    """The request stream, allowing each request's line and headers at most
    ``_MAX_HEAD_BYTES``; past that ``readline`` returns nothing and
    :attr:`overflow` is set (the handler answers 431)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.remaining = _MAX_HEAD_BYTES
        self.overflow = False

    def next_request(self) -> None:
        self.remaining = _MAX_HEAD_BYTES
        self.overflow = False

    def readline(self, size: int = -1) -> bytes:
        if self.remaining <= 0:
            self.overflow = True
            return b""
        limit = self.remaining if size < 0 else min(size, self.remaining)
        line: bytes = self._raw.readline(limit)
        self.remaining -= len(line)
        if self.remaining <= 0 and not line.endswith(b"\n"):
            self.overflow = True
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _FreshStatus:
    """The status document for many concurrent requests at the cost of few.

    A request gets the result of a computation that started after it
    arrived (never a stale document); requests that arrive while one runs
    share the next one. A computation starts no sooner than its
    predecessor's duration after it ended, so dashboard traffic takes at
    most half of the lighthouse's thread.
    """

    def __init__(self, compute: Callable[[], dict[str, Any]]) -> None:
        self._compute = compute
        self._cond = threading.Condition()
        self._running = False
        self._started = 0
        self._done = 0
        self._result: tuple[dict[str, Any] | None, BaseException | None] = (None, None)
        self._not_before = 0.0

    def __call__(self) -> dict[str, Any]:
        deadline = time.monotonic() + _STATUS_WAIT_S
        with self._cond:
            wanted = self._started + 1
            while self._done < wanted:
                if not self._running:
                    break
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("the lighthouse did not produce its status in time")
            else:
                return self._unpack(self._result)
            self._running = True
            self._started += 1
            mine = self._started
            pause = self._not_before - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        start = time.monotonic()
        result: tuple[dict[str, Any] | None, BaseException | None] = (None, None)
        try:
            result = (self._compute(), None)
        except Exception as exc:
            result = (None, exc)
        finally:
            with self._cond:
                self._running = False
                self._done = mine
                self._result = result
                self._not_before = time.monotonic() + (time.monotonic() - start)
                self._cond.notify_all()
        return self._unpack(result)

    @staticmethod
    def _unpack(result: tuple[dict[str, Any] | None, BaseException | None]) -> dict[str, Any]:
        value, error = result
        if error is not None or value is None:
            # A new exception for each request thread that shares the result.
            raise RuntimeError(f"the lighthouse could not produce its status: {error}")
        return value


class _HTTPServer(DualStackHTTPServer):
    """Threaded HTTP server whose request threads carry an ftdist name.

    It listens on IPv4 unless its host is an IPv6 address (then IPv4 too).
    """

    # Closing joins the request threads, so none outlives the dashboard.
    daemon_threads = False
    block_on_close = True

    def __init__(self, server_address: tuple[str, int], handler: Any) -> None:
        self.address_family = socket.AF_INET6 if ":" in server_address[0] else socket.AF_INET
        # Open connections and when their current request (or idle wait) began.
        self._open: dict[Any, float] = {}
        self._open_lock = threading.Lock()
        super().__init__(server_address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = len(self._open) >= _MAX_CONNECTIONS
            if not full:
                self._open[request] = time.monotonic()
        if full:
            # Answered from the accepting thread without blocking it.
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_BUSY)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def request_began(self, request: Any) -> None:
        """Restart ``request``'s deadline: a new request (or idle wait) begins."""
        with self._open_lock:
            if request in self._open:
                self._open[request] = time.monotonic()

    def service_actions(self) -> None:
        # Called by serve_forever about every poll interval: a connection
        # past its deadline (a client too slow, or idle too long) is shut
        # down, which wakes its thread.
        cutoff = time.monotonic() - _REQUEST_DEADLINE_S
        with self._open_lock:
            late = [sock for sock, began in self._open.items() if began < cutoff]
        for sock in late:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanishes mid-request is routine, not worth a traceback
        # on stderr.
        logger.debug("dashboard request from %s failed", client_address, exc_info=True)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Wake every request thread parked on an idle keep-alive connection."""
        with self._open_lock:
            open_now = list(self._open)
        for sock in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        threading.current_thread().name = "ftdist-lighthouse-http-request"
        super().process_request_thread(request, client_address)


class DashboardServer:
    """Serves the dashboard on a thread named ``ftdist-lighthouse-http``.

    Args:
        host: interface to bind (``""``, ``::`` and ``0.0.0.0`` mean all).
        port: port to bind; 0 picks a free one.
        status: returns the current :func:`build_status` document; called
            from request threads.
        kill: kills a member by replica id and returns its manager address;
            raises ``LookupError`` if it is not a member.
        kill_token: a secret that authorizes the kill action.
        job_token: the job token, which authorizes it too; with neither
            the kill action is off.

    Raises:
        OSError: if the port cannot be bound.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        status: Callable[[], dict[str, Any]],
        kill: Callable[[str], str],
        kill_token: str | None,
        job_token: str | None = None,
    ) -> None:
        handler = _make_handler(_FreshStatus(status), kill, kill_token, job_token)
        self._httpd: _HTTPServer
        self._httpd = _HTTPServer(("0.0.0.0" if host == "" else host, port), handler)
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="ftdist-lighthouse-http",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving, close the port and join every thread. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        # A browser keeps idle keep-alive connections open; without this,
        # server_close() would wait on their threads forever.
        self._httpd.close_connections()
        self._httpd.server_close()


def _make_handler(
    status: Callable[[], dict[str, Any]],
    kill: Callable[[str], str],
    kill_token: str | None,
    job_token: str | None,
) -> type[http.server.BaseHTTPRequestHandler]:
    secrets = [t for t in (job_token, kill_token) if t is not None]

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "ftdist-lighthouse"
        protocol_version = "HTTP/1.1"
        # A request without a version (HTTP/0.9, or a line cut off) is
        # answered as HTTP/1.0: HTTP/0.9 answers, errors included, have no
        # status line.
        default_request_version = "HTTP/1.0"
        # One socket read or write; the server's deadline bounds the rest.
        timeout = _IO_TIMEOUT_S
        rfile: Any
        server: _HTTPServer

        def setup(self) -> None:
            super().setup()
            self.rfile = _HeadLimit(self.rfile)
            self.body = b""

        def handle_one_request(self) -> None:
            self.rfile.next_request()
            self.server.request_began(self.request)
            super().handle_one_request()

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s %s", self.address_string(), format % args)

        def parse_request(self) -> bool:
            if not super().parse_request():
                return False
            if self.rfile.overflow:
                self._refuse(431, f"request line and headers exceed {_MAX_HEAD_BYTES} bytes")
                return False
            if self.headers.get("Transfer-Encoding") is not None:
                self._refuse(400, "Transfer-Encoding is not supported; send Content-Length")
                return False
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                self.body = b""
                return True
            if len(lengths) > 1 or not _CONTENT_LENGTH.fullmatch(lengths[0].strip()):
                self._refuse(400, f"bad Content-Length {lengths!r}")
                return False
            length = int(lengths[0])
            if length > _MAX_BODY_BYTES:
                self._refuse(413, f"body of {length} bytes; the limit is {_MAX_BODY_BYTES}")
                return False
            self.body = self.rfile.read(length)
            if len(self.body) < length:  # the client went away mid-body
                self.close_connection = True
                return False
            return True

        def _refuse(self, code: int, message: str) -> None:
            # The stream may hold an unread body: answer and close.
            self.close_connection = True
            self._json(code, {"error": message}, close=True)

        def _send(
            self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(
            self,
            code: int,
            data: object,
            close: bool = False,
            headers: dict[str, str] | None = None,
        ) -> None:
            extra = dict(headers or {})
            if close:
                extra["Connection"] = "close"
            self._send(code, json.dumps(data).encode(), "application/json", extra)

        def do_GET(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            try:
                if path in ("/", "/index.html"):
                    self._send(200, _page(), "text/html; charset=utf-8")
                elif path in ("/status.json", "/status"):
                    self._json(200, status())
                elif path == "/metrics":
                    body = render_metrics(status()).encode()
                    self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")
                else:
                    self._json(404, {"error": f"no such page: {path}"})
            except (RuntimeError, TimeoutError) as exc:  # the lighthouse is stopping or stuck
                self._json(503, {"error": str(exc) or "the lighthouse did not answer in time"})

        do_HEAD = do_GET

        def _authorized(self) -> str | None:
            """Why the request may not act, or None."""
            presented = self.headers.get("Authorization")
            raw = self.headers.get("X-Ftdist-Token")
            if presented is None and raw is not None:
                presented = bearer(raw)
            # Every secret is compared, so the time taken says nothing of which matched.
            matches = [token_matches(presented, secret) for secret in secrets]
            if any(matches):
                return None
            if presented is None:
                return (
                    "the kill action requires the job token (FTDIST_JOB_TOKEN) or the kill "
                    "token: send 'Authorization: Bearer <token>'"
                )
            return "the token presented is neither the job token nor the kill token"

        def do_POST(self) -> None:
            parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
            if len(parts) != 3 or parts[0] != "replica" or parts[2] != "kill" or not parts[1]:
                self._json(404, {"error": "POST /replica/<replica_id>/kill is the only action"})
                return
            replica_id = urllib.parse.unquote(parts[1])
            if not secrets:
                self._json(
                    403,
                    {
                        "error": "kill is disabled: start the lighthouse with a job token "
                        "(FTDIST_JOB_TOKEN or --token-file) or a kill token (--kill-token or "
                        "FTDIST_LIGHTHOUSE_KILL_TOKEN)"
                    },
                )
                return
            problem = self._authorized()
            if problem is not None:
                self._json(401, {"error": problem}, headers={"WWW-Authenticate": "Bearer"})
                return
            try:
                address = kill(replica_id)
            except LookupError as exc:
                self._json(404, {"error": str(exc.args[0] if exc.args else exc)})
            except Exception as exc:
                logger.warning("kill of %s failed: %s", replica_id, exc)
                self._json(502, {"error": f"failed to kill replica {replica_id}: {exc}"})
            else:
                self._json(200, {"killed": replica_id, "address": address})

    return Handler
