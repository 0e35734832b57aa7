"""Hand-written HTTP/2 for the wire tests: frames, HPACK literals without
Huffman coding, and a reader that takes a peer's bytes a frame at a time.

Written apart from ``ftdist._rpc`` on purpose: a test that spoke through the
code it checks would agree with that code's mistakes.
"""

from __future__ import annotations

import socket
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS = 0x0, 0x1, 0x3, 0x4
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x6, 0x7, 0x8, 0x9
INITIAL_WINDOW_SIZE = 0x4
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8

Frame = tuple[int, int, int, bytes]
"""(type, flags, stream id, payload)"""


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, new name, lengths below 127."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + bytes([len(raw_name)]) + raw_name + bytes([len(raw_value)]) + raw_value


def request_headers(port: int, method: str) -> bytes:
    """The header block of a gRPC call of ``method`` to 127.0.0.1:``port``."""
    return b"".join(
        literal(name, value)
        for name, value in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )


class Reader:
    """Reads one peer's bytes off a socket, a frame (or a preface) at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def take(self, size: int) -> bytes:
        """The next ``size`` bytes.

        Raises:
            ConnectionError: if the peer closed the connection first.
        """
        while len(self._buffer) < size:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"the peer closed the connection ({self._buffer[:32]!r})")
            self._buffer += chunk
        head, self._buffer = self._buffer[:size], self._buffer[size:]
        return head

    def frame(self) -> Frame:
        """The next frame.

        Raises:
            ConnectionError: if the peer closed the connection first.
        """
        head = self.take(9)
        payload = self.take(int.from_bytes(head[:3], "big"))
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload


def settings_of(payload: bytes) -> dict[int, int]:
    """A SETTINGS frame's values by identifier."""
    return dict(struct.unpack(">HI", payload[at : at + 6]) for at in range(0, len(payload), 6))


def pings_of(frames: list[Frame]) -> list[Frame]:
    """The PINGs a peer sent on its own (not acknowledgements)."""
    return [f for f in frames if f[0] == PING and not f[1] & ACK]
