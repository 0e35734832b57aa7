"""The unary gRPC client on HTTP/2 (``ftdist._rpc.h2_client``), over real sockets.

Against real servers (ftdist's lighthouse on its HTTP/2 server, torchft's
Rust lighthouse), and against a hand-written HTTP/2 peer that plays the
server's part frame by frame: what a server may do that a test cannot make a
real one do on cue (a GOAWAY between calls, a refused stream, a connection
dropped with a call in flight, small flow-control windows, a response split
into padded and continued frames).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import torchft_pb2
from ftdist._rpc.auth import call_metadata
from ftdist._rpc.h2_client import H2Channel, H2RpcError
from ftdist.coordination import LighthouseClient, LighthouseServer
from tests.integration.h2_wire import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    PADDED,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Acceptor,
    Frame,
    Reader,
    frame,
    literal,
)
from tests.integration.lighthouse_helpers import TIMEOUT, wait_for_status

pytestmark = pytest.mark.timeout(60)

_ECHO = "/test.Echo/Call"


def _raw(payload: bytes) -> bytes:
    return payload


def _echo(channel: H2Channel) -> Callable[..., bytes]:
    call: Callable[..., bytes] = channel.unary_unary(_ECHO, _raw, _raw)
    return call


def _lighthouse_calls(channel: H2Channel) -> tuple[Callable[..., Any], Callable[..., Any]]:
    heartbeat = channel.unary_unary(
        _rpc.LIGHTHOUSE_HEARTBEAT,
        torchft_pb2.LighthouseHeartbeatRequest.SerializeToString,
        torchft_pb2.LighthouseHeartbeatResponse.FromString,
    )
    quorum = channel.unary_unary(
        _rpc.LIGHTHOUSE_QUORUM,
        torchft_pb2.LighthouseQuorumRequest.SerializeToString,
        torchft_pb2.LighthouseQuorumResponse.FromString,
    )
    return heartbeat, quorum


def _member(replica_id: str) -> torchft_pb2.LighthouseQuorumRequest:
    return torchft_pb2.LighthouseQuorumRequest(
        requester=torchft_pb2.QuorumMember(
            replica_id=replica_id,
            address=f"http://127.0.0.1:1/{replica_id}",
            store_address="127.0.0.1:2",
            step=1,
            world_size=1,
        )
    )


@contextlib.contextmanager
def _channel(port: int) -> Iterator[H2Channel]:
    channel = H2Channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        channel.close()


# -- against real servers -----------------------------------------------------------


def test_calls_to_ftdist_lighthouse_answer_and_fail_as_grpc_does() -> None:
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_port=-1) as server:
        with _channel(server.port) as channel:
            heartbeat, quorum = _lighthouse_calls(channel)
            for _ in range(3):
                heartbeat(torchft_pb2.LighthouseHeartbeatRequest(replica_id="a"), timeout=TIMEOUT)
            got = quorum(_member("a"), timeout=TIMEOUT)
            assert [m.replica_id for m in got.quorum.participants] == ["a"]
            with pytest.raises(H2RpcError) as refused:
                quorum(_member(""), timeout=TIMEOUT)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "replica_id" in refused.value.details()
            assert isinstance(refused.value, grpc.Call) and isinstance(refused.value, grpc.RpcError)
            with pytest.raises(H2RpcError) as unknown:
                _echo(channel)(b"x", timeout=TIMEOUT)
            assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
            # Calls after errors still go through (the pool kept working connections),
            # and the look at an idle connection never waits: not for the
            # previous call's longer timeout, nor past this call's own.
            began = time.monotonic()
            heartbeat(torchft_pb2.LighthouseHeartbeatRequest(replica_id="a"), timeout=5.0)
            assert time.monotonic() - began < 0.75 * TIMEOUT


def test_the_job_token_travels_as_metadata() -> None:
    with LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, http_port=-1, token="s3cret"
    ) as server:
        with _channel(server.port) as channel:
            heartbeat, _ = _lighthouse_calls(channel)
            request = torchft_pb2.LighthouseHeartbeatRequest(replica_id="a")
            with pytest.raises(H2RpcError) as refused:
                heartbeat(request, timeout=TIMEOUT)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(H2RpcError):
                heartbeat(request, timeout=TIMEOUT, metadata=call_metadata("wrong"))
            heartbeat(request, timeout=TIMEOUT, metadata=call_metadata("s3cret"))


@pytest.mark.skipif(
    shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) is None,
    reason="torchft's Rust lighthouse is not installed (pip install torchft-nightly)",
)
def test_calls_to_torchfts_rust_lighthouse() -> None:
    # tonic's HTTP/2 (the h2 crate) indexes response headers in HPACK's
    # dynamic table and Huffman-codes them: many calls on one connection.
    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    assert binary is not None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with _channel(port) as channel:
            heartbeat, quorum = _lighthouse_calls(channel)
            deadline = time.monotonic() + TIMEOUT
            while True:
                try:
                    heartbeat(torchft_pb2.LighthouseHeartbeatRequest(replica_id="a"), timeout=2)
                    break
                except H2RpcError as exc:
                    assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
                    assert exc.details().startswith("failed to connect"), exc.details()
                    assert time.monotonic() < deadline, "torchft's lighthouse never came up"
                    time.sleep(0.1)
            for step in range(1, 20):
                heartbeat(torchft_pb2.LighthouseHeartbeatRequest(replica_id="a"), timeout=TIMEOUT)
                request = _member("a")
                request.requester.step = step
                got = quorum(request, timeout=TIMEOUT)
                assert [m.replica_id for m in got.quorum.participants] == ["a"]
            with pytest.raises(H2RpcError) as unknown:
                _echo(channel)(b"x", timeout=TIMEOUT)
            assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        proc.kill()
        proc.wait(TIMEOUT)


def test_threads_call_at_once_on_connections_of_their_own() -> None:
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_port=-1) as server:
        with _channel(server.port) as channel:
            heartbeat, _ = _lighthouse_calls(channel)
            errors: list[BaseException] = []

            def beat(i: int) -> None:
                try:
                    for _ in range(30):
                        request = torchft_pb2.LighthouseHeartbeatRequest(replica_id=f"r{i}")
                        heartbeat(request, timeout=TIMEOUT)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=beat, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT)
            assert not any(t.is_alive() for t in threads)
            assert errors == []
            assert wait_for_status(
                server.address(),
                lambda s: {f"r{i}" for i in range(8)} <= {h["replica_id"] for h in s["heartbeats"]},
                TIMEOUT,
            )


def test_a_call_past_its_timeout_ends_and_is_cancelled_on_the_server() -> None:
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, http_port=-1) as server:
        with _channel(server.port) as channel:
            _, quorum = _lighthouse_calls(channel)
            began = time.monotonic()
            with pytest.raises(H2RpcError) as late:
                quorum(_member("alone"), timeout=0.5)
            assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - began < TIMEOUT
            # The connection was closed: the lighthouse dropped the request.
            assert wait_for_status(server.address(), lambda s: s["waiting"] == [], TIMEOUT)


def test_nothing_listening_is_unavailable_failed_to_connect() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: refused
        with _channel(port) as channel:
            with pytest.raises(H2RpcError) as refused:
                _echo(channel)(b"x", timeout=TIMEOUT)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert refused.value.details().startswith("failed to connect")


def test_closing_the_channel_ends_a_waiting_call_and_refuses_new_ones() -> None:
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, http_port=-1) as server:
        channel = H2Channel(f"127.0.0.1:{server.port}")
        _, quorum = _lighthouse_calls(channel)
        ended: list[BaseException] = []

        def wait() -> None:
            try:
                quorum(_member("alone"), timeout=TIMEOUT)
            except BaseException as exc:
                ended.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert wait_for_status(server.address(), lambda s: len(s["waiting"]) == 1, TIMEOUT)
        channel.close()
        waiter.join(TIMEOUT)
        assert not waiter.is_alive()
        assert len(ended) == 1 and isinstance(ended[0], H2RpcError), ended
        assert ended[0].code() is grpc.StatusCode.CANCELLED
        with pytest.raises(ValueError, match="closed channel"):
            quorum(_member("later"), timeout=TIMEOUT)
        channel.close()  # idempotent


def test_a_restarted_server_is_reached_on_a_new_connection() -> None:
    first = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_port=-1)
    port = first.port
    with _channel(port) as channel:
        heartbeat, _ = _lighthouse_calls(channel)
        request = torchft_pb2.LighthouseHeartbeatRequest(replica_id="a")
        try:
            heartbeat(request, timeout=TIMEOUT)
        finally:
            first.shutdown()
        with LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, http_port=-1):
            # The idle connection to the old server is found closed before
            # use, so the call goes on a new one instead of failing.
            heartbeat(request, timeout=TIMEOUT)


@pytest.mark.parametrize("rpc_client", ["h2", "grpcio"])
def test_the_lighthouse_client_on_either_transport(rpc_client: str) -> None:
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, http_port=-1) as server:
        clients = [LighthouseClient(server.address(), TIMEOUT, rpc_client=rpc_client) for _ in "ab"]
        try:
            transports = {type(c._current.conn._unary).__name__ for c in clients if c._current.conn}
            assert transports == {"H2Channel" if rpc_client == "h2" else "Channel"}
            for step in range(3):
                for client, rid in zip(clients, "ab", strict=True):
                    client.heartbeat(rid, timeout=TIMEOUT)
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    futures = [
                        pool.submit(c.quorum, rid, TIMEOUT, step=step)
                        for c, rid in zip(clients, "ab", strict=True)
                    ]
                    quorums = [f.result(TIMEOUT) for f in futures]
                assert all([m.replica_id for m in q.participants] == ["a", "b"] for q in quorums)
            assert clients[0].status()["quorum_id"] >= 1
        finally:
            for client in clients:
                client.close()


def test_a_bad_rpc_client_setting_fails_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTDIST_LIGHTHOUSE_RPC_CLIENT", "tonic")
    with pytest.raises(ValueError, match="FTDIST_LIGHTHOUSE_RPC_CLIENT"):
        LighthouseClient("127.0.0.1:1", 0.1)


# -- against a hand-written peer ----------------------------------------------------


class _Link:
    """The server's side of one connection, driven by a test's script."""

    def __init__(self, sock: socket.socket, initial_window: int) -> None:
        self.sock = sock
        self.reader = Reader(sock)
        self.frames: list[Frame] = []
        assert self.reader.take(len(PREFACE)) == PREFACE
        settings = struct.pack(">HI", INITIAL_WINDOW_SIZE, initial_window)
        sock.sendall(frame(SETTINGS, 0, 0, settings))

    def next_frame(self) -> Frame:
        got = self.reader.frame()
        self.frames.append(got)
        kind, flags, _, _ = got
        if kind == SETTINGS and not flags & ACK:
            self.sock.sendall(frame(SETTINGS, ACK, 0))
        return got

    def request(self, grant: bool = False) -> tuple[int, bytes, bytes]:
        """(stream, header block, message) of the next whole request.

        ``grant``: give back the window of every DATA frame as it arrives.
        """
        blocks: dict[int, bytes] = {}
        bodies: dict[int, bytes] = {}
        while True:
            kind, flags, stream, payload = self.next_frame()
            if kind == HEADERS:
                blocks[stream] = payload
                bodies[stream] = b""
            elif kind == DATA:
                bodies[stream] += payload
                if grant and payload:
                    size = struct.pack(">I", len(payload))
                    self.sock.sendall(
                        frame(WINDOW_UPDATE, 0, 0, size) + frame(WINDOW_UPDATE, 0, stream, size)
                    )
                if flags & END_STREAM:
                    return stream, blocks[stream], bodies[stream][5:]

    def reply(
        self,
        stream: int,
        message: bytes,
        *,
        status: int = 0,
        message_text: str = "",
        then: bytes = b"",
    ) -> None:
        """Answer ``stream`` in one write, with ``then`` (more frames) in the same write."""
        head = literal(":status", "200") + literal("content-type", "application/grpc")
        body = b"\x00" + struct.pack(">I", len(message)) + message
        trailer = literal("grpc-status", str(status))
        if message_text:
            trailer += literal("grpc-message", message_text)
        self.sock.sendall(
            frame(HEADERS, END_HEADERS, stream, head)
            + frame(DATA, 0, stream, body)
            + frame(HEADERS, END_HEADERS | END_STREAM, stream, trailer)
            + then
        )


def _trailers_only(status: int, message: str, *extra: tuple[str, str]) -> bytes:
    """The header block of a response that is only its status."""
    block = (
        literal(":status", "200")
        + literal("content-type", "application/grpc")
        + literal("grpc-status", str(status))
        + literal("grpc-message", message)
    )
    return block + b"".join(literal(name, value) for name, value in extra)


class _Peer:
    """A hand-written HTTP/2 server: connection ``i`` runs ``scripts[i](link)``."""

    def __init__(self, *scripts: Callable[[_Link], None], initial_window: int = 65_535) -> None:
        self._scripts = list(scripts)
        self._window = initial_window
        self.links: list[_Link] = []
        self.errors: list[BaseException] = []
        self._acceptor = Acceptor(self._run, TIMEOUT)
        self.port = self._acceptor.port

    def close(self) -> None:
        self._acceptor.close()

    def _run(self, sock: socket.socket, index: int) -> None:
        try:
            link = _Link(sock, self._window)
            self.links.append(link)
            if index >= len(self._scripts):
                raise AssertionError(f"connection {index} was not expected")
            self._scripts[index](link)
        except BaseException as exc:
            if not self._acceptor.stopping.is_set():
                self.errors.append(exc)


@contextlib.contextmanager
def _peer(*scripts: Callable[[_Link], None], initial_window: int = 65_535) -> Iterator[_Peer]:
    peer = _Peer(*scripts, initial_window=initial_window)
    try:
        yield peer
    finally:
        peer.close()
    assert peer.errors == [], peer.errors


def _linger(link: _Link) -> None:
    """Keep the connection open until the client closes it."""
    with contextlib.suppress(ConnectionError, OSError):
        while True:
            link.next_frame()


def test_a_ping_while_idle_is_answered_and_a_goaway_moves_the_call() -> None:
    def first(link: _Link) -> None:
        stream, _, message = link.request()
        link.reply(stream, message)
        link.sock.sendall(frame(PING, 0, 0, b"12345678"))
        # The client answers when it next uses the connection: before it
        # sends its next call (the PING waited in the idle connection), or
        # while that call waits (the PING came later); either order is right.
        acked, stream = False, 0
        while not (acked and stream):
            kind, flags, on_stream, payload = link.next_frame()
            if kind == PING:
                assert flags & ACK and payload == b"12345678"
                acked = True
            elif kind == DATA and flags & END_STREAM:
                stream = on_stream
        # Not taken: the next call must go elsewhere, on a new connection.
        link.sock.sendall(frame(GOAWAY, 0, 0, struct.pack(">II", stream - 2, 0)))
        _linger(link)

    def second(link: _Link) -> None:
        stream, _, message = link.request()
        link.reply(stream, b"second:" + message)
        _linger(link)

    with _peer(first, second) as peer, _channel(peer.port) as channel:
        echo = _echo(channel)
        assert echo(b"one", timeout=TIMEOUT) == b"one"
        time.sleep(0.2)  # mostly, the PING is waiting when the next call begins
        assert echo(b"two", timeout=TIMEOUT) == b"second:two"
    assert len(peer.links) == 2


def test_a_refused_stream_is_sent_again_and_a_lost_call_is_not() -> None:
    def refuse(link: _Link) -> None:
        stream, _, _ = link.request()
        link.sock.sendall(frame(RST_STREAM, 0, stream, struct.pack(">I", 0x7)))
        _linger(link)

    def answer_then_drop(link: _Link) -> None:
        stream, _, message = link.request()
        link.reply(stream, message)
        link.request()  # the next call arrives; the connection dies under it
        link.sock.shutdown(socket.SHUT_RDWR)

    with _peer(refuse, answer_then_drop) as peer, _channel(peer.port) as channel:
        echo = _echo(channel)
        assert echo(b"again", timeout=TIMEOUT) == b"again"
        with pytest.raises(H2RpcError) as lost:
            echo(b"lost", timeout=TIMEOUT)
        assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
        assert not lost.value.details().startswith("failed to connect")
    # Never resent: a third connection would have failed the peer.
    assert len(peer.links) == 2


def test_statuses_in_trailers_only_and_http_errors() -> None:
    def script(link: _Link) -> None:
        stream, _, _ = link.request()
        trailers = _trailers_only(5, "no%20such%25thing", ("x-leader", "h:1"))
        link.sock.sendall(frame(HEADERS, END_HEADERS | END_STREAM, stream, trailers))
        stream, _, _ = link.request()
        link.sock.sendall(
            frame(HEADERS, END_HEADERS | END_STREAM, stream, literal(":status", "503"))
        )
        stream, _, _ = link.request()
        link.reply(stream, b"ok")
        _linger(link)

    with _peer(script) as peer, _channel(peer.port) as channel:
        echo = _echo(channel)
        with pytest.raises(H2RpcError) as missing:
            echo(b"a", timeout=TIMEOUT)
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
        assert missing.value.details() == "no such%thing"
        assert missing.value.trailing_metadata() == (("x-leader", "h:1"),)
        with pytest.raises(H2RpcError) as busy:
            echo(b"b", timeout=TIMEOUT)
        assert busy.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "503" in busy.value.details()
        assert echo(b"c", timeout=TIMEOUT) == b"ok"
    assert len(peer.links) == 1  # statuses keep the connection


def test_large_messages_both_ways_under_small_windows_and_split_frames() -> None:
    request = bytes(range(256)) * 800  # 200 KiB, above every default window
    response = bytes(reversed(range(256))) * 8192  # 2 MiB

    def script(link: _Link) -> None:
        for _ in range(2):
            stream, block, message = link.request(grant=True)
            assert message == request
            assert literal(":path", _ECHO) in block
            head = literal(":status", "200") + literal("content-type", "application/grpc")
            # The header block in two pieces, the body in padded 16 KiB frames.
            link.sock.sendall(
                frame(HEADERS, 0, stream, head[:5])
                + frame(CONTINUATION, END_HEADERS, stream, head[5:])
            )
            body = b"\x00" + struct.pack(">I", len(response)) + response
            for at in range(0, len(body), 16_000):
                piece = body[at : at + 16_000]
                link.sock.sendall(frame(DATA, PADDED, stream, b"\x03" + piece + b"\x00\x00\x00"))
            link.sock.sendall(
                frame(HEADERS, END_HEADERS | END_STREAM, stream, literal("grpc-status", "0"))
            )
        _linger(link)

    with _peer(script, initial_window=16_384) as peer, _channel(peer.port) as channel:
        echo = _echo(channel)
        for _ in range(2):
            assert echo(request, timeout=TIMEOUT) == response
    frames = peer.links[0].frames
    sent = [f for f in frames if f[0] == DATA]
    # The client stayed within the windows: no frame above the default frame size.
    assert max(len(f[3]) for f in sent) <= 16_384


def test_a_write_the_server_never_reads_ends_at_the_deadline() -> None:
    # Windows opened wide, then nothing read: the request's write fills the
    # socket buffers and waits. Past the deadline it is DEADLINE_EXCEEDED,
    # not a refusal sent again nor a broken connection.
    done = threading.Event()

    def script(link: _Link) -> None:
        grant = struct.pack(">I", (1 << 31) - 1 - 65_535)
        link.sock.sendall(frame(WINDOW_UPDATE, 0, 0, grant))
        done.wait(TIMEOUT)

    with _peer(script, initial_window=(1 << 31) - 1) as peer, _channel(peer.port) as channel:
        try:
            with pytest.raises(H2RpcError) as late:
                _echo(channel)(b"x" * (64 << 20), timeout=1.0)
        finally:
            done.set()
    assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, late.value
    assert len(peer.links) == 1


def test_a_reset_after_the_whole_response_leaves_the_calls_outcome() -> None:
    # gRPC's C core, ending a call at its deadline, writes the trailers and a
    # RST_STREAM(NO_ERROR) together: the status is the outcome, not the reset.
    no_error = struct.pack(">I", 0)

    def script(link: _Link) -> None:
        stream, _, message = link.request()
        link.reply(stream, message, then=frame(RST_STREAM, 0, stream, no_error))
        stream, _, _ = link.request()
        trailers_only = _trailers_only(4, "Deadline Exceeded")
        link.sock.sendall(
            frame(HEADERS, END_HEADERS | END_STREAM, stream, trailers_only)
            + frame(RST_STREAM, 0, stream, no_error)
        )
        stream, _, _ = link.request()
        link.sock.sendall(frame(RST_STREAM, 0, stream, no_error))  # no response at all
        _linger(link)

    with _peer(script) as peer, _channel(peer.port) as channel:
        echo = _echo(channel)
        assert echo(b"whole", timeout=TIMEOUT) == b"whole"
        with pytest.raises(H2RpcError) as late:
            echo(b"late", timeout=TIMEOUT)
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(H2RpcError) as reset:
            echo(b"reset", timeout=TIMEOUT)
        assert reset.value.code() is grpc.StatusCode.INTERNAL
        assert "reset by the server" in reset.value.details()
    assert len(peer.links) == 1
