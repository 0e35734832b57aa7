"""
The server side of one HTTP/2 connection, without I/O
=====================================================

Bytes go in (:meth:`ServerConnection.receive`), events come out, and what
the peer must be sent collects in :attr:`ServerConnection.out` for the
caller to write. Only what a gRPC server needs: streams the client opens,
flow control both ways, SETTINGS, PING, GOAWAY, RST_STREAM. Server push and
priorities are not used; PRIORITY frames are read and ignored.

A connection error raises :class:`ConnectionError_` after GOAWAY has been
queued; the caller writes ``out`` and closes the socket.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import NamedTuple, NoReturn

from ftdist._rpc.hpack import Decoder, HpackError

__all__ = [
    "DEFAULT_FRAME",
    "PREFACE",
    "ConnectionError_",
    "DataReceived",
    "HeadersReceived",
    "PingAcked",
    "ServerConnection",
    "StreamReset",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x8, 0x9, 0xB

_HEADER_TABLE_SIZE, _ENABLE_PUSH, _MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
_INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE, _MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

_DEFAULT_WINDOW = 65_535
_MAX_WINDOW = (1 << 31) - 1
DEFAULT_FRAME = 16_384  # SETTINGS_MAX_FRAME_SIZE until a peer says otherwise
# A header block larger than this ends the connection; gRPC metadata is
# small, and the limit keeps a client from growing the server's memory.
MAX_HEADER_BLOCK = 64 * 1024
# Decoded, a block can be far larger than its bytes (one byte names a table
# entry of 4 KiB); gRPC's own limit on a call's metadata is 16 KiB.
MAX_HEADER_LIST = 16 * 1024

_frame_header = struct.Struct(">BHBBI")  # length as 1 + 2 bytes, type, flags, stream
_u32 = struct.Struct(">I")
_pack_header = _frame_header.pack


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    n = len(payload)
    return _pack_header(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


class ConnectionError_(Exception):
    """The peer broke the protocol; GOAWAY is queued and the connection must close."""


class HeadersReceived(NamedTuple):
    stream_id: int
    headers: list[tuple[bytes, bytes]]
    end_stream: bool
    # False for a client's trailers (HEADERS on a stream it opened before).
    opened: bool = True


class DataReceived(NamedTuple):
    stream_id: int
    data: bytes
    end_stream: bool


class StreamReset(NamedTuple):
    stream_id: int
    code: int


class PingAcked(NamedTuple):
    payload: bytes


Event = HeadersReceived | DataReceived | StreamReset | PingAcked


_MESSAGE, _HEADERS, _TRAILERS = 0, 1, 2


class _Outgoing:
    """What one stream still has to send: DATA waits for the peer's window."""

    __slots__ = ("messages", "queue", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        # (bytes left to send, _MESSAGE / _HEADERS / _TRAILERS)
        self.queue: deque[tuple[memoryview, int]] = deque()
        self.messages = 0


class ServerConnection:
    """One HTTP/2 connection, server side.

    Args:
        recv_window: the flow-control window granted to the client, per
            stream and for the connection; large enough for any request,
            so that no request waits for a WINDOW_UPDATE.
        out_high_water: once this many bytes wait in :attr:`out`, DATA is
            held in its stream's queue (counted by :meth:`queued_messages`)
            until :meth:`resume` is called after a write.
    """

    def __init__(self, recv_window: int = 4 << 20, out_high_water: int = 1 << 20) -> None:
        self.out = bytearray()
        self._in = bytearray()
        self._preface_seen = False
        self._decoder = Decoder()
        self._recv_window = recv_window
        self._conn_consumed = 0
        self._stream_consumed: dict[int, int] = {}
        self._send_window = _DEFAULT_WINDOW
        self._peer_initial_window = _DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_FRAME
        self._high_water = out_high_water
        self._outgoing: dict[int, _Outgoing] = {}
        self._blocked: set[int] = set()
        self._open: set[int] = set()  # streams whose client side is open
        self._last_stream = 0
        self._continuing: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self.goaway_received = False
        self.frames_received = 0
        # Bytes queued in streams behind flow control, not yet in ``out``.
        self.queued_bytes = 0
        self.out += frame(
            SETTINGS,
            0,
            0,
            struct.pack(
                ">HIHIHI",
                _INITIAL_WINDOW_SIZE,
                recv_window,
                _ENABLE_PUSH,
                0,
                _MAX_HEADER_LIST_SIZE,
                MAX_HEADER_LIST,
            ),
        )
        if recv_window > _DEFAULT_WINDOW:
            self.out += frame(WINDOW_UPDATE, 0, 0, _u32.pack(recv_window - _DEFAULT_WINDOW))

    @property
    def last_stream_id(self) -> int:
        """The highest stream the client opened."""
        return self._last_stream

    # -- receiving ----------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """Feed bytes read from the socket; the events they complete.

        Raises:
            ConnectionError_: on a protocol error (GOAWAY is queued in ``out``).
        """
        events: list[Event] = []
        if self._preface_seen and not self._in:
            # The usual case: whole frames in one read, parsed where they lie.
            pos = self._frames(data, events)
            if pos < len(data):
                self._in += data[pos:]
            return events
        buf = self._in
        buf += data
        pos = 0
        if not self._preface_seen:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    self._fail(PROTOCOL_ERROR, "not an HTTP/2 client (bad preface)")
                return events
            if bytes(buf[: len(PREFACE)]) != PREFACE:
                self._fail(PROTOCOL_ERROR, "not an HTTP/2 client (bad preface)")
            self._preface_seen = True
            pos = len(PREFACE)
        whole = bytes(buf)
        buf.clear()
        pos = self._frames(whole, events, pos)
        if pos < len(whole):
            buf += whole[pos:]
        return events

    def _frames(self, data: bytes, events: list[Event], pos: int = 0) -> int:
        """Handle the whole frames in ``data`` from ``pos``; where the rest begins."""
        end = len(data)
        unpack = _frame_header.unpack_from
        while end - pos >= 9:
            high, low, kind, flags, stream_id = unpack(data, pos)
            length = (high << 16) | low
            if length > DEFAULT_FRAME:
                self._fail(FRAME_SIZE_ERROR, f"frame of {length} bytes is above 16384")
            if end - pos - 9 < length:
                break
            payload = data[pos + 9 : pos + 9 + length]
            pos += 9 + length
            self.frames_received += 1
            self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload, events)
        return pos

    def _fail(self, code: int, why: str) -> NoReturn:
        self.out += frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, code) + why.encode())
        raise ConnectionError_(why)

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if self._continuing is not None and kind != CONTINUATION:
            self._fail(PROTOCOL_ERROR, "header block interrupted before END_HEADERS")
        if kind == DATA:
            self._data(flags, sid, payload, events)
        elif kind == HEADERS:
            self._headers(flags, sid, payload, events)
        elif kind == CONTINUATION:
            if self._continuing is None or self._continuing[0] != sid:
                self._fail(PROTOCOL_ERROR, "CONTINUATION without a header block")
            assert self._continuing is not None
            block = self._continuing[2]
            block += payload
            if len(block) > MAX_HEADER_BLOCK:
                self._fail(ENHANCE_YOUR_CALM, "header block above 64 KiB")
            if flags & END_HEADERS:
                _, first_flags, _ = self._continuing
                self._continuing = None
                self._headers_done(sid, first_flags, bytes(block), events)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if sid or len(payload) != 8:
                self._fail(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "malformed PING")
            if flags & ACK:
                events.append(PingAcked(payload))
            else:
                self.out += frame(PING, ACK, 0, payload)
        elif kind == RST_STREAM:
            if not sid or len(payload) != 4:
                self._fail(PROTOCOL_ERROR, "malformed RST_STREAM")
            self._close_stream(sid)
            self._drop_outgoing(sid)
            events.append(StreamReset(sid, _u32.unpack(payload)[0]))
        elif kind == GOAWAY:
            self.goaway_received = True
        elif kind == PUSH_PROMISE:
            self._fail(PROTOCOL_ERROR, "a client cannot push")
        elif kind == PRIORITY and (not sid or len(payload) != 5):
            self._fail(PROTOCOL_ERROR, "malformed PRIORITY")
        # Unknown frame types are ignored (RFC 9113 section 4.1).

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ValueError("padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if not sid:
            self._fail(PROTOCOL_ERROR, "DATA on stream 0")
        self._conn_consumed += len(payload)
        if self._conn_consumed >= self._recv_window // 2:
            self.out += frame(WINDOW_UPDATE, 0, 0, _u32.pack(self._conn_consumed))
            self._conn_consumed = 0
        try:
            data = self._unpad(flags, payload)
        except ValueError:
            self._fail(PROTOCOL_ERROR, "DATA padding longer than the frame")
        if sid not in self._open:
            if sid > self._last_stream:
                self._fail(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream this side already reset or answered
        end_stream = bool(flags & END_STREAM)
        if end_stream:
            self._close_stream(sid)
        else:
            consumed = self._stream_consumed.get(sid, 0) + len(payload)
            if consumed >= self._recv_window // 2:
                self.out += frame(WINDOW_UPDATE, 0, sid, _u32.pack(consumed))
                consumed = 0
            self._stream_consumed[sid] = consumed
        events.append(DataReceived(sid, data, end_stream))

    def _headers(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if not sid or not sid & 1:
            self._fail(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        try:
            block = self._unpad(flags, payload)
        except ValueError:
            self._fail(PROTOCOL_ERROR, "HEADERS padding longer than the frame")
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                self._fail(PROTOCOL_ERROR, "HEADERS shorter than its priority fields")
            block = block[5:]
        if flags & END_HEADERS:
            self._headers_done(sid, flags, block, events)
        else:
            self._continuing = (sid, flags, bytearray(block))

    def _headers_done(self, sid: int, flags: int, block: bytes, events: list[Event]) -> None:
        try:
            headers = self._decoder.decode(block, MAX_HEADER_LIST)
        except HpackError as exc:
            self._fail(COMPRESSION_ERROR, str(exc))
        end_stream = bool(flags & END_STREAM)
        opened = sid > self._last_stream
        if opened:
            self._last_stream = sid
            self._open.add(sid)
            self._outgoing[sid] = _Outgoing(self._peer_initial_window)
        elif sid not in self._open:
            return  # trailers of a stream this side has finished with
        if end_stream:
            self._close_stream(sid)
        events.append(HeadersReceived(sid, headers, end_stream, opened))

    def _close_stream(self, sid: int) -> None:
        self._open.discard(sid)
        self._stream_consumed.pop(sid, None)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            self._fail(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            self._fail(FRAME_SIZE_ERROR, "SETTINGS length is not a multiple of 6")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == _INITIAL_WINDOW_SIZE:
                if value > _MAX_WINDOW:
                    self._fail(FLOW_CONTROL_ERROR, "initial window above 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for outgoing in self._outgoing.values():
                    outgoing.window += delta
                self._blocked.update(self._outgoing)
            elif key == _MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= (1 << 24) - 1:
                    self._fail(PROTOCOL_ERROR, f"max frame size {value} out of range")
                self._peer_max_frame = value
        self.out += frame(SETTINGS, ACK, 0)
        self._flush_blocked()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        increment = _u32.unpack(payload)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                self._fail(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > _MAX_WINDOW:
                self._fail(FLOW_CONTROL_ERROR, "connection window above 2^31-1")
            self._flush_blocked()
            return
        outgoing = self._outgoing.get(sid)
        if outgoing is not None:
            outgoing.window += increment
            self._blocked.add(sid)
            self._flush_blocked()

    # -- sending ------------------------------------------------------------

    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        """Queue a header block (in order with the stream's DATA)."""
        outgoing = self._outgoing.get(sid)
        if outgoing is None:
            return
        outgoing.queue.append((memoryview(block), _TRAILERS if end_stream else _HEADERS))
        self.queued_bytes += len(block)
        self._flush(sid, outgoing)

    def send_message(self, sid: int, data: bytes) -> None:
        """Queue one gRPC message's bytes as DATA."""
        outgoing = self._outgoing.get(sid)
        if outgoing is None:
            return
        outgoing.queue.append((memoryview(data), _MESSAGE))
        outgoing.messages += 1
        self.queued_bytes += len(data)
        self._flush(sid, outgoing)

    def send_response(
        self, sid: int, headers: bytes, prefix: bytes, message: bytes, trailers: bytes
    ) -> None:
        """Queue a whole response: headers, one message (``prefix`` and
        ``message``, one DATA payload), trailers that end it.

        The same as :meth:`send_headers`, :meth:`send_message` and
        :meth:`send_headers` with ``end_stream``, in one pass when the
        windows allow (the common case: a reply to a fast client), and
        without joining prefix and message first: at 1024 replica groups
        the same 67 KB quorum goes to every one of them.
        """
        outgoing = self._outgoing.get(sid)
        if outgoing is None:
            return
        n = len(prefix) + len(message)
        if (
            outgoing.queue
            or n > outgoing.window
            or n > self._send_window
            or n > self._peer_max_frame
            or len(self.out) >= self._high_water
            or max(len(headers), len(trailers)) > self._peer_max_frame
        ):
            self.send_headers(sid, headers)
            self.send_message(sid, prefix + message)
            self.send_headers(sid, trailers, end_stream=True)
            return
        out = self.out
        out += _pack_header(0, len(headers), HEADERS, END_HEADERS, sid)
        out += headers
        out += _pack_header(n >> 16, n & 0xFFFF, DATA, 0, sid)
        out += prefix
        out += message
        out += _pack_header(0, len(trailers), HEADERS, END_STREAM | END_HEADERS, sid)
        out += trailers
        self._send_window -= n
        self._drop_outgoing(sid)
        self._close_stream(sid)

    def reset(self, sid: int, code: int = CANCEL) -> None:
        """End a stream with RST_STREAM and forget what it still had to send."""
        if sid in self._outgoing:
            self._drop_outgoing(sid)
            self._close_stream(sid)
            self.out += frame(RST_STREAM, 0, sid, _u32.pack(code))

    def queued_messages(self, sid: int) -> int:
        """Messages of ``sid`` not yet in :attr:`out`."""
        outgoing = self._outgoing.get(sid)
        return outgoing.messages if outgoing is not None else 0

    def ping(self, payload: bytes) -> None:
        """Queue a PING of 8 bytes."""
        self.out += frame(PING, 0, 0, payload)

    def goaway(self, code: int = NO_ERROR, why: str = "") -> None:
        """Queue GOAWAY: no stream above the last one will be served."""
        self.out += frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, code) + why.encode())

    def resume(self) -> None:
        """Let held DATA go out again; call after writing part of :attr:`out`."""
        if self._blocked and len(self.out) < self._high_water:
            self._flush_blocked()

    @property
    def streams(self) -> int:
        """Streams that still have something to send (or may be answered)."""
        return len(self._outgoing)

    def _drop_outgoing(self, sid: int) -> None:
        outgoing = self._outgoing.pop(sid, None)
        if outgoing is not None:
            self.queued_bytes -= sum(len(chunk) for chunk, _ in outgoing.queue)
        self._blocked.discard(sid)

    def _flush_blocked(self) -> None:
        for sid in list(self._blocked):
            outgoing = self._outgoing.get(sid)
            if outgoing is None:
                self._blocked.discard(sid)
            else:
                self._flush(sid, outgoing)

    def _flush(self, sid: int, outgoing: _Outgoing) -> None:
        queue = outgoing.queue
        out = self.out
        while queue:
            chunk, kind = queue[0]
            if kind != _MESSAGE:
                queue.popleft()
                self.queued_bytes -= len(chunk)
                self._write_headers(sid, chunk, kind == _TRAILERS)
                if kind == _TRAILERS:
                    self._drop_outgoing(sid)
                    self._close_stream(sid)
                    return
                continue
            if len(out) >= self._high_water:
                self._blocked.add(sid)
                return
            size = min(len(chunk), outgoing.window, self._send_window, self._peer_max_frame)
            if size <= 0:
                self._blocked.add(sid)
                return
            n = size
            out += _pack_header(n >> 16, n & 0xFFFF, DATA, 0, sid)
            out += chunk[:n]
            outgoing.window -= n
            self._send_window -= n
            self.queued_bytes -= n
            if n == len(chunk):
                queue.popleft()
                outgoing.messages -= 1
            else:
                queue[0] = (chunk[n:], kind)
        self._blocked.discard(sid)

    def _write_headers(self, sid: int, block: memoryview, end_stream: bool) -> None:
        limit = self._peer_max_frame
        first = block[:limit]
        rest = block[limit:]
        flags = (END_STREAM if end_stream else 0) | (0 if rest else END_HEADERS)
        n = len(first)
        self.out += _pack_header(n >> 16, n & 0xFFFF, HEADERS, flags, sid)
        self.out += first
        while rest:
            piece, rest = rest[:limit], rest[limit:]
            n = len(piece)
            self.out += _pack_header(
                n >> 16, n & 0xFFFF, CONTINUATION, 0 if rest else END_HEADERS, sid
            )
            self.out += piece
