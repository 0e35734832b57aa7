"""ftdist's own gRPC server (ftdist._rpc.h2_server) against grpcio's client
over real sockets: what a handler sees, what the client gets back, and that
nothing a client does stops the server."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from ftdist._rpc import h2, h2_server, hpack
from ftdist._rpc.h2_server import H2Call, H2Server
from tests.integration.lighthouse_helpers import wait_until

pytestmark = pytest.mark.timeout(60)

T = 10.0


class _Fixture:
    def __init__(self) -> None:
        self.parked: list[H2Call] = []
        self.cancelled: list[str] = []
        self.seen: list[tuple[str, tuple[tuple[str, object], ...]]] = []
        self.server = H2Server(
            "127.0.0.1:0",
            {
                "/t.S/Echo": self.echo,
                "/t.S/Big": lambda call, req: call.reply(b"b" * int(req)),
                "/t.S/Park": self.park,
                "/t.S/Stream": self.stream,
                "/t.S/Crash": self.crash,
            },
            max_request_bytes=1 << 20,
            auth=lambda md: None if ("token", "t0k") in md else "wrong token",
        )
        self.port = self.server.start()
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.max_receive_message_length", 64 << 20)]
        )

    def echo(self, call: H2Call, request: bytes) -> None:
        self.seen.append((call.method, call.metadata))
        call.reply(request[::-1])

    def park(self, call: H2Call, request: bytes) -> None:
        self.parked.append(call)
        call.on_cancel(lambda: self.cancelled.append(request.decode()))

    def stream(self, call: H2Call, request: bytes) -> None:
        for i in range(int(request)):
            call.send(b"%d" % i * 10_000)
        call.abort(grpc.StatusCode.NOT_FOUND, "end of stream: ü 100%", (("k", "v"),))

    def crash(self, call: H2Call, request: bytes) -> None:
        raise RuntimeError("handler bug")

    def unary(self, method: str, request: bytes, **kwargs: object) -> bytes:
        kwargs.setdefault("metadata", (("token", "t0k"),))
        kwargs.setdefault("timeout", T)
        result: bytes = self.channel.unary_unary(method)(request, **kwargs)
        return result


@pytest.fixture
def srv() -> Iterator[_Fixture]:
    fixture = _Fixture()
    try:
        yield fixture
    finally:
        fixture.channel.close()
        fixture.server.stop(0.5)


def _code(exc: pytest.ExceptionInfo[grpc.RpcError]) -> grpc.StatusCode:
    return exc.value.code()


def test_unary_calls_small_and_large(srv: _Fixture) -> None:
    assert srv.unary("/t.S/Echo", b"hello", metadata=(("token", "t0k"), ("x-bin", b"\0\1"))) == (
        b"olleh"
    )
    method, metadata = srv.seen[0]
    assert method == "/t.S/Echo"
    assert ("x-bin", b"\0\1") in metadata and ("token", "t0k") in metadata
    request = random.Random(1).randbytes(1 << 20)  # above the client's first window
    assert srv.unary("/t.S/Echo", request) == request[::-1]
    # A reply far above the window the client grants: sent as it reopens.
    assert srv.unary("/t.S/Big", b"%d" % (20 << 20)) == b"b" * (20 << 20)


def test_many_calls_at_once_on_one_connection(srv: _Fixture) -> None:
    futures = [
        srv.channel.unary_unary("/t.S/Echo").future(
            b"%d" % i, timeout=T, metadata=(("token", "t0k"),)
        )
        for i in range(200)
    ]
    assert [f.result() for f in futures] == [(b"%d" % i)[::-1] for i in range(200)]


def test_streaming_then_an_error_status_with_trailers(srv: _Fixture) -> None:
    call = srv.channel.unary_stream("/t.S/Stream")(b"30", timeout=T, metadata=(("token", "t0k"),))
    received = []
    with pytest.raises(grpc.RpcError) as exc:
        for message in call:
            received.append(message)
    assert received == [b"%d" % i * 10_000 for i in range(30)]
    assert _code(exc) == grpc.StatusCode.NOT_FOUND
    assert exc.value.details() == "end of stream: ü 100%"
    assert ("k", "v") in tuple(exc.value.trailing_metadata())


@pytest.mark.parametrize(
    ("method", "request_", "metadata", "code"),
    [
        ("/t.S/Echo", b"x", (), grpc.StatusCode.UNAUTHENTICATED),
        ("/t.S/Nope", b"x", (("token", "t0k"),), grpc.StatusCode.UNIMPLEMENTED),
        ("/t.S/Echo", b"x" * (2 << 20), (("token", "t0k"),), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("/t.S/Crash", b"x", (("token", "t0k"),), grpc.StatusCode.INTERNAL),
    ],
)
def test_refusals(
    srv: _Fixture,
    method: str,
    request_: bytes,
    metadata: tuple[tuple[str, str], ...],
    code: grpc.StatusCode,
) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        srv.unary(method, request_, metadata=metadata)
    assert _code(exc) == code
    assert srv.seen == []
    assert srv.unary("/t.S/Echo", b"ok") == b"ko"


def test_a_compressed_request_is_refused(srv: _Fixture) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        srv.unary("/t.S/Echo", b"x" * 1000, compression=grpc.Compression.Gzip)
    assert _code(exc) == grpc.StatusCode.UNIMPLEMENTED


def test_a_deadline_or_a_disconnect_cancels_a_parked_call(srv: _Fixture) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        srv.unary("/t.S/Park", b"deadline", timeout=0.3)
    assert _code(exc) == grpc.StatusCode.DEADLINE_EXCEEDED
    other = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    future = other.unary_unary("/t.S/Park").future(
        b"disconnect", timeout=T, metadata=(("token", "t0k"),)
    )
    wait_until(lambda: len(srv.parked) == 2, T)
    other.close()
    with pytest.raises(grpc.RpcError):
        future.result()
    wait_until(lambda: len(srv.cancelled) == 2, T)
    assert sorted(srv.cancelled) == ["deadline", "disconnect"]
    assert all(call.cancelled and call.done for call in srv.parked)


def test_calls_answered_later_from_other_threads(srv: _Fixture) -> None:
    future = srv.channel.unary_unary("/t.S/Park").future(
        b"later", timeout=T, metadata=(("token", "t0k"),)
    )
    assert srv.server.run(lambda: 42) == 42
    wait_until(lambda: bool(srv.parked), T)
    threading.Thread(
        target=lambda: srv.server.call_later(0.05, lambda: srv.parked[0].reply(b"done"))
    ).start()
    assert future.result() == b"done"
    assert srv.cancelled == []


def _raw(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=T) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _frame_kinds(wire: bytes) -> list[int]:
    kinds = []
    pos = 0
    while pos + 9 <= len(wire):
        kinds.append(wire[pos + 3])
        pos += 9 + int.from_bytes(wire[pos : pos + 3], "big")
    return kinds


def test_garbage_on_the_port_never_stops_the_server(srv: _Fixture) -> None:
    rng = random.Random(7)
    request = hpack.encode([(b":method", b"POST"), (b":path", b"/t.S/Echo")])
    inputs = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        h2.PREFACE + b"\xff" * 64,
        h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, b"\xbe"),
        h2.PREFACE + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, request),  # then hangs up
        h2.PREFACE + h2.frame(h2.DATA, h2.END_STREAM, 9, b"x"),
    ]
    inputs += [h2.PREFACE + rng.randbytes(rng.randint(1, 300)) for _ in range(40)]
    inputs += [rng.randbytes(rng.randint(1, 100)) for _ in range(10)]
    for i, payload in enumerate(inputs):
        kinds = _frame_kinds(_raw(srv.port, payload))
        if i in (0, 1, 2):  # a bad preface, a frame too large, a bad header block
            assert kinds[0] == h2.SETTINGS and kinds[-1] == h2.GOAWAY, kinds
    assert srv.unary("/t.S/Echo", b"still up") == b"pu llits"


def test_a_peer_that_stops_answering_pings_loses_its_calls(
    srv: _Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2_server, "_KEEPALIVE_IDLE_S", 0.3)
    monkeypatch.setattr(h2_server, "_KEEPALIVE_TIMEOUT_S", 0.5)
    headers = hpack.encode([(b":method", b"POST"), (b":path", b"/t.S/Park"), (b"token", b"t0k")])
    with socket.create_connection(("127.0.0.1", srv.port), timeout=T) as sock:
        sock.sendall(
            h2.PREFACE
            + h2.frame(h2.SETTINGS, 0, 0)
            + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, headers)
            + h2.frame(h2.DATA, h2.END_STREAM, 1, b"\0\0\0\0\6silent")
        )
        # Reads nothing more and acknowledges no PING, like a host that died.
        wait_until(lambda: srv.cancelled == ["silent"], T)
    assert srv.cancelled == ["silent"]


def test_stop_cancels_what_is_parked_and_frees_the_port(srv: _Fixture) -> None:
    future = srv.channel.unary_unary("/t.S/Park").future(
        b"parked", timeout=T, metadata=(("token", "t0k"),)
    )
    wait_until(lambda: bool(srv.parked), T)
    srv.server.stop(0.2)
    with pytest.raises(grpc.RpcError):
        future.result()
    assert srv.cancelled == ["parked"]
    with pytest.raises(RuntimeError):
        srv.server.run(lambda: None)
    again = H2Server(f"127.0.0.1:{srv.port}", {})
    again.start()
    again.stop(0)


def test_a_port_in_use_is_an_os_error(srv: _Fixture) -> None:
    with pytest.raises(OSError, match="cannot bind"):
        H2Server(f"127.0.0.1:{srv.port}", {}).start()


def test_a_peer_that_answers_pings_keeps_its_calls(
    srv: _Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2_server, "_KEEPALIVE_IDLE_S", 0.2)
    monkeypatch.setattr(h2_server, "_KEEPALIVE_TIMEOUT_S", 0.5)
    headers = hpack.encode([(b":method", b"POST"), (b":path", b"/t.S/Park"), (b"token", b"t0k")])
    pings = 0
    with socket.create_connection(("127.0.0.1", srv.port), timeout=T) as sock:
        sock.sendall(
            h2.PREFACE
            + h2.frame(h2.SETTINGS, 0, 0)
            + h2.frame(h2.HEADERS, h2.END_HEADERS, 1, headers)
            + h2.frame(h2.DATA, h2.END_STREAM, 1, b"\0\0\0\0\4kept")
        )
        sock.settimeout(0.1)
        wire = b""
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            try:
                wire += sock.recv(65536)
            except TimeoutError:
                continue
            while len(wire) >= 9 and len(wire) >= 9 + int.from_bytes(wire[:3], "big"):
                length = int.from_bytes(wire[:3], "big")
                kind, flags, payload = wire[3], wire[4], wire[9 : 9 + length]
                wire = wire[9 + length :]
                if kind == h2.PING and not flags & h2.ACK:
                    pings += 1
                    sock.sendall(h2.frame(h2.PING, h2.ACK, 0, payload))
        assert pings >= 2
        assert srv.cancelled == []
    wait_until(lambda: srv.cancelled == ["kept"], T)
    assert srv.cancelled == ["kept"]  # closing the socket cancels it


def _read_until_closed(sock: socket.socket) -> bool:
    """True once the server has closed the connection (EOF or reset)."""
    sock.settimeout(T)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_a_client_that_never_reads_its_answers_is_cut_off(
    srv: _Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2_server, "_MAX_UNSENT_BYTES", 64 << 10)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    with sock:
        pings = h2.frame(h2.PING, 0, 0, b"12345678") * 1000
        try:
            sock.sendall(h2.PREFACE)
            for _ in range(400):  # 6.8 MB of PINGs whose ACKs nobody reads
                sock.sendall(pings)
        except (BrokenPipeError, ConnectionResetError):
            pass  # already cut off
        assert _read_until_closed(sock)
    assert srv.unary("/t.S/Echo", b"up") == b"pu"


def test_calls_per_connection_are_capped(srv: _Fixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h2_server, "_MAX_CALLS_PER_CONNECTION", 3)
    futures = [
        srv.channel.unary_unary("/t.S/Park").future(
            b"%d" % i, timeout=T, metadata=(("token", "t0k"),)
        )
        for i in range(3)
    ]
    wait_until(lambda: len(srv.parked) == 3, T)
    with pytest.raises(grpc.RpcError) as exc:
        srv.unary("/t.S/Echo", b"fourth")
    assert _code(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED
    for future in futures:
        future.cancel()


def test_unfinished_requests_per_connection_are_capped(
    srv: _Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2_server, "_MAX_BUFFERED_REQUEST_BYTES", 100_000)
    headers = hpack.encode([(b":method", b"POST"), (b":path", b"/t.S/Echo"), (b"token", b"t0k")])
    with socket.create_connection(("127.0.0.1", srv.port), timeout=T) as sock:
        wire = h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0)
        for sid in range(1, 41, 2):  # 20 requests of 1 MB announced, 10 KB of each sent
            wire += h2.frame(h2.HEADERS, h2.END_HEADERS, sid, headers)
            wire += h2.frame(h2.DATA, 0, sid, b"\0" + (1 << 20).to_bytes(4, "big") + b"x" * 10_000)
        sock.sendall(wire)
        assert _read_until_closed(sock)
    assert srv.unary("/t.S/Echo", b"up") == b"pu"


_FEW_DESCRIPTORS = """
import os, resource, sys, time
from ftdist._rpc.h2_server import H2Server
server = H2Server("127.0.0.1:0", {"/t.S/Echo": lambda call, req: call.reply(req)})
port = server.start()
limit = len(os.listdir("/proc/self/fd")) + 4
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
print(port, flush=True)
sys.stdin.readline()
server.stop(0)
"""


def test_out_of_descriptors_the_server_rests_then_serves_again() -> None:
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _FEW_DESCRIPTORS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline())
        hogs = [socket.create_connection(("127.0.0.1", port), timeout=T) for _ in range(12)]
        time.sleep(0.3)  # the server has hit its limit and rests
        for hog in hogs:
            hog.close()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            echo = channel.unary_unary("/t.S/Echo")
            assert echo(b"back", timeout=T, wait_for_ready=True) == b"back"
        finally:
            channel.close()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(T) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        _, err = child.communicate()
        if child.returncode:
            print(err)
    assert "cannot accept connections for now" in err


def test_answers_held_by_a_closed_window_count_toward_the_cap(
    srv: _Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2_server, "_MAX_UNSENT_BYTES", 50_000)
    headers = hpack.encode([(b":method", b"POST"), (b":path", b"/t.S/Echo"), (b"token", b"t0k")])
    with socket.create_connection(("127.0.0.1", srv.port), timeout=T) as sock:
        # A window of 0: every answer stays queued in the server.
        sock.sendall(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b"\0\4\0\0\0\0"))
        try:
            for sid in range(1, 401, 2):
                sock.sendall(
                    h2.frame(h2.HEADERS, h2.END_HEADERS, sid, headers)
                    + h2.frame(h2.DATA, h2.END_STREAM, sid, b"\0\0\0\4\0" + b"e" * 1024)
                )
        except (BrokenPipeError, ConnectionResetError):
            pass  # already cut off
        assert _read_until_closed(sock)
    assert srv.unary("/t.S/Echo", b"up") == b"pu"


def test_without_ipv6_the_wildcard_binds_ipv4(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: object, **kwargs: object) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "socket", no_ipv6)
    server = H2Server("[::]:0", {"/t.S/Echo": lambda call, req: call.reply(req)})
    port = server.start()
    monkeypatch.setattr(socket, "socket", real)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert channel.unary_unary("/t.S/Echo")(b"v4", timeout=T) == b"v4"
    finally:
        channel.close()
        server.stop(0)
