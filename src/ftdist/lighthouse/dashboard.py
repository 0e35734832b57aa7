"""
Lighthouse dashboard
====================

A small HTTP server next to the lighthouse, for people and for monitoring:

``GET /``
    A self-contained page (no external scripts) that polls ``/status.json``
    every second: the current quorum (id, age, members with step, manager and
    store address, world size; members behind the max step are marked
    ``recovering``), why the next quorum is or is not ready, and heartbeat ages.
``GET /status.json``
    The same data as JSON (:func:`~ftdist.lighthouse.status.build_status`).
``GET /metrics``
    Prometheus text format: quorum id, members, heartbeating replicas, waiting
    requests, totals and the quorum latency histogram.
``POST /replica/<replica_id>/kill``
    Calls that member's manager ``Kill`` RPC, as torchft's dashboard does. It
    is off unless the lighthouse has a ``kill_token``, and then needs it, as
    ``Authorization: Bearer <token>`` or ``X-Ftdist-Token: <token>``: anyone
    who can reach the port could otherwise stop a training job.

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
``button.kill[data-replica-id]`` and the ``#kill-token`` input.
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import json
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable
from importlib import resources
from typing import Any

from ftdist.lighthouse.status import render_metrics

__all__ = ["DashboardServer"]

logger = logging.getLogger("ftdist.lighthouse.dashboard")


def _page() -> bytes:
    return resources.files("ftdist.lighthouse").joinpath("dashboard.html").read_bytes()


class _HTTPServer(http.server.ThreadingHTTPServer):
    """Threaded HTTP server whose request threads carry an ftdist name."""

    # Closing joins the request threads, so none outlives the dashboard.
    daemon_threads = False
    block_on_close = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: set[Any] = set()
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
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


class _HTTPServerV6(_HTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # Accept IPv4 too when bound to the IPv6 wildcard.
        with contextlib.suppress(OSError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class DashboardServer:
    """Serves the dashboard on a thread named ``ftdist-lighthouse-http``.

    Args:
        host: interface to bind (``""``, ``::`` and ``0.0.0.0`` mean all).
        port: port to bind; 0 picks a free one.
        status: returns the current :func:`build_status` document; called
            from request threads.
        kill: kills a member by replica id and returns its manager address;
            raises ``LookupError`` if it is not a member.
        kill_token: the shared secret; None disables the kill action.

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
    ) -> None:
        handler = _make_handler(status, kill, kill_token)
        self._httpd: _HTTPServer
        if host in ("", "0.0.0.0"):
            self._httpd = _HTTPServer(("0.0.0.0", port), handler)
        elif ":" in host:
            self._httpd = _HTTPServerV6((host, port), handler)
        else:
            self._httpd = _HTTPServer((host, port), handler)
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
) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "ftdist-lighthouse"
        protocol_version = "HTTP/1.1"
        # Bounds an idle keep-alive connection (and its thread).
        timeout = 30

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s %s", self.address_string(), format % args)

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, code: int, data: object) -> None:
            self._send(code, json.dumps(data).encode(), "application/json")

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
            except RuntimeError as exc:  # the lighthouse is stopping
                self._json(503, {"error": str(exc)})

        do_HEAD = do_GET

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(min(length, 65536))
            parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
            if len(parts) != 3 or parts[0] != "replica" or parts[2] != "kill" or not parts[1]:
                self._json(404, {"error": "POST /replica/<replica_id>/kill is the only action"})
                return
            replica_id = urllib.parse.unquote(parts[1])
            if kill_token is None:
                self._json(
                    403,
                    {
                        "error": "kill is disabled: start the lighthouse with a kill "
                        "token (--kill-token or FTDIST_LIGHTHOUSE_KILL_TOKEN)"
                    },
                )
                return
            given = self.headers.get("X-Ftdist-Token") or ""
            auth = self.headers.get("Authorization") or ""
            if auth.startswith("Bearer "):
                given = auth[len("Bearer ") :]
            if not hmac.compare_digest(given.encode(), kill_token.encode()):
                self._json(401, {"error": "missing or wrong kill token"})
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
