"""
The checkpoint HTTP server
==========================

What stands between the network and a replica's live state. It stays up
whatever a client sends, and no client can hold it hostage:

- at most :data:`MAX_CONNECTIONS` requests are handled at once; more get
  503 at once;
- a request head must arrive within :data:`HEAD_SECONDS` (or the transport
  timeout, if shorter) and be at most :data:`MAX_HEAD_BYTES` long; only
  ``GET /checkpoint/{step}/{key}`` is understood, anything else is a 4xx;
- with a job token, a request without ``Authorization: Bearer <token>`` gets
  401 and nothing else;
- every socket read and write has the transport timeout, and a transfer
  still running when the transport revokes the state is cut off
  (:meth:`CheckpointServer.abort_transfers`), so the writer never waits on a
  reader past its deadline.

The transport decides what a well-formed, authorised request gets.
"""

from __future__ import annotations

import io
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from ftdist import _auth
from ftdist._http_base import DualStackHTTPServer

logger = logging.getLogger("ftdist.checkpointing.http")

MAX_CONNECTIONS = 64
MAX_HEAD_BYTES = 8192
MAX_PATH_BYTES = 256
HEAD_SECONDS = 10.0
_STEP = re.compile(r"-?[0-9]{1,19}")
_KEY = re.compile(r"full|[0-9]{1,6}")


def printable(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters with anything unprintable escaped (for status lines)."""
    return "".join(c if " " <= c <= "~" else f"\\x{ord(c) & 0xFF:02x}" for c in text[:limit])


class BadRequest(Exception):
    """A request the server answers with a 4xx status.

    Args:
        status: the HTTP status.
        message: the reason phrase.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_path(path: str) -> tuple[int, str]:
    """``(step, key)`` from ``/checkpoint/{step}/{key}``.

    Raises:
        BadRequest: the path is too long or not of that form.
    """
    if len(path) > MAX_PATH_BYTES:
        raise BadRequest(414, f"the path is longer than {MAX_PATH_BYTES} bytes")
    parts = path.split("/")
    if len(parts) != 4 or parts[0] or parts[1] != "checkpoint":
        raise BadRequest(
            400, f"invalid url format, expected /checkpoint/step/key but got {printable(path)}"
        )
    if not _STEP.fullmatch(parts[2]):
        raise BadRequest(400, f"invalid step {printable(parts[2], 40)!r} in {printable(path)}")
    if not _KEY.fullmatch(parts[3]):
        raise BadRequest(
            400, f"invalid key {printable(parts[3], 40)!r}: expected 'full' or a chunk index"
        )
    return int(parts[2]), parts[3]


class Request(BaseHTTPRequestHandler):
    """One connection: reads a bounded request head, checks it, hands it on."""

    server: _Server
    protocol_version = "HTTP/1.0"
    aborted = False
    streaming = False
    responded = False

    def setup(self) -> None:
        """Set the socket options and register the connection."""
        super().setup()
        # The stream starts with small writes (HTTP headers, stream prefix);
        # with Nagle on, each waits for the peer's delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection.settimeout(self.server.timeout_s)
        with self.server.lock:
            self.server.active.add(self)

    def finish(self) -> None:
        """Unregister the connection."""
        with self.server.lock:
            self.server.active.discard(self)
        try:
            super().finish()
        except OSError:
            pass

    def abort(self) -> None:
        """Cut this connection off (from another thread)."""
        self.aborted = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        """Requests go to the debug log, not stderr."""
        logger.debug("checkpoint server %s: " + format, self.address_string(), *args)

    def _read_head(self) -> bytes | None:
        limit = min(self.server.timeout_s, HEAD_SECONDS)
        deadline = time.monotonic() + limit
        head = bytearray()
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            if len(head) > MAX_HEAD_BYTES:
                self.reply(431, f"the request head is longer than {MAX_HEAD_BYTES} bytes")
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.debug("checkpoint server: no request head within %.1f s", limit)
                return None
            self.connection.settimeout(remaining)
            piece = self.connection.recv(4096)
            if not piece:
                return None
            head += piece
        self.connection.settimeout(self.server.timeout_s)
        return bytes(head)

    def handle(self) -> None:
        """Read the head with a deadline and a size bound, then parse it as usual."""
        self.command, self.request_version, self.requestline = "", "HTTP/1.0", ""
        try:
            head = self._read_head()
        except OSError as exc:
            logger.debug("checkpoint server: reading a request head failed: %s", exc)
            return
        if head is None:
            return
        words = head.split(b"\n", 1)[0].split()
        if len(words) != 3 or words[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
            # (HTTP/0.9 answers would carry no status line.)
            self.reply(400, "expected a request line 'GET /checkpoint/{step}/{key} HTTP/1.1'")
            return
        self.rfile = io.BytesIO(head)
        self.handle_one_request()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals, in the same plain form as ours."""
        self.reply(code, message or HTTPStatus(code).phrase)

    def do_GET(self) -> None:  # the name BaseHTTPRequestHandler dispatches to
        """Authorise and parse the request, then let the transport answer it."""
        if not _auth.token_matches(self.headers.get("Authorization"), self.server.token):
            self.reply(
                401,
                "the checkpoint server needs the job token: send 'Authorization: Bearer <token>' "
                f"(set {_auth.ENV_TOKEN} or {_auth.ENV_TOKEN_FILE} in every process of the job)",
                {"WWW-Authenticate": 'Bearer realm="ftdist"'},
            )
            return
        try:
            step, key = parse_path(self.path)
        except BadRequest as exc:
            self.reply(exc.status, exc.message)
            return
        try:
            self.server.answer(self, step, key)
        except OSError as exc:
            logger.warning(
                "checkpoint transfer of step %d to %s stopped: %s",
                step,
                self.address_string(),
                "aborted by disallow_checkpoint" if self.aborted else exc,
            )
            self.close_connection = True
        except Exception as exc:
            # A fault of this server, not of the request: say so if nothing was sent yet.
            logger.exception("checkpoint server: answering %s failed", printable(self.path))
            if not self.responded:
                self.reply(500, f"the checkpoint server failed: {type(exc).__name__}")

    def reply(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        """Answer with ``code`` and ``message`` as the reason phrase and a plain-text body."""
        body = (message + "\n").encode("utf-8", "replace")
        self.responded = True
        try:
            self.send_response(code, printable(message))
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the peer is gone; nothing to tell it
        self.close_connection = True


class _Server(DualStackHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        answer: Callable[[Request, int, str], None],
        timeout_s: float,
        token: str | None,
    ) -> None:
        self.answer = answer
        self.timeout_s = timeout_s
        self.token = token
        self.lock = threading.Lock()
        self.active: set[Request] = set()
        self.threads: set[threading.Thread] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(("::", 0), Request)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            message = f"the checkpoint server is busy ({MAX_CONNECTIONS} requests in flight)"
            try:
                request.settimeout(1.0)
                request.sendall(
                    f"HTTP/1.0 503 {message}\r\nContent-Type: text/plain\r\n"
                    f"Content-Length: {len(message) + 1}\r\nConnection: close\r\n\r\n"
                    f"{message}\n".encode()
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._run,
            args=(request, client_address),
            name="ftdist-ckpt-request",
            daemon=True,
        )
        with self.lock:
            self.threads.add(thread)
        thread.start()

    def _run(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # one bad request must not take the server down
            logger.exception("checkpoint server: request from %s failed", client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()
            with self.lock:
                self.threads.discard(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("checkpoint server: error with %s", client_address, exc_info=True)


class CheckpointServer:
    """The HTTP server of one transport, on a thread of its own.

    Args:
        answer: called as ``answer(request, step, key)`` for every
            well-formed, authorised request.
        timeout_s: socket timeout of each connection.
        token: the job token, or None to accept anyone.
    """

    def __init__(
        self, answer: Callable[[Request, int, str], None], timeout_s: float, token: str | None
    ) -> None:
        self._server = _Server(answer, timeout_s, token)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="ftdist-http-transport",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The port it listens on (all interfaces, IPv4 and IPv6)."""
        return int(self._server.server_address[1])

    def streaming(self) -> list[Request]:
        """Requests now writing a checkpoint."""
        with self._server.lock:
            return [r for r in self._server.active if r.streaming]

    def abort_transfers(self) -> int:
        """Cut off every transfer in flight; returns how many there were."""
        transfers = self.streaming()
        for request in transfers:
            request.abort()
        return len(transfers)

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving, cut off every connection, and (with ``wait``) join the threads."""
        self._server.shutdown()
        self._server.server_close()
        with self._server.lock:
            active = list(self._server.active)
            threads = list(self._server.threads)
        for request in active:
            request.abort()
        if wait:  # (without, the threads end on their own within the socket timeout)
            self._thread.join(timeout=10)
            for thread in threads:
                thread.join(timeout=10)
