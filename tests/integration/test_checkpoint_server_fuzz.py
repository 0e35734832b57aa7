"""Fuzzing the checkpoint HTTP server: whatever clients send, it answers sanely, stays up, and
serves a well-formed client correctly afterwards."""

from __future__ import annotations

import logging
import random
import re
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch

from ftdist.checkpointing import HTTPTransport
from ftdist.checkpointing._http_server import MAX_CONNECTIONS, MAX_HEAD_BYTES

TOKEN = "fuzz-token"
REQUESTS = 300
STEP = 7
# What a request may get: the state, a 4xx, or "busy"/"not served"/"unsupported".
ALLOWED = {200, 400, 401, 404, 405, 414, 431, 501, 503, 505}

State = dict[str, torch.Tensor]


@pytest.fixture
def server() -> Iterator[tuple[HTTPTransport[State], State]]:
    src: HTTPTransport[State] = HTTPTransport(
        timedelta(seconds=1), hostname="127.0.0.1", token=TOKEN
    )
    state = {"w": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.int64)}
    src.send_checkpoint([1], STEP, state, timedelta(seconds=1))
    yield src, state
    src.shutdown()


def _open(t: HTTPTransport[State], listener: str, timeout: float | None = 10) -> socket.socket:
    """A connection to the server's TCP port or to its local (abstract Unix) socket."""
    if listener == "tcp":
        port = int(t.address().rsplit(":", 1)[1].split("/")[0])
        return socket.create_connection(("127.0.0.1", port), timeout=timeout)
    name = t.metadata().partition("#local=")[2]
    assert name, t.metadata()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect("\0" + name)
    return s


def _exchange(t: HTTPTransport[State], listener: str, payload: bytes) -> bytes:
    with _open(t, listener) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)  # no more is coming: the server must not wait for it
        except OSError:
            pass
        out = bytearray()
        while True:
            try:
                piece = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not piece:
                break
            out += piece
        return bytes(out)


def _valid(path: str = f"/checkpoint/{STEP}/full", auth: str = f"Bearer {TOKEN}") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n".encode()


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(buf) + 1)
        op = rng.choice(["flip", "insert", "delete"])
        if op == "flip" and at < len(buf):
            buf[at] ^= rng.randint(1, 255)
        elif op == "insert":
            buf[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            del buf[at : at + rng.randint(1, 8)]
    return bytes(buf)


def _cases(rng: random.Random) -> list[Callable[[], bytes]]:
    weird = "".join(rng.choice("/%.:?#\\\x00\x7f\u00e9\u2028 abc019") for _ in range(40))
    return [
        lambda: rng.randbytes(rng.randint(0, 3000)),
        lambda: _mutate(rng, _valid()),
        lambda: _valid(f"/checkpoint/{weird}/full"),
        lambda: _valid(f"/{weird}"),
        lambda: _valid("/checkpoint/" + "9" * rng.randint(18, 400) + "/full"),
        lambda: _valid(f"/checkpoint/{STEP}/{rng.choice(['metadata', '999999', '-1', '0x1', ''])}"),
        lambda: _valid(f"/checkpoint/{rng.randint(-3, STEP + 3)}/0"),
        lambda: _valid(auth=rng.choice(["", "Bearer", "Basic abc", f"Bearer {TOKEN}x", "\x00"])),
        lambda: b"GET /checkpoint/7/full HTTP/1.1\r\n" + b"X-Pad: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n",
        lambda: b"GET /checkpoint/7/full HTTP/1.1\r\n" + b"X: y\r\n" * 300 + b"\r\n",
        lambda: (rng.choice(["POST", "PUT", "HEAD", "DELETE", "BREW", "G\u00e9T"]) + " / HTTP/1.1\r\n"
                 "Content-Length: 5\r\n\r\nhello").encode(),
        lambda: b"GET /checkpoint/7/full\r\n\r\n",  # HTTP/0.9
        lambda: b"GET /checkpoint/7/full HTTP/9.9\r\n\r\n",
        lambda: _valid()[: rng.randint(0, len(_valid()) - 1)],  # truncated
        lambda: _valid().replace(b"\r\n", b"\n"),
        lambda: _valid().replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"),
    ]  # fmt: skip


def _status(reply: bytes) -> int | None:
    match = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
    return int(match.group(1)) if match else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listener", ["tcp", "local"])
def test_fuzzed_requests_never_take_the_server_down(
    server: tuple[HTTPTransport[State], State], caplog: pytest.LogCaptureFixture, listener: str
) -> None:
    caplog.set_level(logging.ERROR, logger="ftdist.checkpointing")
    src, state = server
    rng = random.Random(20250315)
    cases = _cases(rng)
    seen: dict[int | None, int] = {}
    for _ in range(REQUESTS):
        reply = _exchange(src, listener, rng.choice(cases)())
        status = _status(reply)
        # A head that never completed may get no answer at all; anything else gets a status.
        assert status in ALLOWED or (status is None and reply == b""), reply[:200]
        seen[status] = seen.get(status, 0) + 1
    assert seen.get(400) and seen.get(401) and seen.get(200), seen
    # No request made the server fail unexpectedly (it logs those as errors).
    assert [r.getMessage() for r in caplog.records] == []
    _assert_serves(src, state)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("listeners", [("tcp",), ("local",), ("tcp", "local")])
def test_connection_floods_and_silent_clients_are_bounded(
    server: tuple[HTTPTransport[State], State], listeners: tuple[str, ...]
) -> None:
    # The limit holds over both listeners together, not per listener.
    src, state = server
    silent = [
        _open(src, listeners[i % len(listeners)], timeout=None) for i in range(MAX_CONNECTIONS + 8)
    ]
    try:
        # Those past the limit are told at once that the server is busy; the
        # silent ones that got a slot are dropped at the head deadline. (Which
        # ones got a slot depends on the order the listeners' threads accept.)
        replies = []
        for s in silent:
            s.settimeout(10)
            replies.append(s.recv(4096))
        assert sum(_status(r) == 503 for r in replies) == 8, replies
        assert replies.count(b"") == MAX_CONNECTIONS, replies
    finally:
        for s in silent:
            s.close()
    _assert_serves(src, state)


def _assert_serves(src: HTTPTransport[State], state: State) -> None:
    dst: HTTPTransport[State] = HTTPTransport(
        timedelta(seconds=10), hostname="127.0.0.1", token=TOKEN
    )
    try:
        got = dst.recv_checkpoint(0, src.metadata(), STEP, timedelta(seconds=10))
        assert got.keys() == state.keys()
        for k in state:
            assert torch.equal(got[k], state[k])
    finally:
        dst.shutdown()
