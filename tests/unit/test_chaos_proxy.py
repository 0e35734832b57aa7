"""The chaos suite's cutting proxy: bytes flow, vanish during a cut (no connection
refused or reset, old or new), flow again after it; other processes are not cut."""

from __future__ import annotations

import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from ftdist.chaos.proxy import CutProxy, socket_inodes

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc"),
]

QUIET_S = 0.6


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield str(host), int(port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    sock.settimeout(5)
    return sock


def _echoes(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def _silent(sock: socket.socket) -> bool:
    """Nothing arrives for a while, and the connection is neither closed nor reset."""
    sock.settimeout(QUIET_S)
    try:
        sock.recv(4096)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(5)
    return False


def test_bytes_vanish_during_a_cut_and_flow_after_it(echo: tuple[str, int]) -> None:
    with CutProxy([echo]) as proxy:
        (address,) = proxy.addresses
        old = _connect(address)
        assert _echoes(old, b"before") == b"before"

        proxy.cut(os.getpid())
        old.sendall(b"during")
        assert _silent(old)
        # A new connection is accepted (not refused), and held.
        new = _connect(address)
        new.sendall(b"new")
        assert _silent(new)
        assert proxy.held() == 2

        proxy.lift(os.getpid())
        assert old.recv(4096) == b"during"
        assert new.recv(4096) == b"new"
        assert _echoes(old, b"after") == b"after"
        assert proxy.held() == 0
        old.close()
        new.close()
    assert not any(t.name == "ftdist-chaos-proxy" and t.is_alive() for t in threading.enumerate())


def test_a_cut_of_another_process_leaves_this_ones_connections_alone(
    echo: tuple[str, int],
) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with CutProxy([echo, echo]) as proxy:
            first, second = (_connect(a) for a in proxy.addresses)
            proxy.cut(other.pid)
            assert _echoes(first, b"one") == b"one"
            assert _echoes(second, b"two") == b"two"
            assert proxy.held() == 0
            first.close()
            second.close()
    finally:
        other.kill()
        other.wait(timeout=10)


def test_a_dead_target_ends_the_connection_instead_of_hanging() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        dead = placeholder.getsockname()  # bound, never listening: refuses
        with CutProxy([dead]) as proxy:
            sock = _connect(proxy.addresses[0])
            started = time.monotonic()
            try:
                assert sock.recv(4096) == b""
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < 3
            sock.close()


def test_socket_inodes_names_this_process_sockets() -> None:
    with socket.socket() as sock:
        inode = os.fstat(sock.fileno()).st_ino
        assert inode in socket_inodes(os.getpid())
    assert socket_inodes(2**22 + 12345) == set()
