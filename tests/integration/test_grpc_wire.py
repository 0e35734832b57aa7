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
from datetime import timedelta

import pytest

from ftdist._rpc._proto import torchft_pb2
from ftdist.coordination import LighthouseClient
from tests.integration.h2_wire import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    PING,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    Acceptor,
    Frame,
    Reader,
    frame,
    literal,
    pings_of,
    request_headers,
    settings_of,
)
from tests.integration.lighthouse_helpers import TIMEOUT, Lighthouses

pytestmark = pytest.mark.timeout(60)

_HEARTBEAT = "/torchft.LighthouseService/Heartbeat"


class _Wire:
    """One HTTP/2 connection; every frame the server sends is kept in ``frames``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.frames: list[Frame] = []
        self._reader = Reader(self.sock)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))

    def close(self) -> None:
        self.sock.close()

    def call(self, stream: int, method: str, request: bytes) -> bytes:
        """One unary call; returns the response message (the gRPC prefix removed)."""
        message = b"\x00" + struct.pack(">I", len(request)) + request
        self.sock.sendall(
            frame(HEADERS, END_HEADERS, stream, request_headers(self.port, method))
            + frame(DATA, END_STREAM, stream, message)
        )
        body = b""
        while True:
            got = self._reader.frame()
            self.frames.append(got)
            kind, flags, on_stream, payload = got
            if kind == SETTINGS and not flags & ACK:
                self.sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self.sock.sendall(frame(PING, ACK, 0, payload))
            elif kind == GOAWAY:
                raise ConnectionError(f"GOAWAY from the server: {payload!r}")
            elif on_stream == stream and kind == DATA:
                body += payload
            if on_stream == stream and kind == HEADERS and flags & END_STREAM:
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
    pings = pings_of(wire.frames)
    kinds = sorted({f[0] for f in wire.frames})
    assert pings == [], f"{len(pings)} PINGs in 20 calls (frame types seen: {kinds})"
    # Without the probe the window must still take a whole request at once.
    settings = [f[3] for f in wire.frames if f[0] == SETTINGS and not f[1] & ACK]
    assert settings, kinds
    advertised = settings_of(settings[0])
    assert advertised.get(INITIAL_WINDOW_SIZE, 65535) >= 4 * 1024 * 1024, advertised
    answered = {f[2] for f in wire.frames if f[0] == HEADERS and f[1] & END_STREAM}
    assert answered == set(range(1, 41, 2))


class _FakeLighthouse:
    """Answers every call with ``reply``, within the client's flow-control
    windows, on every connection the client opens (its gRPC channel and the
    connections its unary calls take); every frame the client sends is kept."""

    def __init__(self, reply: bytes) -> None:
        self._message = b"\x00" + struct.pack(">I", len(reply)) + reply
        self.frames: list[Frame] = []
        self.settings: dict[int, int] = {}
        self.error: BaseException | None = None
        self._acceptor = Acceptor(self._serve, TIMEOUT)
        self.port = self._acceptor.port

    def close(self) -> None:
        self._acceptor.close()

    def _serve(self, conn: socket.socket, index: int) -> None:
        try:
            self._answer(conn)
        except (ConnectionError, TimeoutError, OSError):
            pass  # the client closed the connection
        except BaseException as exc:
            self.error = exc

    def _answer(self, conn: socket.socket) -> None:
        reader = Reader(conn)
        preface = reader.take(len(PREFACE))
        assert preface == PREFACE, preface
        conn.sendall(frame(SETTINGS, 0, 0))
        connection_window = initial_window = 65535
        stream_windows: dict[int, int] = {}
        sent: dict[int, int] = {}  # streams whose request ended: bytes of the answer sent
        settings: dict[int, int] = {}
        while True:
            kind, flags, stream, payload = got = reader.frame()
            self.frames.append(got)
            if kind == SETTINGS and not flags & ACK:
                settings.update(settings_of(payload))
                initial_window = settings.get(INITIAL_WINDOW_SIZE, initial_window)
                conn.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                conn.sendall(frame(PING, ACK, 0, payload))
            elif kind == WINDOW_UPDATE:
                grant = int.from_bytes(payload, "big") & 0x7FFFFFFF
                if stream == 0:
                    connection_window += grant
                else:
                    stream_windows[stream] = stream_windows.get(stream, initial_window) + grant
            elif kind == HEADERS:
                self.settings = dict(settings)  # those of a connection carrying calls
                stream_windows.setdefault(stream, initial_window)
                head = literal(":status", "200") + literal("content-type", "application/grpc")
                conn.sendall(frame(HEADERS, END_HEADERS, stream, head))
            elif kind == DATA and flags & END_STREAM:
                sent[stream] = 0
            for waiting in list(sent):
                offset = sent[waiting]
                while offset < len(self._message):
                    size = min(16384, len(self._message) - offset)
                    size = min(size, connection_window, stream_windows[waiting])
                    if size <= 0:
                        break
                    conn.sendall(frame(DATA, 0, waiting, self._message[offset : offset + size]))
                    offset += size
                    connection_window -= size
                    stream_windows[waiting] -= size
                sent[waiting] = offset
                if offset == len(self._message):
                    trailer = literal("grpc-status", "0")
                    conn.sendall(frame(HEADERS, END_HEADERS | END_STREAM, waiting, trailer))
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
    pings = pings_of(fake.frames)
    assert pings == [], f"{len(pings)} PINGs from the client in 20 calls"
    window = fake.settings.get(INITIAL_WINDOW_SIZE, 65535)
    assert window >= len(reply) + 5, f"stream window {window} < one quorum of 1024 ({len(reply)})"
