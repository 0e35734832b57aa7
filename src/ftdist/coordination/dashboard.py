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
    The same data as JSON (:func:`build_status`).
``GET /metrics``
    Prometheus text format: quorum id, members, heartbeating replicas, waiting
    requests, totals and the quorum latency histogram.
``POST /replica/<replica_id>/kill``
    Calls that member's manager ``Kill`` RPC, as torchft's dashboard does. It
    is off unless the lighthouse has a ``kill_token``, and then needs it, as
    ``Authorization: Bearer <token>`` or ``X-Ftdist-Token: <token>``: anyone
    who can reach the port could otherwise stop a training job.

Deviation from torchft: torchft serves this on the gRPC port; here it has its
own port (see :mod:`ftdist.coordination.lighthouse`). ``/status`` is JSON
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
import datetime as dt
import hmac
import http.server
import json
import logging
import math
import socket
import threading
import urllib.parse
from collections.abc import Callable
from importlib import resources
from typing import Any

from ftdist.coordination.config import LighthouseConfig
from ftdist.coordination.engine import LighthouseEngine

__all__ = ["DashboardServer", "build_status", "render_metrics"]

logger = logging.getLogger("ftdist.coordination.dashboard")


def _round3(value: float) -> float:
    return round(value, 3)


def build_status(engine: LighthouseEngine, config: LighthouseConfig) -> dict[str, Any]:
    """Describe the lighthouse as plain JSON-ready data.

    Must run on the engine's event loop.

    Args:
        engine: the lighthouse's engine.
        config: the lighthouse's config.

    Returns:
        The status document served at ``/status.json``.

    Raises:
        Nothing.
    """
    now = engine.now()
    state = engine.state
    heartbeat_timeout = engine.settings.heartbeat_timeout_s
    decision = engine.decide()
    heartbeats = [
        {
            "replica_id": rid,
            "age_s": _round3(now - seen),
            "healthy": now - seen < heartbeat_timeout,
        }
        for rid, seen in sorted(state.heartbeats.items())
    ]
    quorum: dict[str, Any] | None = None
    current = engine.current
    if current is not None:
        members = current.quorum.participants
        max_step = max((m.step for m in members), default=-1)
        created = current.quorum.created.ToDatetime(tzinfo=dt.timezone.utc)
        quorum = {
            "quorum_id": current.quorum.quorum_id,
            "created": created.isoformat(),
            "age_s": _round3(now - current.formed_at),
            "num_members": len(members),
            "max_step": max_step,
            "members": [
                {
                    "replica_id": m.replica_id,
                    "step": m.step,
                    "address": m.address,
                    "store_address": m.store_address,
                    "world_size": m.world_size,
                    "shrink_only": m.shrink_only,
                    "commit_failures": m.commit_failures,
                    "recovering": m.step != max_step,
                    "heartbeat_age_s": (
                        _round3(now - state.heartbeats[m.replica_id])
                        if m.replica_id in state.heartbeats
                        else None
                    ),
                }
                for m in members
            ],
        }
    latency = engine.latency
    cumulative, buckets = 0, []
    for bound, count in zip((*latency.bounds, math.inf), latency.counts, strict=True):
        cumulative += count
        buckets.append(["+Inf" if math.isinf(bound) else bound, cumulative])
    return {
        "quorum_id": state.quorum_id,
        "next_quorum": {"ready": decision.ready, "reason": decision.reason},
        "quorum": quorum,
        "waiting": [
            {"replica_id": rid, "step": p.member.step, "waited_s": _round3(now - p.joined)}
            for rid, p in sorted(state.participants.items())
        ],
        "heartbeats": heartbeats,
        "num_heartbeating": sum(1 for h in heartbeats if h["healthy"]),
        "num_subscribers": engine.num_subscribers,
        "quorums_total": engine.num_quorums,
        "member_failures_total": engine.num_member_failures,
        "quorum_latency_seconds": {
            "buckets": buckets,
            "sum": latency.total,
            "count": cumulative,
        },
        "settings": {
            "min_replicas": config.min_replicas,
            "join_timeout_ms": config.join_timeout / dt.timedelta(milliseconds=1),
            "quorum_tick_ms": config.quorum_tick / dt.timedelta(milliseconds=1),
            "heartbeat_timeout_ms": config.heartbeat_timeout / dt.timedelta(milliseconds=1),
            "kill_enabled": config.kill_token is not None,
        },
        "uptime_s": _round3(now - engine.started_at),
    }


def render_metrics(status: dict[str, Any]) -> str:
    """Render a status document in the Prometheus text exposition format.

    Args:
        status: a document from :func:`build_status`.

    Returns:
        The ``/metrics`` body.

    Raises:
        KeyError: if ``status`` lacks a field :func:`build_status` produces.
    """
    quorum = status["quorum"]
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name} {value:g}")

    prefix = "ftdist_lighthouse"
    metric(f"{prefix}_quorum_id", "gauge", "Id of the current quorum (0 before the first).",
           status["quorum_id"])
    metric(f"{prefix}_quorum_members", "gauge", "Members of the current quorum.",
           quorum["num_members"] if quorum else 0)
    metric(f"{prefix}_heartbeating_replicas", "gauge",
           "Replica groups whose last heartbeat is within the heartbeat timeout.",
           status["num_heartbeating"])
    metric(f"{prefix}_waiting_requests", "gauge", "Quorum requests waiting for the next quorum.",
           len(status["waiting"]))
    metric(f"{prefix}_next_quorum_ready", "gauge", "1 if a quorum could form now, else 0.",
           1 if status["next_quorum"]["ready"] else 0)
    metric(f"{prefix}_event_subscribers", "gauge", "Open failure-news streams.",
           status["num_subscribers"])
    metric(f"{prefix}_quorums_total", "counter", "Quorums formed since start.",
           status["quorums_total"])
    metric(f"{prefix}_member_failures_total", "counter",
           "Quorum members declared dead after missing heartbeats.",
           status["member_failures_total"])
    hist = status["quorum_latency_seconds"]
    name = f"{prefix}_quorum_latency_seconds"
    lines.append(f"# HELP {name} Time from a round's first quorum request to its quorum.")
    lines.append(f"# TYPE {name} histogram")
    for bound, count in hist["buckets"]:
        le = bound if isinstance(bound, str) else f"{bound:g}"
        lines.append(f'{name}_bucket{{le="{le}"}} {count}')
    lines.append(f"{name}_sum {hist['sum']:.6f}")
    lines.append(f"{name}_count {hist['count']}")
    return "\n".join(lines) + "\n"


def _page() -> bytes:
    return resources.files("ftdist.coordination").joinpath("dashboard.html").read_bytes()


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
        """Stop serving, close the port and join every thread. Idempotent.

        Raises:
            Nothing.
        """
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
                self._json(403, {"error": "kill is disabled: start the lighthouse with a kill "
                                 "token (--kill-token or FTDIST_LIGHTHOUSE_KILL_TOKEN)"})
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
