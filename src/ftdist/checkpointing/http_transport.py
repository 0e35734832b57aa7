"""
HTTP checkpoint transport
=========================

The source replica serves its live state over HTTP; a recovering replica
pulls it. ``send_checkpoint`` only publishes a reference to the state (no
copy) and returns; the bytes are written straight from the tensors when a
peer asks. :meth:`HTTPTransport.disallow_checkpoint` (called by the Manager
after the commit vote, before the optimizer mutates the state) waits for
transfers in flight to finish.

``GET /checkpoint/{step}/full`` streams everything; with ``num_chunks > 1``
the receiver fetches ``/checkpoint/{step}/{i}`` for each chunk in parallel.
A request for another step than the one served gets 400: a replica never
heals from the wrong step.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import torch

from ftdist.checkpointing import _wire
from ftdist.checkpointing._rwlock import RWLock
from ftdist.checkpointing.transport import CheckpointTransport, TransferStats
from ftdist.errors import CheckpointError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # One socket for IPv4 and IPv6 peers.
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _default_device(meta: _wire.TensorMeta) -> torch.device:
    if meta.device.startswith("cuda") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class HTTPTransport(CheckpointTransport[T]):
    """Serves the live state dict over HTTP and fetches peers' states.

    Args:
        timeout: per-request socket timeout, and how long
            :meth:`disallow_checkpoint` waits for transfers in flight.
        num_chunks: 0 or 1 for one stream; more for that many parallel
            streams (helps where one TCP stream cannot fill the link).
        hostname: the name peers use to reach this server (default: this
            host's name).

    Raises:
        ValueError: ``num_chunks`` is negative.
        TypeError: ``timeout`` is not a timedelta.
    """

    def __init__(
        self, timeout: timedelta, num_chunks: int = 0, hostname: str | None = None
    ) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        if not isinstance(num_chunks, int) or num_chunks < 0:
            raise ValueError(f"num_chunks must be an int >= 0, got {num_chunks!r}")
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._hostname = hostname or socket.gethostname()
        self._lock = RWLock(timeout.total_seconds())
        self._lock.w_acquire()  # nothing is served until send_checkpoint
        self._allowed = False
        self._step = -1
        self._streams: list[tuple[bytes, list[torch.Tensor]]] = []
        self._state_ref: Any = None
        self.last_transfer: TransferStats | None = None
        self._server = _Server(("::", 0), self._handler_class())
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="ftdist-http-transport",
            daemon=True,
        )
        self._thread.start()

    # -- serving -------------------------------------------------------------
    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._timeout.total_seconds()

            def setup(self) -> None:
                super().setup()
                # The stream starts with small writes (HTTP headers, stream
                # header); with Nagle on, each waits for the peer's delayed
                # ACK (40-200 ms on loopback).
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("checkpoint server: " + format, *args)

            def do_GET(self) -> None:
                transport._serve(self)

        return Handler

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        parts = req.path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "checkpoint" or not parts[1].lstrip("-").isdigit():
            req.send_error(400, f"expected /checkpoint/<step>/<full|chunk>, got {req.path}")
            return
        step, key = int(parts[1]), parts[2]
        try:
            self._lock.r_acquire()
        except TimeoutError:
            req.send_error(503, "no checkpoint is being served")
            return
        try:
            if step != self._step:
                req.send_error(400, f"serving the checkpoint of step {self._step}, not step {step}")
                return
            if key == "full":
                streams = (
                    self._streams if len(self._streams) == 1 else _wire.plan(self._state_ref, step)
                )
            elif key.isdigit() and int(key) < len(self._streams):
                streams = [self._streams[int(key)]]
            else:
                req.send_error(400, f"no chunk {key!r}: this source serves {len(self._streams)}")
                return
            header, tensors = streams[0]
            req.send_response(200)
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(_wire.stream_size(header, tensors)))
            req.end_headers()
            small = bytearray()
            for buf in _wire.chunks(header, tensors):
                # Coalesce small pieces into one write; stream big ones as is.
                if len(buf) < 65536:
                    small += buf
                    continue
                if small:
                    req.wfile.write(small)
                    small = bytearray()
                req.wfile.write(buf)
            if small:
                req.wfile.write(small)
        except (BrokenPipeError, ConnectionResetError):
            logger.warning("a peer disconnected while fetching the checkpoint of step %d", step)
        finally:
            self._lock.r_release()

    def metadata(self) -> str:
        """``http://host:port/checkpoint/``."""
        host = f"[{self._hostname}]" if ":" in self._hostname else self._hostname
        return f"http://{host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Serve ``state_dict`` (by reference, not copied) as step ``step``.

        Returns at once; peers pull. The state must not change until
        :meth:`disallow_checkpoint` returns.

        Raises:
            TypeError: the state holds a leaf this transport cannot carry.
        """
        streams = _wire.plan(state_dict, step, max(1, self._num_chunks))
        if self._allowed:
            self.disallow_checkpoint()
        self._state_ref = state_dict
        self._streams = streams
        self._step = step
        self._allowed = True
        self._lock.w_release()

    def disallow_checkpoint(self) -> None:
        """Stop serving; waits for transfers in flight (up to the timeout).

        Raises:
            TimeoutError: a transfer still reads the state after the timeout.
        """
        if not self._allowed:
            return
        self._lock.w_acquire()
        self._allowed = False
        self._streams = []
        self._state_ref = None
        self._step = -1

    # -- fetching ------------------------------------------------------------
    def _fetch(
        self, url: str, step: int, timeout: timedelta
    ) -> tuple[_wire.Header, dict[int, torch.Tensor], int]:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(
            parts.hostname or "", parts.port, timeout=timeout.total_seconds()
        )
        try:
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.request("GET", parts.path)
            resp = conn.getresponse()
            if resp.status != 200:
                body = resp.read(2000).decode(errors="replace")
                raise CheckpointError(f"{url} answered {resp.status}: {body.strip()}")
            reader = _wire.StreamReader(resp.readinto, url)
            header, tensors = _wire.read_leaves(reader, step, _default_device)
            return header, tensors, reader._total
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or isinstance(exc, socket.timeout):
                raise TimeoutError(f"fetching {url} timed out after {timeout}") from exc
            raise CheckpointError(f"fetching {url} failed: {exc}") from exc
        finally:
            conn.close()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetch the state of ``step`` from the source at ``metadata``.

        Raises:
            CheckpointError: the source serves another step, or the stream
                was truncated or corrupted.
            TimeoutError: the source stalled for longer than ``timeout``.
        """
        start = time.perf_counter()
        base = f"{metadata}{step}"
        if self._num_chunks <= 1:
            header, tensors, nbytes = self._fetch(f"{base}/full", step, timeout)
        else:
            with ThreadPoolExecutor(self._num_chunks, thread_name_prefix="ftdist-fetch") as pool:
                parts = list(
                    pool.map(
                        lambda i: self._fetch(f"{base}/{i}", step, timeout), range(self._num_chunks)
                    )
                )
            header = parts[0][0]
            tensors = {k: v for part in parts for k, v in part[1].items()}
            nbytes = sum(part[2] for part in parts)
        state = cast(T, _wire.assemble(header, tensors))
        self.last_transfer = TransferStats(nbytes, time.perf_counter() - start)
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server (and join its thread if ``wait``)."""
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=10)
