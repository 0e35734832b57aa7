"""Bounded servers, over real sockets: the lighthouse's caps on replica ids,
parked requests and event streams and its field limits, and the dashboard's
bounds on bodies, headers, connections and slow clients."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest

from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist.coordination import LighthouseServer
from ftdist.errors import CoordinationError
from ftdist.lighthouse import dashboard
from ftdist.lighthouse.config import resolve_lighthouse_config
from tests.integration.lighthouse_helpers import (
    TIMEOUT,
    Lighthouses,
    get_json,
    member_ids,
    pool,
    quorum_round,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def _capped(lh: Lighthouses, **settings: Any) -> LighthouseServer:
    """A lighthouse with caps (which only a config sets)."""
    settings.setdefault("min_replicas", 1)
    config = resolve_lighthouse_config(bind="127.0.0.1:0", http_port=-1, **settings)
    return lh.server(config=config)


def _code(exc: BaseException) -> grpc.StatusCode | None:
    cause = exc.__cause__
    return cause.code() if isinstance(cause, grpc.Call) else None


# -- the lighthouse -----------------------------------------------------------------


def test_new_replica_ids_are_refused_past_the_cap_until_old_ones_expire(
    lh: Lighthouses,
) -> None:
    server = _capped(lh, max_replica_ids=4, heartbeat_timeout_ms=300, quorum_tick_ms=50)
    client = lh.client(server)
    for i in range(4):
        client.heartbeat(f"r{i}")
    with pytest.raises(CoordinationError, match="already tracks 4 replica ids") as info:
        client.heartbeat("intruder")
    assert _code(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(CoordinationError, match="already tracks 4"):
        client.quorum("intruder", TIMEOUT)  # a quorum request is no way around it
    client.heartbeat("r0")  # known ids still are welcome
    assert len(client.status()["heartbeats"]) == 4
    # Once the others expired, a new id gets in (and the table stays bounded).
    time.sleep(0.5)
    wait_until(lambda: _admitted(client, "late"), what="an expired id to make room")
    assert len(client.status()["heartbeats"]) <= 4
    assert member_ids(client.quorum("late", TIMEOUT)) == ["late"]


def _admitted(client: object, replica_id: str) -> bool:
    try:
        client.heartbeat(replica_id)  # type: ignore[attr-defined]
    except CoordinationError:
        return False
    return True


def test_parked_requests_per_replica_are_capped(lh: Lighthouses) -> None:
    server = _capped(lh, min_replicas=2, max_parked_per_replica=2)
    client = lh.client(server)
    with pool(3) as executor:
        parked = [executor.submit(client.quorum, "a", TIMEOUT) for _ in range(2)]
        wait_until(lambda: len(client.status()["waiting"]) == 1, what="a to park")
        wait_until(lambda: server._server.run(lambda: server._engine.parked("a")) == 2)
        with pytest.raises(CoordinationError, match="2 quorum requests of 'a'") as info:
            client.quorum("a", TIMEOUT)
        assert _code(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The refused request changed nothing: the parked ones get the quorum.
        assert member_ids(client.quorum("b", TIMEOUT)) == ["a", "b"]
        assert [member_ids(f.result(TIMEOUT)) for f in parked] == [["a", "b"], ["a", "b"]]


def test_event_streams_are_capped(lh: Lighthouses) -> None:
    server = _capped(lh, max_subscribers=2)
    client = lh.client(server)
    first, second = client.subscribe("a"), client.subscribe("b")
    try:
        assert next(first).kind == next(second).kind == "subscribed"
        third = client.subscribe("c")
        with pytest.raises(CoordinationError, match="2 event streams are open"):
            next(third)
        first.close()
        wait_until(lambda: client.status()["num_subscribers"] == 1, what="the stream to close")
        fourth = client.subscribe("d")
        assert next(fourth).kind == "subscribed"
        fourth.close()
    finally:
        first.close()
        second.close()


def test_every_field_is_bounded(lh: Lighthouses) -> None:
    server = lh.server()
    long = "x" * 5000

    def call(method: str, message: object) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = channel.unary_stream if method == _rpc.EVENTS_SUBSCRIBE else None
            try:
                if stub is not None:
                    next(iter(stub(method)(message.SerializeToString(), timeout=TIMEOUT)))  # type: ignore[attr-defined]
                else:
                    channel.unary_unary(method)(message.SerializeToString(), timeout=TIMEOUT)  # type: ignore[attr-defined]
            except grpc.RpcError as exc:
                return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""

    def quorum(**fields: object) -> torchft_pb2.LighthouseQuorumRequest:
        fields.setdefault("replica_id", "a")
        return torchft_pb2.LighthouseQuorumRequest(requester=torchft_pb2.QuorumMember(**fields))  # type: ignore[arg-type]

    cases = [
        (_rpc.LIGHTHOUSE_HEARTBEAT, torchft_pb2.LighthouseHeartbeatRequest(replica_id=long)),
        (_rpc.EVENTS_SUBSCRIBE, ftdist_pb2.SubscribeRequest(replica_id=long)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(replica_id=long)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(address=long)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(store_address=long)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(data="d" * 70000)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(reconfigure_handles=[""] * 65537)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(reconfigure_handles=["h" * 600_000] * 2)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(step=-1)),
        (_rpc.LIGHTHOUSE_QUORUM, quorum(replica_id="")),
    ]
    for method, message in cases:
        code, details = call(method, message)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, details)
    # Above gRPC's 4 MiB receive limit the call never reaches a handler.
    code, _ = call(_rpc.LIGHTHOUSE_QUORUM, quorum(data="d" * (5 << 20)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = lh.client(server).status()
    assert status["heartbeats"] == [] and status["waiting"] == []


# -- the dashboard --------------------------------------------------------------------


@contextmanager
def _connection(port: int) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        yield sock
    finally:
        sock.close()


def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes or stops talking."""
    with _connection(port) as sock:
        sock.sendall(request)
        return _read_all(sock)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _dashboard_port(lh: Lighthouses, **kwargs: object) -> tuple[int, str]:
    server = lh.server(http_port=0, **kwargs)
    address = server.dashboard_address()
    assert address is not None
    return int(address.rsplit(":", 1)[1]), address


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (b"Content-Length: -1\r\n", b"400"),
        (b"Content-Length: abc\r\n", b"400"),
        (b"Content-Length: 1e3\r\n", b"400"),
        (b"Content-Length: \xb2\r\n", b"400"),  # a "digit" int() would not take
        (b"Content-Length: 5\r\nContent-Length: 6\r\n", b"400"),
        (b"Content-Length: 99999999999999999999999\r\n", b"400"),
        (b"Content-Length: 1000000\r\n", b"413"),
        (b"Transfer-Encoding: chunked\r\n", b"400"),
    ],
)
def test_bad_bodies_are_refused_at_once(lh: Lighthouses, headers: bytes, status: bytes) -> None:
    port, _ = _dashboard_port(lh, kill_token="t")
    # No body follows: the answer must not wait for one.
    reply = _exchange(port, b"POST /replica/a/kill HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]
    assert b"Connection: close" in reply


def test_oversized_headers_are_refused(lh: Lighthouses) -> None:
    port, address = _dashboard_port(lh)
    big = b"X-Pad: " + b"p" * 1000 + b"\r\n"
    reply = _exchange(port, b"GET /status.json HTTP/1.1\r\nHost: x\r\n" + big * 20 + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    reply = _exchange(port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert get_json(f"{address}/status.json")["quorum_id"] == 0


def test_connections_are_capped_and_never_hold_the_lighthouse(lh: Lighthouses) -> None:
    server = lh.server(http_port=0, min_replicas=2)
    address = server.dashboard_address()
    assert address is not None
    port = int(address.rsplit(":", 1)[1])
    held: list[socket.socket] = []
    try:
        for _ in range(dashboard._MAX_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            sock.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n")  # never finished
            held.append(sock)
        wait_until(
            lambda: len(server._dashboard._httpd._open) == dashboard._MAX_CONNECTIONS,  # type: ignore[union-attr]
            what="every connection to be accepted",
        )
        reply = _exchange(port, b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
        # The lighthouse serves its gRPC clients meanwhile.
        answers = quorum_round(lh.client(server), ["a", "b"])
        assert {tuple(member_ids(q)) for q in answers.values()} == {("a", "b")}
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _status_ok(address), what="the dashboard to serve again")


def _status_ok(address: str) -> bool:
    try:
        return "quorum_id" in get_json(f"{address}/status.json")
    except OSError:
        return False


def test_slow_clients_are_cut_off(lh: Lighthouses, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dashboard, "_REQUEST_DEADLINE_S", 1.0)
    port, address = _dashboard_port(lh)
    with _connection(port) as sock:
        # One byte every 0.2 s: no single read waits long (the 10 s read
        # timeout never fires), but the request as a whole is too slow.
        drip = b"GET /status.json HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 200
        started = time.monotonic()
        closed = False
        for byte in drip:
            if time.monotonic() - started > 8.0:
                break
            readable, _, _ = select.select([sock], [], [], 0.2)
            try:
                if readable and not sock.recv(4096):
                    closed = True
                    break
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
        assert closed, "the dashboard kept serving a request past its deadline"
    assert get_json(f"{address}/status.json")["quorum_id"] == 0


def test_many_concurrent_status_requests_share_fresh_documents(lh: Lighthouses) -> None:
    server = lh.server(http_port=0)
    address = server.dashboard_address()
    client = lh.client(server)
    with pool(16) as executor:
        futures = [executor.submit(get_json, f"{address}/status.json") for _ in range(64)]
        assert all("quorum_id" in f.result(TIMEOUT) for f in futures)
    client.heartbeat("fresh")
    # A request after the heartbeat sees it: no document older than the request.
    assert [h["replica_id"] for h in get_json(f"{address}/status.json")["heartbeats"]] == ["fresh"]
