"""Hand-written HTTP/2 for the wire tests: frames, HPACK literals without
Huffman coding, and a reader that takes a peer's bytes a frame at a time.

Written apart from ``ftdist._rpc`` on purpose: a test that spoke through the
code it checks would agree with that code's mistakes.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

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


class Acceptor:
    """A listener on 127.0.0.1 that serves each connection on a thread of its own.

    ``serve(sock, index)`` runs for the ``index``-th connection, with the
    socket's timeout set; :meth:`close` stops accepting, wakes every served
    connection with a shutdown, joins every thread and closes every socket.
    """

    def __init__(self, serve: Callable[[socket.socket, int], None], timeout: float) -> None:
        self._serve = serve
        self._timeout = timeout
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.stopping = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept, name="test-h2-accept")
        self._thread.start()

    def close(self) -> None:
        """Stop, and join every thread this started."""
        self.stopping.set()
        self._thread.join(self._timeout)
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(self._timeout)
        self._listener.close()
        for sock in self._socks:
            sock.close()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(self._timeout)
            self._socks.append(sock)
            thread = threading.Thread(
                target=self._serve, args=(sock, len(self._threads)), name="test-h2-serve"
            )
            self._threads.append(thread)
            thread.start()
