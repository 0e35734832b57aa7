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

On Linux the server also listens on an abstract Unix socket with a random
name (:attr:`CheckpointServer.local_name`): a peer on the same host (in the
same network namespace) that knows the name fetches over it, which costs
both sides about 40% less CPU per byte than TCP over loopback. Both
listeners share the same handler, limits and token.
"""

from __future__ import annotations

import io
import logging
import re
import socket
import socketserver
import struct
import sys
import threading
import time
import uuid
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


# Linux's SO_PEERCRED (the socket module has it only on some builds).
_SO_PEERCRED = getattr(socket, "SO_PEERCRED", 17)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of a connected Unix socket's peer, as the kernel names them.

    The pid is 0 when the peer is outside this process's pid namespace.

    Raises:
        OSError: the kernel cannot say (not a Unix socket, or not Linux).
    """
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, 12))
    return pid, uid


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

    server: _TCPServer | _LocalServer
    protocol_version = "HTTP/1.0"
    aborted = False
    streaming = False
    responded = False

    def setup(self) -> None:
        """Set the socket options and register the connection."""
        super().setup()
        self.shared = self.server.shared
        if self.connection.family != socket.AF_UNIX:
            # The stream starts with small writes (HTTP headers, stream
            # prefix); with Nagle on, each waits for the peer's delayed ACK.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection.settimeout(self.shared.timeout_s)
        with self.shared.lock:
            self.shared.active.add(self)

    def finish(self) -> None:
        """Unregister the connection."""
        with self.shared.lock:
            self.shared.active.discard(self)
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

    def address_string(self) -> str:
        """The peer's address; a Unix socket's peer has none."""
        if isinstance(self.client_address, tuple) and self.client_address:
            return str(self.client_address[0])
        return "a peer on this host"

    def log_message(self, format: str, *args: Any) -> None:
        """Requests go to the debug log, not stderr."""
        logger.debug("checkpoint server %s: " + format, self.address_string(), *args)

    def _read_head(self) -> bytes | None:
        limit = min(self.shared.timeout_s, HEAD_SECONDS)
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
        self.connection.settimeout(self.shared.timeout_s)
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
        if not _auth.token_matches(self.headers.get("Authorization"), self.shared.token):
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
            self.shared.answer(self, step, key)
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


class _Shared:
    """What the TCP and the local listener share: the handler, limits and token."""

    def __init__(
        self, answer: Callable[[Request, int, str], None], timeout_s: float, token: str | None
    ) -> None:
        self.answer = answer
        self.timeout_s = timeout_s
        self.token = token
        self.lock = threading.Lock()
        self.active: set[Request] = set()
        self.threads: set[threading.Thread] = set()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)


class _Listening:
    """One thread per request, at most :data:`MAX_CONNECTIONS` at once over both listeners."""

    shared: _Shared

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.shared.slots.acquire(blocking=False):
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
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        thread = threading.Thread(
            target=self._run,
            args=(request, client_address),
            name="ftdist-ckpt-request",
            daemon=True,
        )
        with self.shared.lock:
            self.shared.threads.add(thread)
        thread.start()

    def _run(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)  # type: ignore[attr-defined]
        except Exception:  # one bad request must not take the server down
            logger.exception("checkpoint server: request from %s failed", client_address)
        finally:
            self.shutdown_request(request)  # type: ignore[attr-defined]
            self.shared.slots.release()
            with self.shared.lock:
                self.shared.threads.discard(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("checkpoint server: error with %s", client_address, exc_info=True)


class _TCPServer(_Listening, DualStackHTTPServer):
    daemon_threads = True

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        super().__init__(("::", 0), Request)


class _LocalServer(_Listening, socketserver.UnixStreamServer):
    """The listener on an abstract Unix socket (Linux): no file, gone with the socket."""

    request_queue_size = 1024

    def __init__(self, shared: _Shared, name: str) -> None:
        self.shared = shared
        super().__init__("\0" + name, Request)


def _listen_locally(shared: _Shared) -> tuple[_LocalServer | None, str | None]:
    """The local listener and its name, or (None, None) where there is none."""
    if not sys.platform.startswith("linux"):
        return None, None  # abstract Unix sockets are Linux's
    name = f"ftdist-checkpoint-{uuid.uuid4().hex}"
    try:
        return _LocalServer(shared, name), name
    except OSError as exc:  # a sandbox without Unix sockets: TCP alone serves
        logger.debug("checkpoint server: no local socket (%s); peers use TCP", exc)
        return None, None


def _closed(req: Request, step: int, key: str) -> None:
    req.reply(503, "the checkpoint server is shutting down")


class CheckpointServer:
    """The HTTP server of one transport, each listener on a thread of its own.

    Args:
        answer: called as ``answer(request, step, key)`` for every
            well-formed, authorised request.
        timeout_s: socket timeout of each connection.
        token: the job token, or None to accept anyone.
        local: also listen on an abstract Unix socket (Linux) for peers on
            this host.

    Raises:
        OSError: no TCP port can be bound.
    """

    def __init__(
        self,
        answer: Callable[[Request, int, str], None],
        timeout_s: float,
        token: str | None,
        local: bool = True,
    ) -> None:
        self._shared = _Shared(answer, timeout_s, token)
        self._server = _TCPServer(self._shared)
        self._local, self.local_name = _listen_locally(self._shared) if local else (None, None)
        self._threads = [
            threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"ftdist-http-transport{suffix}",
                daemon=True,
            )
            for server, suffix in ((self._server, ""), (self._local, "-local"))
            if server is not None
        ]
        for thread in self._threads:
            thread.start()

    @property
    def port(self) -> int:
        """The port it listens on (all interfaces, IPv4 and IPv6)."""
        return int(self._server.server_address[1])

    def streaming(self) -> list[Request]:
        """Requests now writing a checkpoint."""
        with self._shared.lock:
            return [r for r in self._shared.active if r.streaming]

    def abort_transfers(self) -> int:
        """Cut off every transfer in flight; returns how many there were."""
        transfers = self.streaming()
        for request in transfers:
            request.abort()
        return len(transfers)

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving, cut off every connection, and (with ``wait``) join the threads."""
        for server in (self._local, self._server):
            if server is not None:
                server.shutdown()
                server.server_close()
        # The handler is the owner's bound method, and the owner holds this
        # server: a cycle that kept the owner (and the model state it serves
        # or receives into) alive after shutdown until the cyclic collector
        # ran. A request accepted before the listeners closed gets a 503.
        self._shared.answer = _closed
        with self._shared.lock:
            active = list(self._shared.active)
            threads = list(self._shared.threads)
        for request in active:
            request.abort()
        if wait:  # (without, the threads end on their own within the socket timeout)
            for thread in [*self._threads, *threads]:
                thread.join(timeout=10)
