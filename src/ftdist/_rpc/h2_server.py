"""
A gRPC server on HTTP/2 written here, one thread, no grpcio underneath
======================================================================

The lighthouse answers two calls per replica group and round, the manager
server two per group rank and step. grpcio's core spends about 140 us of CPU
on each (three completion-queue events, hand-offs between its EventEngine
threads and the thread that runs the handler), where
torchft's Rust lighthouse spends about 50; at 2 replica groups that was a
quorum round 1.3x as long as torchft's. This server reads each socket on the
thread that runs the handlers, decodes HTTP/2 frames (:mod:`ftdist._rpc.h2`)
and writes the reply in the same pass: one ``recv`` and one ``send`` per call
when the client is fast.

It serves plaintext only (TLS stays on :mod:`ftdist._rpc.cq_server`), unary
and server-streaming methods, and offers the same model as that server:
handlers run on the server thread with the request bytes and a call to
answer now or later (:class:`H2Call`); anything else runs there through
:meth:`H2Server.call_soon`, :meth:`H2Server.call_later` or the tick.

What it enforces: requests above ``max_request_bytes`` end with
RESOURCE_EXHAUSTED, compressed messages with UNIMPLEMENTED, a broken frame
ends its connection (never the server). Idle connections are pinged every
30 s and closed when a ping goes 10 s unanswered, so a peer that vanished
frees its parked calls. Deadlines are the client's to enforce: gRPC clients
reset a stream whose deadline passed, and the reset cancels the call here.
A call's ``grpc-timeout`` is read into :attr:`H2Call.deadline` for handlers
that wait on it (the manager server answers a parked call that outlived it).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ftdist._rpc import h2
from ftdist._rpc.call import handler_for, run_handler
from ftdist._rpc.h2_call import (
    RESERVED_METADATA,
    Connection,
    H2Call,
    decode_metadata,
    message_prefix,
    parse_grpc_timeout,
)
from ftdist._rpc.poller import READ, WRITE, Poller
from ftdist._rpc.schedule import Schedule

__all__ = ["H2Call", "H2Server"]

logger = logging.getLogger("ftdist.rpc")

_KEEPALIVE_IDLE_S = 30.0
_KEEPALIVE_TIMEOUT_S = 10.0
_KEEPALIVE_CHECK_S = 1.0
_BACKLOG = 4096
_RECV_BYTES = 1 << 18
_MAX_UNSENT_BYTES = 64 << 20
_MAX_BUFFERED_REQUEST_BYTES = 64 << 20
_MAX_CALLS_PER_CONNECTION = 4096
_ACCEPT_PAUSE_S = 0.5

Handler = Callable[[H2Call, bytes], None]


class H2Server:
    """A plaintext gRPC server whose every callback runs on one thread.

    Args:
        bind: listen address, ``host:port``; ``[::]`` listens on IPv6 and IPv4.
        handlers: method path to handler.
        max_request_bytes: the largest request message accepted.
        tick: called on the server thread every ``tick_period_s``.
        tick_period_s: tick period in seconds.
        thread_name: name of the server thread.
        auth: given a call's invocation metadata, why it is refused (None to
            serve it); a refused call is answered UNAUTHENTICATED before its
            request is read or any handler runs.

    Raises:
        OSError: (from :meth:`start`) if the address cannot be bound.
    """

    def __init__(
        self,
        bind: str,
        handlers: dict[str, Handler],
        *,
        max_request_bytes: int = 4 << 20,
        tick: Callable[[], object] | None = None,
        tick_period_s: float = 0.1,
        thread_name: str = "ftdist-grpc",
        auth: Callable[[Any], str | None] | None = None,
    ) -> None:
        self._bind = bind
        self._handlers = handlers
        self._max_request = max_request_bytes
        self._recv_window = max(max_request_bytes + 5, 65_535)
        self._auth = auth
        self._schedule = Schedule(tick, tick_period_s, wake=self._wake)
        self._selector = Poller()
        self._listeners: list[socket.socket] = []
        self._conns: set[Connection] = set()
        self._dirty: set[Connection] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._schedule.thread = self._thread
        self._stopping = False
        self._grace_deadline = 0.0
        self.port = 0

    # -- the API shared with the completion-queue server ----------------------

    def start(self) -> int:
        """Bind, start serving and return the bound port.

        Raises:
            OSError: if the address cannot be bound.
        """
        try:
            self._listen()
        except OSError as exc:
            for sock in self._listeners:
                sock.close()
            self._wake_r.close()
            self._wake_w.close()
            self._selector.close()
            raise OSError(
                exc.errno, f"cannot bind gRPC server to {self._bind} (address in use?): {exc}"
            ) from exc
        self._selector.register(self._wake_r, READ, None)
        for sock in self._listeners:
            self._selector.register(sock, READ, sock)
        self._thread.start()
        return self.port

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread. Thread-safe; what it raises is logged."""
        self._schedule.call_soon(fn)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread ``delay_s`` seconds from now. Thread-safe."""
        self._schedule.call_later(delay_s, fn)

    def run(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run ``fn`` on the server thread and return its result. Thread-safe.

        Raises:
            RuntimeError: if the server is stopped or stopping.
            TimeoutError: if it did not run in time.
            Exception: whatever ``fn`` raised.
        """
        running = not self._stopping and self._thread.is_alive()
        return self._schedule.run(fn, timeout, running)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed (stopped)

    def stop(self, grace_s: float) -> None:
        """Stop accepting calls, give running ones ``grace_s`` seconds to end,
        cancel the rest and join the thread. Thread-safe and idempotent."""
        if not self._thread.is_alive():
            return
        self.call_soon(lambda: self._begin_shutdown(grace_s))
        self._thread.join()

    # -- binding --------------------------------------------------------------

    def _listen(self) -> None:
        host, _, port_text = self._bind.rpartition(":")
        host = host.strip("[]")
        port = int(port_text)
        if host in ("", "::"):
            candidates: list[tuple[int, Any]] = [
                (socket.AF_INET6, ("::", port)),
                (socket.AF_INET, ("0.0.0.0", port)),
            ]
        else:
            candidates = [
                (family, addr[:2])
                for family, _, _, _, addr in socket.getaddrinfo(
                    host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
                )
            ]
        first_error: OSError | None = None
        for family, address in candidates:
            if self._listeners and host in ("", "::"):
                break  # the dual-stack socket took IPv4 too
            try:
                # Inside the try: a host without IPv6 refuses the socket
                # itself, and "[::]" then falls back to IPv4.
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError as exc:
                first_error = first_error or exc
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((address[0], self.port or address[1]))
                sock.listen(_BACKLOG)
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                first_error = first_error or exc
                continue
            self._listeners.append(sock)
            self.port = self.port or sock.getsockname()[1]
        if not self._listeners:
            raise first_error or OSError(errno.EADDRNOTAVAIL, "no address to bind")

    # -- the server thread ------------------------------------------------------

    def _serve(self) -> None:
        next_keepalive = time.monotonic() + _KEEPALIVE_CHECK_S
        select = self._selector.select
        schedule = self._schedule
        try:
            while True:
                now = time.monotonic()
                try:
                    for target, mask in select(schedule.wait_s(now, next_keepalive - now)):
                        if isinstance(target, Connection):
                            if mask & READ:
                                self._read(target)
                            if mask & WRITE and target.sock.fileno() >= 0:
                                self._write(target)
                        elif target is None:
                            self._drain_wakeups()
                        else:
                            self._accept(target)
                    schedule.run_due(self._stopping)
                    now = time.monotonic()
                    if now >= next_keepalive:
                        next_keepalive = now + _KEEPALIVE_CHECK_S
                        self._keepalive(now)
                    self._flush()
                except Exception:
                    # Whatever went wrong in one pass, the server goes on:
                    # the lighthouse has no other thread to serve its job.
                    logger.exception("gRPC server loop failed; going on")
                    time.sleep(0.01)  # never a hot loop on a repeating error
                if self._stopping and self._shutdown_due(now):
                    break
        finally:
            self._close_all()

    def _flush(self) -> None:
        while self._dirty:
            conn = self._dirty.pop()
            if conn.h2.out and not conn.writing:
                self._write(conn)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    continue  # that one connection was reset while it queued
                # Out of descriptors or memory: the listener stays readable,
                # so it rests a while instead of spinning the thread.
                logger.warning("gRPC server cannot accept connections for now: %s", exc)
                self._selector.unregister(listener)
                self._schedule.at(
                    time.monotonic() + _ACCEPT_PAUSE_S, lambda: self._resume(listener)
                )
                return
            if self._stopping:
                sock.close()
                continue
            conn = Connection(sock, self._dirty, self._recv_window)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._selector.register(sock, READ, conn)
            except OSError as exc:
                # epoll full (max_user_watches) or the peer already gone.
                logger.warning("gRPC server dropped a new connection: %s", exc)
                sock.close()
                continue
            self._conns.add(conn)
            conn.mark_dirty()  # our SETTINGS go out first

    def _resume(self, listener: socket.socket) -> None:
        if not self._stopping:
            self._selector.register(listener, READ, listener)

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        frames = conn.h2.frames_received
        try:
            events = conn.h2.receive(data)
        except h2.ConnectionError_ as exc:
            logger.debug("closing a gRPC connection: %s", exc)
            self._write(conn)
            self._close(conn)
            return
        except Exception:
            # A bug in the frame layer costs this connection, never the server.
            logger.exception("gRPC server failed to read a connection; closing it")
            self._close(conn)
            return
        if conn.h2.frames_received != frames:
            # Whole frames, not bytes: a client that trickles a byte at a
            # time is still pinged, and closed when it cannot answer.
            conn.last_recv = time.monotonic()
        for event in events:
            try:
                self._event(conn, event)
            except Exception:
                logger.exception("gRPC server failed on %r", event)
        unsent = len(conn.h2.out) + conn.h2.queued_bytes
        if unsent > _MAX_UNSENT_BYTES or conn.buffered > _MAX_BUFFERED_REQUEST_BYTES:
            # A client that makes the server queue answers it never reads
            # (PINGs, resets), or opens calls it never finishes, is cut off
            # before it can grow this process without bound.
            logger.warning(
                "closing a gRPC connection that holds too much unread or unfinished data"
            )
            self._close(conn)
            return
        if conn.h2.out:
            conn.mark_dirty()

    def _event(self, conn: Connection, event: h2.Event) -> None:
        if type(event) is h2.HeadersReceived:
            call = conn.calls.get(event.stream_id)
            if call is None:
                if event.opened:
                    self._new_call(conn, event)
                # else: trailers of a call already answered
            elif event.end_stream:
                self._request_end(call)
        elif type(event) is h2.DataReceived:
            call = conn.calls.get(event.stream_id)
            if call is not None and call.request is not None:
                call.request += event.data
                self._request_data(call)
                if event.end_stream and not call.done and call.request is not None:
                    self._request_end(call)
        elif type(event) is h2.StreamReset:
            call = conn.calls.pop(event.stream_id, None)
            if call is not None:
                call.client_gone()
        elif type(event) is h2.PingAcked:
            conn.ping_sent = None

    def _new_call(self, conn: Connection, event: h2.HeadersReceived) -> None:
        path = b""
        metadata: list[tuple[str, Any]] = []
        deadline = None
        for name, value in event.headers:
            if name == b":path":
                path = value
            elif name == b"grpc-timeout":
                timeout = parse_grpc_timeout(value)
                deadline = None if timeout is None else time.monotonic() + timeout
            elif name[:1] != b":" and name not in RESERVED_METADATA:
                metadata.append((name.decode("latin-1"), decode_metadata(name, value)))
        method = path.decode("utf-8", "replace")
        call = H2Call(conn, event.stream_id, method, tuple(metadata), deadline)
        if self._stopping:
            call.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            return
        if max(len(conn.calls), conn.h2.streams - 1) >= _MAX_CALLS_PER_CONNECTION:
            call.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{_MAX_CALLS_PER_CONNECTION} calls are open on this connection",
            )
            return
        conn.calls[event.stream_id] = call
        handler = handler_for(call, self._handlers, self._auth)
        if handler is None:
            return
        call.handler = handler
        call.request = bytearray()
        if event.end_stream:
            self._request_end(call)

    def _request_data(self, call: H2Call) -> None:
        body = call.request
        assert body is not None
        if len(body) < 5:
            return
        compressed, length = message_prefix.unpack_from(body)
        if compressed:
            call.abort(grpc.StatusCode.UNIMPLEMENTED, "compressed requests are not supported")
        elif length > self._max_request:
            call.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request of {length} bytes is above the limit of {self._max_request}",
            )
        elif len(body) >= 5 + length:
            call.request = None
            self._dispatch(call, bytes(body[5 : 5 + length]))

    def _request_end(self, call: H2Call) -> None:
        if call.request is None or call.done:
            return
        if call.request:
            call.abort(grpc.StatusCode.INTERNAL, "the request ended inside a message")
        else:
            call.request = None
            self._dispatch(call, b"")

    def _dispatch(self, call: H2Call, request: bytes) -> None:
        handler = call.handler
        assert handler is not None
        run_handler(handler, call, request)

    def _write(self, conn: Connection) -> None:
        out = conn.h2.out
        sock = conn.sock
        while out:
            try:
                sent = sock.send(out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del out[:sent]
            if not out:
                conn.h2.resume()
        want_write = bool(out)
        if want_write != conn.writing:
            conn.writing = want_write
            events = READ | (WRITE if want_write else 0)
            try:
                self._selector.modify(sock, events, conn)
            except (KeyError, ValueError):
                pass  # closed meanwhile

    def _close(self, conn: Connection) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        self._dirty.discard(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        calls, conn.calls = list(conn.calls.values()), {}
        for call in calls:
            call.client_gone()

    def _keepalive(self, now: float) -> None:
        for conn in list(self._conns):
            if conn.ping_sent is not None:
                if now - conn.ping_sent > _KEEPALIVE_TIMEOUT_S:
                    logger.debug("closing a gRPC connection whose ping went unanswered")
                    self._close(conn)
            elif now - conn.last_recv > _KEEPALIVE_IDLE_S:
                conn.ping_sent = now
                conn.h2.ping(b"ftdistka")
                conn.mark_dirty()

    # -- shutdown -------------------------------------------------------------

    def _begin_shutdown(self, grace_s: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._grace_deadline = time.monotonic() + grace_s
        for sock in self._listeners:
            try:
                self._selector.unregister(sock)
            except KeyError:
                pass  # resting after a failed accept
            sock.close()
        for conn in self._conns:
            conn.h2.goaway(h2.NO_ERROR, "server shutting down")
            conn.mark_dirty()

    def _shutdown_due(self, now: float) -> bool:
        if now < self._grace_deadline and any(conn.calls for conn in self._conns):
            return False
        for conn in list(self._conns):
            for call in list(conn.calls.values()):
                conn.h2.reset(call.stream_id, h2.CANCEL)
                call.client_gone()
            conn.calls.clear()
            self._write(conn)
        return True

    def _close_all(self) -> None:
        for conn in list(self._conns):
            self._close(conn)
        for sock in self._listeners:
            sock.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
