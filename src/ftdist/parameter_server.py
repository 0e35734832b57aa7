"""
Parameter servers
=================

A fault-tolerant parameter server on reconfigurable process groups, with
torchft's contract (``torchft.parameter_server``): subclass
:class:`ParameterServer`, say which group a session uses
(:meth:`~ParameterServer.new_process_group`) and what the server does with it
(:meth:`~ParameterServer.forward`).

Each client opens its own **session**: ``GET /new_session`` answers with a
session id and a store address, then the server thread that answered runs
the session: it joins a fresh two-member group as rank 0 and calls
``forward(session_id, pg)``. The client (:meth:`ParameterServer.new_session`)
joins the same group as rank 1. A failed session ends by itself (its group is
shut down); the client opens a new one. A client that dies takes only its own
session down.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.request
import uuid
from abc import ABC, abstractmethod
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch.distributed as dist

from ftdist._durations import as_timedelta
from ftdist._http_base import DualStackHTTPServer
from ftdist.process_group import ProcessGroup, reconfigure_with_store

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = timedelta(seconds=60)
# How long shutdown() waits for a session thread after aborting its group.
_SESSION_JOIN_S = 10.0


def _join(pg: Any, store_addr: str, rank: int) -> None:
    """Make ``pg`` member ``rank`` of the session's two-member group."""
    if callable(getattr(pg, "configure", None)):
        pg.configure(store_addr, rank, 2)
    else:  # a group that only speaks today's torchft reconfiguration API
        reconfigure_with_store(pg, store_addr, rank, 2)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ParameterServer(ABC):
    """A threaded parameter server; one reconfigurable group per client session.

    Subclasses implement :meth:`new_process_group` and :meth:`forward`.
    The server is rank 0 of every session's group, the client rank 1.

    Args:
        port: the HTTP port (0 picks a free one; see :meth:`address`).
        store_port: the port of the TCPStore the sessions meet on (0: free).
        host: the address to listen on and to advertise; "" (the default, as
            torchft) listens on every address and advertises this machine's
            hostname.

    Raises:
        OSError: a port cannot be bound.
    """

    def __init__(self, port: int, store_port: int = 0, *, host: str = "") -> None:
        self._host = host
        self._public_host = host or socket.gethostname()
        self.store = dist.TCPStore(
            host_name=host or "0.0.0.0", port=store_port, is_master=True, wait_for_workers=False
        )
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[threading.Thread, Any]] = {}
        self._closed = False
        self._server = DualStackHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._port: int = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="ftdist-parameter-server", daemon=True
        )
        self._thread.start()
        logger.info("ParameterServer listening on %s", self.address())

    def address(self) -> str:
        """Where clients open sessions: ``http://host:port/new_session``.

        Returns:
            The URL to pass to :meth:`new_session`.
        """
        return f"http://{_host_for_url(self._public_host)}:{self._port}/new_session"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/new_session":
                    self.send_error(400, f"invalid path, got {self.path}")
                    return
                session_id = str(uuid.uuid4())
                store_addr = (
                    f"{_host_for_url(server._public_host)}:{server.store.port}/session/{session_id}"
                )
                body = json.dumps({"session_id": session_id, "store_addr": store_addr}) + "\n"
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
                self.close_connection = True
                # The answer is complete; this thread now runs the session.
                server._handle_session(session_id, store_addr)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("%s - %s", self.address_string(), format % args)

        return Handler

    def _handle_session(self, session_id: str, store_addr: str) -> None:
        pg = self.new_process_group()
        with self._lock:
            closed = self._closed
            if not closed:
                self._sessions[session_id] = (threading.current_thread(), pg)
        if closed:
            _shutdown_group(pg)
            return
        try:
            _join(pg, store_addr, 0)
            self.forward(session_id, pg)
        except Exception:
            if self._closed:
                logger.info("session %s ended: the server shut down", session_id)
            else:
                logger.exception("session %s failed; its client must open a new one", session_id)
        finally:
            with self._lock:
                self._sessions.pop(session_id, None)
            _shutdown_group(pg)

    @classmethod
    @abstractmethod
    def new_process_group(cls) -> ProcessGroup:
        """A new, not yet configured group for one session (both ends call it).

        Returns:
            The group, e.g. ``ProcessGroupGloo()``.
        """

    @classmethod
    def new_session(
        cls, address: str, timeout: timedelta | float = _DEFAULT_TIMEOUT
    ) -> ProcessGroup:
        """Open a session on the server at ``address``; returns the client's group.

        The client is rank 1, the server rank 0.

        Args:
            address: the server's :meth:`address`.
            timeout: how long the HTTP request may take (the group's own
                timeout bounds joining it).

        Returns:
            The session's group, configured.

        Raises:
            urllib.error.URLError: the server cannot be reached.
            RuntimeError: the session's group could not be formed.
        """
        seconds = as_timedelta(timeout, "timeout").total_seconds()
        with urllib.request.urlopen(address, timeout=seconds) as response:
            reply = json.load(response)
        session_id, store_addr = reply["session_id"], reply["store_addr"]
        logger.info("joining parameter-server session %s at %s", session_id, store_addr)
        pg = cls.new_process_group()
        try:
            _join(pg, store_addr, 1)
        except BaseException:
            _shutdown_group(pg)
            raise
        return pg

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Serve one session (in its own thread); loop inside for several operations.

        When it returns or raises, the session's group is shut down and the
        client must open a new session.

        Args:
            session_id: the session's unique id.
            pg: the session's group; this server is rank 0, the client rank 1.
        """

    def shutdown(self) -> None:
        """Stop serving: no new sessions, live sessions' groups aborted, threads joined.

        Idempotent. A session still forming its group (waiting for its
        client) ends within that group's timeout.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions.values())
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        for _, pg in sessions:
            abort = getattr(pg, "abort", None)
            if callable(abort):
                abort()
        for thread, _ in sessions:
            thread.join(_SESSION_JOIN_S)

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _shutdown_group(pg: Any) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:
            logger.warning("shutting down a session's group failed", exc_info=True)


__all__ = ["ParameterServer"]
