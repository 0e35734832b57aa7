"""
Unary gRPC calls on plaintext HTTP/2, written here, no grpcio underneath
=======================================================================

The lighthouse client makes two calls per group and quorum round (a
``Heartbeat``, then the ``Quorum``). A grpcio unary call from Python hands
its request to gRPC core's threads and waits on a completion queue for the
answer: a round at two groups took 0.33 ms longer with ftdist's client
than with torchft's Rust one against the same lighthouse (``bench/lighthouse.py
--client ftdist``), 1.3x torchft's whole stack although the two lighthouses
answer in the same time. Here the calling thread writes its
request and reads its answer itself: one ``send`` and, when the server is
quick, one ``recv`` per call. The manager client (group ranks calling their
group's manager server, twice a step) uses it too, with each call's timeout
sent along (``send_timeout``), since that server's handlers wait on it.

The model: a pool of blocking sockets. A call takes an idle connection (or
opens one), sends its request in one write, and reads that socket until
its stream ends; one call at a time per connection, so there is no reader
thread and no hand-off between threads. Calls made at once (a heartbeat
thread beside a quorum) use connections of their own. Nothing is read
while a connection sits idle: before it is used again, what arrived
meanwhile is read without waiting (a PING answered, a GOAWAY or a close
found), so a connection the server dropped is replaced instead of used.

Errors are grpcio's, so that callers handle both clients alike: an
:class:`H2RpcError` (a :class:`grpc.RpcError` and :class:`grpc.Call`) with
the status code and details the server sent, ``UNAVAILABLE`` with details
starting "failed to connect" when no connection could be made (nothing was
sent), ``UNAVAILABLE`` when the connection broke with the call in flight
(never resent: a quorum request must not count twice), ``DEADLINE_EXCEEDED``
past the timeout (the connection is closed, which cancels the call on the
server) and ``CANCELLED`` for calls in flight when the channel is closed.
A call on a closed channel raises ``ValueError``, as grpcio's does. A call
the server provably did not take (a GOAWAY naming an earlier stream, a
REFUSED_STREAM reset) goes again on a new connection, within its timeout.
"""

from __future__ import annotations

import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc

from ftdist._rpc import h2
from ftdist._rpc.h2_call import message_prefix
from ftdist._rpc.h2_outcome import H2RpcError, outcome
from ftdist._rpc.hpack import Decoder, HpackError, encode

# The error is re-exported: callers catch it here.
__all__ = ["H2Channel", "H2RpcError", "grpc_timeout"]

# Our receive windows (each stream's and the connection's): a response never
# waits for a WINDOW_UPDATE from us; the connection's is topped up as it drains.
_WINDOW = 1 << 30
_TOP_UP_AFTER = 1 << 29
_IDLE_KEPT = 4
# Sends of a call the server provably did not take (it was shutting down).
_ATTEMPTS = 3
_ANSWER_S = 1.0
_RECV_BYTES = 1 << 18
# Past this stream id a connection is retired (ids are 31 bits, odd, rising).
_LAST_STREAM_ID = (1 << 31) - 1 - 2 * 1024
_REFUSED_STREAM = 0x7

_SETTINGS = h2.frame(
    h2.SETTINGS,
    0,
    0,
    struct.pack(">HIHI", 0x2, 0, 0x4, _WINDOW),  # no push; our window
)
_OPENING = (
    h2.PREFACE + _SETTINGS + h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", _WINDOW - 65_535))
)
_SETTINGS_ACK = h2.frame(h2.SETTINGS, h2.ACK, 0)
_frame_header = struct.Struct(">BHBBI")
_u32 = struct.Struct(">I")


class _NotTaken(Exception):
    """The server did not take the request: it may go again on a new connection."""


class _Conn:
    """One connection, used by one call at a time."""

    __slots__ = (
        "block",
        "block_ends_stream",
        "buf",
        "decoder",
        "goaway_after",
        "max_frame",
        "next_sid",
        "opening",
        "peer_window",
        "sock",
        "unacked",
        "window",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.decoder = Decoder()
        self.block: bytearray | None = None  # a header block still arriving
        self.block_ends_stream = False
        self.next_sid = 1
        self.opening = _OPENING  # sent with the first request
        self.window = 65_535  # the connection's window for what we send
        self.peer_window = 65_535  # each new stream's window for what we send
        self.max_frame = h2.DEFAULT_FRAME
        self.unacked = 0  # bytes received since our last connection WINDOW_UPDATE
        self.goaway_after: int | None = None  # the server takes no stream above this

    @property
    def reusable(self) -> bool:
        return self.goaway_after is None and self.next_sid < _LAST_STREAM_ID

    def close(self) -> None:
        try:
            # shutdown() first: it wakes a recv() blocked in another thread.
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class _Call:
    """One call's progress on its connection: what is left to send, what came back."""

    __slots__ = ("body", "done", "headers", "left", "sid", "trailers", "window")

    def __init__(self, sid: int, message: bytes, window: int) -> None:
        self.sid = sid
        self.left = memoryview(message)
        self.window = window
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.body = bytearray()
        self.done = False


class H2Channel:
    """Unary gRPC calls to one plaintext server, on connections of their own.

    Args:
        target: ``host:port`` (``[v6]:port`` for IPv6).
        send_timeout: also tell the server each call's timeout (the
            ``grpc-timeout`` header), for servers whose handlers read their
            deadline (grpcio's ``context.time_remaining()``). Without it the
            timeout is the client's alone: past it the connection is closed,
            which cancels the call on the server.

    Raises:
        ValueError: if ``target`` has no port.
    """

    def __init__(self, target: str, *, send_timeout: bool = False) -> None:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"target {target!r} must be host:port")
        self.target = target
        self._send_timeout = send_timeout
        self._address = (host.strip("[]"), int(port))
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._closed = False
        self._blocks: dict[tuple[bytes, Any], bytes] = {}

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
    ) -> Callable[..., Any]:
        """A callable making unary calls of ``method``, like grpcio's.

        The callable takes ``(request, timeout=None, metadata=None)``
        (seconds; ``(key, value)`` pairs) and returns the response.

        Raises:
            Nothing itself. The callable raises :class:`H2RpcError` where
            grpcio's raises its errors (see the module's documentation), and
            ``ValueError`` once the channel is closed.
        """
        path = method.encode()

        def call(
            request: Any,
            timeout: float | None = None,
            metadata: Sequence[tuple[str, str | bytes]] | None = None,
        ) -> Any:
            deadline = None if timeout is None else time.monotonic() + timeout
            block = self._header_block(path, metadata)
            if self._send_timeout and timeout is not None:
                # Appended after the cached block: a literal that leaves the
                # peer's HPACK table alone, so the cached part stays valid.
                block += encode([(b"grpc-timeout", grpc_timeout(timeout))])
            payload = self._call(block, request_serializer(request), deadline)
            return response_deserializer(payload)

        return call

    def close(self) -> None:
        """Close every connection; calls in flight end ``CANCELLED``. Idempotent.

        Raises:
            Nothing: a connection that fails to close is dropped all the same.
        """
        with self._lock:
            self._closed = True
            conns = [*self._idle, *self._busy]
            self._idle.clear()
        for conn in conns:
            conn.close()

    # -- one call -----------------------------------------------------------

    def _call(self, block: bytes, request: bytes, deadline: float | None) -> bytes:
        message = message_prefix.pack(0, len(request)) + request
        for attempt in range(_ATTEMPTS):
            conn = self._checkout(deadline)
            try:
                call = self._exchange(conn, block, message, deadline)
            except _NotTaken as exc:
                self._retire(conn)
                if attempt + 1 == _ATTEMPTS:
                    raise H2RpcError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the server at {self.target} refused the call {_ATTEMPTS} times "
                        "(it is shutting down)",
                    ) from exc
                continue
            except BaseException:
                self._retire(conn)
                raise
            # The stream ended cleanly, whatever its status: the connection serves on.
            self._checkin(conn)
            return outcome(call.headers, call.trailers, call.body)
        raise AssertionError("unreachable")

    def _header_block(
        self, path: bytes, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> bytes:
        key = (path, tuple(metadata) if metadata else None)
        block = self._blocks.get(key)
        if block is None:
            fields = [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", path),
                (b":authority", self.target.encode()),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
            ]
            for name, value in metadata or ():
                if not isinstance(value, bytes):
                    value = value.encode()
                fields.append((name.lower().encode(), value))
            block = encode(fields)
            if len(self._blocks) < 64:
                self._blocks[key] = block
        return block

    def _exchange(self, conn: _Conn, block: bytes, message: bytes, deadline: float | None) -> _Call:
        sid = conn.next_sid
        conn.next_sid += 2
        call = _Call(sid, message, conn.peer_window)
        out = bytearray(conn.opening)
        conn.opening = b""
        out += h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block)
        self._data_frames(conn, call, out)
        self._send(conn, out, deadline, sent_before=False)
        while not call.done:
            self._receive(conn, deadline)
            out.clear()
            self._frames(conn, call, out)
            if out:
                self._send(conn, out, deadline, sent_before=True)
        return call

    @staticmethod
    def _data_frames(conn: _Conn, call: _Call, out: bytearray) -> None:
        while call.left:
            room = min(len(call.left), conn.window, call.window, conn.max_frame)
            if room <= 0:
                return  # the rest waits for a WINDOW_UPDATE
            piece, call.left = call.left[:room], call.left[room:]
            conn.window -= room
            call.window -= room
            out += h2.frame(h2.DATA, 0 if call.left else h2.END_STREAM, call.sid, bytes(piece))

    def _send(
        self, conn: _Conn, out: bytes | bytearray, deadline: float | None, *, sent_before: bool
    ) -> None:
        try:
            conn.sock.settimeout(_left(deadline))
            conn.sock.sendall(out)
        except TimeoutError as exc:  # before OSError: it is one, and no sign of a refusal
            raise H2RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from exc
        except OSError as exc:
            self._broken(exc, sent_before)

    def _receive(self, conn: _Conn, deadline: float | None) -> None:
        try:
            conn.sock.settimeout(_left(deadline))
            data = conn.sock.recv(_RECV_BYTES)
        except TimeoutError as exc:
            raise H2RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from exc
        except OSError as exc:
            self._broken(exc, True)
        if not data:
            self._broken(None, True)
        conn.buf += data

    def _broken(self, exc: OSError | None, sent: bool) -> NoReturn:
        if self._closed:
            raise H2RpcError(grpc.StatusCode.CANCELLED, "Channel closed!") from exc
        if not sent:
            # The request's write failed: the peer had closed the connection
            # (a reset), so no part of the call reached a handler.
            raise _NotTaken from exc
        why = "Socket closed" if exc is None else (exc.strerror or str(exc))
        raise H2RpcError(grpc.StatusCode.UNAVAILABLE, why) from exc

    def _frames(self, conn: _Conn, call: _Call | None, out: bytearray) -> None:
        """Act on every whole frame in ``conn.buf``; answers go into ``out``."""
        buf = conn.buf
        pos = 0
        try:
            while len(buf) - pos >= 9:
                high, low, kind, flags, sid = _frame_header.unpack_from(buf, pos)
                length = (high << 16) | low
                end = pos + 9 + length
                if end > len(buf):
                    break
                payload = bytes(buf[pos + 9 : end])
                pos = end
                self._frame(conn, call, kind, flags, sid & 0x7FFFFFFF, payload, out)
        finally:
            del buf[:pos]

    def _frame(
        self,
        conn: _Conn,
        call: _Call | None,
        kind: int,
        flags: int,
        sid: int,
        payload: bytes,
        out: bytearray,
    ) -> None:
        mine = call is not None and sid == call.sid
        if kind == h2.DATA:
            conn.unacked += len(payload)  # padding included: it counts against the window
            if flags & h2.PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if conn.unacked >= _TOP_UP_AFTER:
                out += h2.frame(h2.WINDOW_UPDATE, 0, 0, _u32.pack(conn.unacked))
                conn.unacked = 0
            if mine:
                assert call is not None
                call.body += payload
                call.done = bool(flags & h2.END_STREAM)
        elif kind == h2.HEADERS or kind == h2.CONTINUATION:
            self._headers(conn, call if mine else None, kind, flags, payload)
        elif kind == h2.SETTINGS:
            if not flags & h2.ACK:
                self._settings(conn, call, payload)
                out += _SETTINGS_ACK
        elif kind == h2.PING:
            if not flags & h2.ACK:
                out += h2.frame(h2.PING, h2.ACK, 0, payload)
        elif kind == h2.WINDOW_UPDATE:
            increment = _u32.unpack(payload)[0] & 0x7FFFFFFF
            if sid == 0:
                conn.window += increment
            elif mine:
                assert call is not None
                call.window += increment
            if call is not None and call.left:
                self._data_frames(conn, call, out)
        elif kind == h2.RST_STREAM and mine:
            assert call is not None
            if call.done:
                # After a whole response a server may reset the stream
                # (NO_ERROR: "stop sending"; RFC 9113 8.1); gRPC's C core
                # does when its deadline ends the call, in the same write as
                # the trailers. The call's outcome is already in hand.
                return
            code = _u32.unpack(payload)[0]
            if code == _REFUSED_STREAM:
                raise _NotTaken
            status = grpc.StatusCode.CANCELLED if code == h2.CANCEL else grpc.StatusCode.INTERNAL
            raise H2RpcError(status, f"stream reset by the server (HTTP/2 error {code})")
        elif kind == h2.GOAWAY:
            conn.goaway_after = _u32.unpack_from(payload)[0] & 0x7FFFFFFF
            if call is not None and call.sid > conn.goaway_after:
                raise _NotTaken

    def _headers(
        self, conn: _Conn, call: _Call | None, kind: int, flags: int, payload: bytes
    ) -> None:
        if kind == h2.HEADERS:
            if flags & h2.PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & h2.PRIORITY_FLAG:
                payload = payload[5:]
            conn.block = bytearray(payload)
            conn.block_ends_stream = bool(flags & h2.END_STREAM)
        elif conn.block is None:
            raise H2RpcError(grpc.StatusCode.INTERNAL, "CONTINUATION without HEADERS")
        else:
            conn.block += payload
        if len(conn.block) > h2.MAX_HEADER_BLOCK:
            raise H2RpcError(grpc.StatusCode.INTERNAL, "response header block too large")
        if not flags & h2.END_HEADERS:
            return
        block, conn.block = conn.block, None
        # Every block is decoded, a call's or not: HPACK's table is the connection's.
        try:
            fields = conn.decoder.decode(bytes(block), h2.MAX_HEADER_LIST)
        except HpackError as exc:
            raise H2RpcError(grpc.StatusCode.INTERNAL, f"bad response headers: {exc}") from exc
        if call is None:
            return
        if call.headers is None:
            call.headers = fields
        else:
            call.trailers = fields
        if conn.block_ends_stream:
            call.done = True
            if call.trailers is None:  # trailers-only: the status came in the headers
                call.trailers = fields

    @staticmethod
    def _settings(conn: _Conn, call: _Call | None, payload: bytes) -> None:
        for offset in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 0x4:  # INITIAL_WINDOW_SIZE: moves every open stream's window
                if call is not None:
                    call.window += value - conn.peer_window
                conn.peer_window = value
            elif key == 0x5:  # MAX_FRAME_SIZE
                conn.max_frame = value

    # -- the pool -----------------------------------------------------------

    def _checkout(self, deadline: float | None) -> _Conn:
        while True:
            with self._lock:
                if self._closed:
                    raise ValueError("Cannot invoke RPC on closed channel!")
                conn = self._idle.pop() if self._idle else None
                if conn is not None:
                    self._busy.add(conn)
            if conn is None:
                return self._open(deadline)
            if self._still_open(conn):
                return conn
            self._retire(conn)

    def _open(self, deadline: float | None) -> _Conn:
        try:
            sock = socket.create_connection(self._address, timeout=_left(deadline))
        except TimeoutError as exc:
            raise H2RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from exc
        except OSError as exc:
            raise H2RpcError(
                grpc.StatusCode.UNAVAILABLE,
                f"failed to connect to all addresses; last error: {exc.strerror or exc} "
                f"({self.target})",
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock)
        with self._lock:
            if self._closed:
                conn.close()
                raise ValueError("Cannot invoke RPC on closed channel!")
            self._busy.add(conn)
        return conn

    def _still_open(self, conn: _Conn) -> bool:
        """Read what arrived while ``conn`` sat idle, without waiting: is it still usable?"""
        out = bytearray()
        try:
            # Non-blocking, not MSG_DONTWAIT: a socket with a timeout waits
            # out that timeout on EAGAIN whatever the flags say.
            conn.sock.settimeout(0.0)
            while True:
                try:
                    data = conn.sock.recv(_RECV_BYTES)
                except (BlockingIOError, InterruptedError):
                    break
                if not data:
                    return False
                conn.buf += data
                self._frames(conn, None, out)
            if out:
                # A few bytes (PING and SETTINGS acknowledgements): a peer
                # that cannot take them within a second costs the connection.
                conn.sock.settimeout(_ANSWER_S)
                conn.sock.sendall(out)
        except (OSError, H2RpcError, _NotTaken):
            return False
        return conn.reusable

    def _checkin(self, conn: _Conn) -> None:
        with self._lock:
            self._busy.discard(conn)
            if conn.reusable and not self._closed and len(self._idle) < _IDLE_KEPT:
                self._idle.append(conn)
                return
        conn.close()

    def _retire(self, conn: _Conn) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise H2RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    return left


def grpc_timeout(seconds: float) -> bytes:
    """``seconds`` as a ``grpc-timeout`` value: at most 8 digits and a unit,
    rounded up in the finest unit that fits (a timeout never reaches the
    server shorter than it was given); at least one microsecond."""
    micros = max(1, math.ceil(seconds * 1e6))
    for unit, per in ((b"u", 1), (b"m", 1000), (b"S", 1_000_000), (b"M", 60_000_000)):
        count = -(-micros // per)
        if count < 100_000_000:
            return str(count).encode() + unit
    return str(min(99_999_999, -(-micros // 3_600_000_000))).encode() + b"H"
