"""What ftdist's gRPC servers and clients put on the wire, frame by frame.

Hand-written HTTP/2 peers (plain frames, HPACK literals without Huffman
coding) talk to the real lighthouse, or answer the real lighthouse client,
over real sockets and record every frame the other side sends, so that a test
can say what each side makes the other handle per call, not just what the
call returns.
"""

from __future__ import annotations

import socket
import struct
import threading
from datetime import timedelta

import pytest

from ftdist._rpc._proto import torchft_pb2
from ftdist.coordination import LighthouseClient
from tests.integration.lighthouse_helpers import TIMEOUT, Lighthouses

pytestmark = pytest.mark.timeout(60)

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x6, 0x7, 0x8
_INITIAL_WINDOW_SIZE = 0x4
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_HEARTBEAT = "/torchft.LighthouseService/Heartbeat"


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name: str, value: str) -> bytes:
    # "Literal header field without indexing, new name", lengths below 127.
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + bytes([len(raw_name)]) + raw_name + bytes([len(raw_value)]) + raw_value


def _request_headers(port: int, method: str) -> bytes:
    return b"".join(
        _literal(name, value)
        for name, value in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )


Frame = tuple[int, int, int, bytes]
"""(type, flags, stream id, payload)"""


class _Reader:
    """Reads one peer's bytes off a socket, a frame (or a preface) at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"the peer closed the connection ({self._buffer[:32]!r})")
            self._buffer += chunk
        head, self._buffer = self._buffer[:size], self._buffer[size:]
        return head

    def frame(self) -> Frame:
        head = self.take(9)
        payload = self.take(int.from_bytes(head[:3], "big"))
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload


def _settings(payload: bytes) -> dict[int, int]:
    return dict(struct.unpack(">HI", payload[at : at + 6]) for at in range(0, len(payload), 6))


def _pings(frames: list[Frame]) -> list[Frame]:
    """The PINGs a peer sent on its own (not acknowledgements)."""
    return [frame for frame in frames if frame[0] == _PING and not frame[1] & _ACK]


class _Wire:
    """One HTTP/2 connection; every frame the server sends is kept in ``frames``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.frames: list[Frame] = []
        self._reader = _Reader(self.sock)
        self.sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0))

    def close(self) -> None:
        self.sock.close()

    def call(self, stream: int, method: str, request: bytes) -> bytes:
        """One unary call; returns the response message (the gRPC prefix removed)."""
        message = b"\x00" + struct.pack(">I", len(request)) + request
        self.sock.sendall(
            _frame(_HEADERS, _END_HEADERS, stream, _request_headers(self.port, method))
            + _frame(_DATA, _END_STREAM, stream, message)
        )
        body = b""
        while True:
            frame = self._reader.frame()
            self.frames.append(frame)
            kind, flags, on_stream, payload = frame
            if kind == _SETTINGS and not flags & _ACK:
                self.sock.sendall(_frame(_SETTINGS, _ACK, 0))
            elif kind == _PING and not flags & _ACK:
                self.sock.sendall(_frame(_PING, _ACK, 0, payload))
            elif kind == _GOAWAY:
                raise ConnectionError(f"GOAWAY from the server: {payload!r}")
            elif on_stream == stream and kind == _DATA:
                body += payload
            if on_stream == stream and kind == _HEADERS and flags & _END_STREAM:
                break
        assert body[:1] == b"\x00" and int.from_bytes(body[1:5], "big") == len(body) - 5, body
        return body[5:]


def test_the_lighthouse_sends_no_ping_a_client_did_not_ask_for(lh: Lighthouses) -> None:
    # gRPC's server probes a link's bandwidth with a PING after each message
    # it receives, unless told not to, and every client must wake up to
    # answer it: at 512 replica groups, 1.3 extra wake-ups per group and round.
    server = lh.server(min_replicas=1)
    wire = _Wire(server.port)
    try:
        request = torchft_pb2.LighthouseHeartbeatRequest(replica_id="wire").SerializeToString()
        for stream in range(1, 41, 2):
            # LighthouseHeartbeatResponse has no fields: an empty message.
            assert wire.call(stream, _HEARTBEAT, request) == b""
    finally:
        wire.close()
    pings = _pings(wire.frames)
    kinds = sorted({frame[0] for frame in wire.frames})
    assert pings == [], f"{len(pings)} PINGs in 20 calls (frame types seen: {kinds})"
    # Without the probe the window must still take a whole request at once.
    settings = [frame[3] for frame in wire.frames if frame[0] == _SETTINGS and not frame[1] & _ACK]
    assert settings, kinds
    advertised = _settings(settings[0])
    assert advertised.get(_INITIAL_WINDOW_SIZE, 65535) >= 4 * 1024 * 1024, advertised
    answered = {
        frame[2] for frame in wire.frames if frame[0] == _HEADERS and frame[1] & _END_STREAM
    }
    assert answered == set(range(1, 41, 2))


class _FakeLighthouse:
    """Answers every call on one connection with ``reply``, within the
    client's flow-control windows; every frame the client sends is kept."""

    def __init__(self, reply: bytes) -> None:
        self._message = b"\x00" + struct.pack(">I", len(reply)) + reply
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(TIMEOUT)
        self.port = self._listener.getsockname()[1]
        self.frames: list[Frame] = []
        self.settings: dict[int, int] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._listener.close()
        self._thread.join(TIMEOUT)

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError as exc:
            self.error = exc
            return
        with conn:
            conn.settimeout(TIMEOUT)
            try:
                self._answer(conn)
            except (ConnectionError, TimeoutError, OSError):
                pass  # the client closed the channel
            except BaseException as exc:
                self.error = exc

    def _answer(self, conn: socket.socket) -> None:
        reader = _Reader(conn)
        preface = reader.take(len(_PREFACE))
        assert preface == _PREFACE, preface
        conn.sendall(_frame(_SETTINGS, 0, 0))
        connection_window = initial_window = 65535
        stream_windows: dict[int, int] = {}
        sent: dict[int, int] = {}  # streams whose request ended: bytes of the answer sent
        while True:
            kind, flags, stream, payload = frame = reader.frame()
            self.frames.append(frame)
            if kind == _SETTINGS and not flags & _ACK:
                self.settings.update(_settings(payload))
                initial_window = self.settings.get(_INITIAL_WINDOW_SIZE, initial_window)
                conn.sendall(_frame(_SETTINGS, _ACK, 0))
            elif kind == _PING and not flags & _ACK:
                conn.sendall(_frame(_PING, _ACK, 0, payload))
            elif kind == _WINDOW_UPDATE:
                grant = int.from_bytes(payload, "big") & 0x7FFFFFFF
                if stream == 0:
                    connection_window += grant
                else:
                    stream_windows[stream] = stream_windows.get(stream, initial_window) + grant
            elif kind == _HEADERS:
                stream_windows.setdefault(stream, initial_window)
                head = _literal(":status", "200") + _literal("content-type", "application/grpc")
                conn.sendall(_frame(_HEADERS, _END_HEADERS, stream, head))
            elif kind == _DATA and flags & _END_STREAM:
                sent[stream] = 0
            for waiting in list(sent):
                offset = sent[waiting]
                while offset < len(self._message):
                    size = min(16384, len(self._message) - offset)
                    size = min(size, connection_window, stream_windows[waiting])
                    if size <= 0:
                        break
                    conn.sendall(_frame(_DATA, 0, waiting, self._message[offset : offset + size]))
                    offset += size
                    connection_window -= size
                    stream_windows[waiting] -= size
                sent[waiting] = offset
                if offset == len(self._message):
                    trailer = _literal("grpc-status", "0")
                    conn.sendall(_frame(_HEADERS, _END_HEADERS | _END_STREAM, waiting, trailer))
                    del sent[waiting]


def test_the_lighthouse_client_sends_no_ping_and_takes_a_large_quorum_whole() -> None:
    # gRPC's client probes bandwidth the way its server does: a PING after
    # data arrives, which the lighthouse must answer for every group. Without
    # the probe the client must still open a window that takes the quorum of
    # a thousand groups (67 KB) in one go, not stall for a WINDOW_UPDATE.
    members = [
        torchft_pb2.QuorumMember(
            replica_id=f"replica_{i:04d}",
            address=f"http://127.0.0.1:1/replica_{i:04d}",
            store_address="127.0.0.1:2",
            step=1,
            world_size=1,
        )
        for i in range(1024)
    ]
    quorum = torchft_pb2.Quorum(quorum_id=1, participants=members)
    reply = torchft_pb2.LighthouseQuorumResponse(quorum=quorum).SerializeToString()
    fake = _FakeLighthouse(reply)
    client = LighthouseClient(f"http://127.0.0.1:{fake.port}", connect_timeout=TIMEOUT)
    try:
        for i in range(20):
            got = client.quorum(f"group_{i}", timedelta(seconds=TIMEOUT))
            assert len(got.participants) == 1024
    finally:
        client.close()
        fake.close()
    assert fake.error is None, repr(fake.error)
    pings = _pings(fake.frames)
    assert pings == [], f"{len(pings)} PINGs from the client in 20 calls"
    window = fake.settings.get(_INITIAL_WINDOW_SIZE, 65535)
    assert window >= len(reply) + 5, f"stream window {window} < one quorum of 1024 ({len(reply)})"
