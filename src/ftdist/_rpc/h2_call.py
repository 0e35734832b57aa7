"""
One gRPC call on an HTTP/2 stream, as ftdist's own server answers it
====================================================================

What :mod:`ftdist._rpc.h2_server` hands a handler: the method, the client's
metadata, and the ways to answer (one reply, a stream of messages, a status
with trailing metadata), written as gRPC frames them on HTTP/2: response
headers, length-prefixed messages, and a trailers block that ends the
stream. A call with nothing sent yet ends with a single "trailers-only"
block, as gRPC's own servers do.
"""

from __future__ import annotations

import base64
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import grpc

from ftdist._rpc import h2, hpack

__all__ = [
    "RESERVED_METADATA",
    "Connection",
    "H2Call",
    "decode_metadata",
    "message_prefix",
    "parse_grpc_timeout",
]

logger = logging.getLogger("ftdist.rpc")

_RESPONSE_HEADERS = hpack.encode(((b":status", b"200"), (b"content-type", b"application/grpc")))
_OK_TRAILERS = hpack.encode(((b"grpc-status", b"0"),))
# Metadata that gRPC itself uses; handlers see the rest.
RESERVED_METADATA = frozenset(
    (b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding")
)
message_prefix = struct.Struct(">BI")
"""A gRPC message's prefix: compressed flag, length."""


# Seconds per grpc-timeout unit (gRPC over HTTP/2: hours, minutes, seconds,
# milli-, micro-, nanoseconds).
_TIMEOUT_UNITS = {72: 3600.0, 77: 60.0, 83: 1.0, 109: 1e-3, 117: 1e-6, 110: 1e-9}


def parse_grpc_timeout(value: bytes) -> float | None:
    """A ``grpc-timeout`` header's seconds: 1 to 8 digits and a unit
    (``H M S m u n``); None for anything else."""
    per = _TIMEOUT_UNITS.get(value[-1]) if value else None
    digits = value[:-1]
    if per is None or not 1 <= len(digits) <= 8 or not digits.isdigit():
        return None
    return int(digits) * per


def _percent_encode(details: str) -> bytes:
    raw = details.encode("utf-8")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def decode_metadata(key: bytes, value: bytes) -> Any:
    """A metadata value as grpcio gives it: bytes for ``-bin`` keys, else str."""
    if key.endswith(b"-bin"):
        try:
            return base64.b64decode(value + b"=" * (-len(value) % 4))
        except ValueError:
            return value
    return value.decode("utf-8", "replace")


def _status_block(
    code: grpc.StatusCode,
    details: str,
    trailing: tuple[tuple[str, Any], ...] | None,
    headers_sent: bool,
) -> bytes:
    fields: list[tuple[bytes, bytes]] = []
    if not headers_sent:
        fields += [(b":status", b"200"), (b"content-type", b"application/grpc")]
    fields.append((b"grpc-status", str(code.value[0]).encode()))
    if details:
        fields.append((b"grpc-message", _percent_encode(details)))
    for key, value in trailing or ():
        name = key.lower().encode()
        if key.endswith("-bin"):
            raw = value if isinstance(value, bytes) else str(value).encode()
            fields.append((name, base64.b64encode(raw).rstrip(b"=")))
        else:
            fields.append((name, str(value).encode()))
    return hpack.encode(fields)


class H2Call:
    """One call, used only on the server thread.

    Attributes:
        method: the full method path, e.g. ``/torchft.LighthouseService/Quorum``.
        metadata: the client's invocation metadata, ``(key, value)`` pairs.
        done: the call has been answered (or its client went away).
        cancelled: its client cancelled it, disconnected or reset the stream.
        stream_id: its HTTP/2 stream.
        deadline: when the client gives up, ``time.monotonic()``-based, from
            its ``grpc-timeout``; None when it sent none (or a malformed one).
    """

    __slots__ = (
        "_conn",
        "_headers_sent",
        "_on_cancel",
        "cancelled",
        "deadline",
        "done",
        "handler",
        "metadata",
        "method",
        "request",
        "stream_id",
    )

    def __init__(
        self,
        conn: Connection,
        sid: int,
        method: str,
        metadata: tuple[tuple[str, Any], ...],
        deadline: float | None = None,
    ) -> None:
        self._conn = conn
        self.deadline = deadline
        self.stream_id = sid
        self.method = method
        self.metadata = metadata
        self.done = False
        self.cancelled = False
        self._headers_sent = False
        self._on_cancel: Callable[[], None] | None = None
        # The server's, while the request arrives: its bytes so far and the
        # handler to run once it is whole (None after it ran).
        self.request: bytearray | None = None
        self.handler: Callable[[H2Call, bytes], None] | None = None

    def reply(self, payload: bytes) -> None:
        """Answer with ``payload`` and status OK. Ignored once done."""
        if self.done:
            return
        connection = self._conn.h2
        prefix = message_prefix.pack(0, len(payload))
        if self._headers_sent:
            connection.send_message(self.stream_id, prefix + payload)
            connection.send_headers(self.stream_id, _OK_TRAILERS, end_stream=True)
        else:
            connection.send_response(
                self.stream_id, _RESPONSE_HEADERS, prefix, payload, _OK_TRAILERS
            )
        self._finish()

    def abort(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        """End the call with an error status, and ``trailing`` metadata when
        given. Ignored once done. Messages still queued are sent first."""
        if self.done:
            return
        block = _status_block(code, details, trailing, self._headers_sent)
        self._conn.h2.send_headers(self.stream_id, block, end_stream=True)
        self._finish()

    def send(self, payload: bytes) -> None:
        """Queue one message of a server-streaming response. Ignored once done."""
        if self.done:
            return
        conn = self._conn
        if not self._headers_sent:
            conn.h2.send_headers(self.stream_id, _RESPONSE_HEADERS)
            self._headers_sent = True
        conn.h2.send_message(self.stream_id, message_prefix.pack(0, len(payload)) + payload)
        conn.mark_dirty()

    @property
    def pending_messages(self) -> int:
        """Messages queued but not yet handed to the socket's buffer."""
        return self._conn.h2.queued_messages(self.stream_id)

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the server thread) if the client goes away
        before the call is answered: cancel, disconnect or deadline. A call
        already cancelled runs it at once."""
        if self.cancelled:
            callback()
            return
        self._on_cancel = callback

    def time_remaining(self) -> float | None:
        """Seconds until the client's deadline (0 once past); None without one."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def metadata_value(self, key: str) -> str | None:
        """The value of one invocation metadata key, or None when absent."""
        for k, v in self.metadata:
            if k == key:
                return v if isinstance(v, str) else bytes(v).decode("utf-8", "replace")
        return None

    def _finish(self) -> None:
        self.done = True
        self._conn.calls.pop(self.stream_id, None)
        self._conn.mark_dirty()

    def client_gone(self) -> None:
        """The server's: the client reset the stream or left; runs the cancel callback."""
        if self.done:
            return
        self.done = True
        self.cancelled = True
        callback, self._on_cancel = self._on_cancel, None
        if callback is not None:
            try:
                callback()
            except Exception:
                logger.exception("cancel callback of %s failed", self.method)


class Connection:
    """One client's socket, its HTTP/2 state and its calls, on the server thread.

    ``dirty`` is the server's set of connections with bytes to write; a
    call adds its connection there when it queues a frame.
    """

    __slots__ = ("calls", "dirty", "h2", "last_recv", "ping_sent", "sock", "writing")

    def __init__(self, sock: socket.socket, dirty: set[Connection], recv_window: int) -> None:
        self.sock = sock
        self.h2 = h2.ServerConnection(recv_window=recv_window)
        self.calls: dict[int, H2Call] = {}
        self.dirty = dirty
        self.last_recv = time.monotonic()
        self.ping_sent: float | None = None
        self.writing = False

    @property
    def buffered(self) -> int:
        """Bytes of requests that have begun to arrive but are not whole."""
        return sum(len(call.request) for call in self.calls.values() if call.request)

    def mark_dirty(self) -> None:
        self.dirty.add(self)
