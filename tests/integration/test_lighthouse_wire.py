"""What the lighthouse puts on the wire, read frame by frame.

A hand-written HTTP/2 client (plain frames, HPACK literals without Huffman
coding) calls the real server over a real socket and records every frame the
server sends back, so that a test can say what a client has to handle per
call, not just what the call returns.
"""

from __future__ import annotations

import socket
import struct

import pytest

from ftdist._rpc._proto import torchft_pb2
from tests.integration.lighthouse_helpers import TIMEOUT, Lighthouses

pytestmark = pytest.mark.timeout(60)

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _SETTINGS, _PING, _GOAWAY = 0x0, 0x1, 0x4, 0x6, 0x7
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


class _Wire:
    """One HTTP/2 connection; every frame the server sends is kept in ``frames``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.frames: list[tuple[int, int, int, bytes]] = []
        self._buffer = b""
        self.sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0))

    def close(self) -> None:
        self.sock.close()

    def _read_frame(self) -> tuple[int, int, int, bytes]:
        while True:
            if len(self._buffer) >= 9:
                length = int.from_bytes(self._buffer[:3], "big")
                if len(self._buffer) >= 9 + length:
                    head, self._buffer = self._buffer[: 9 + length], self._buffer[9 + length :]
                    kind, flags = head[3], head[4]
                    stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                    return kind, flags, stream, head[9:]
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(
                    f"the server closed the connection; frames so far: {self.frames}"
                )
            self._buffer += chunk

    def call(self, stream: int, method: str, request: bytes) -> bytes:
        """One unary call; returns the response message (the gRPC prefix removed)."""
        message = b"\x00" + struct.pack(">I", len(request)) + request
        self.sock.sendall(
            _frame(_HEADERS, _END_HEADERS, stream, _request_headers(self.port, method))
            + _frame(_DATA, _END_STREAM, stream, message)
        )
        body = b""
        while True:
            frame = self._read_frame()
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
            reply = wire.call(stream, _HEARTBEAT, request)
            assert torchft_pb2.LighthouseHeartbeatResponse.FromString(reply) is not None
    finally:
        wire.close()
    pings = [frame for frame in wire.frames if frame[0] == _PING and not frame[1] & _ACK]
    kinds = sorted({frame[0] for frame in wire.frames})
    assert pings == [], f"{len(pings)} PINGs in 20 calls (frame types seen: {kinds})"
    answered = {
        frame[2] for frame in wire.frames if frame[0] == _HEADERS and frame[1] & _END_STREAM
    }
    assert answered == set(range(1, 41, 2))
