"""The lighthouse with real gRPC servers and many concurrent clients.

Timing is never asserted: tests wait for outcomes with generous timeouts and
use short heartbeat/join timeouts only to keep the suite fast.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from datetime import timedelta

import grpc
import pytest

from ftdist._rpc._proto import torchft_pb2
from ftdist.coordination import LighthouseClient, LighthouseEvent
from ftdist.errors import CoordinationError, CoordinationTimeoutError
from tests.integration.lighthouse_helpers import (
    TIMEOUT,
    Heartbeater,
    Lighthouses,
    get_json,
    hold_port,
    member_ids,
    pool,
    quorum_round,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


# -- item 6: quorum scenarios -------------------------------------------------


def _wait_heartbeating(dashboard: str | None, count: int) -> None:
    wait_until(
        lambda: get_json(f"{dashboard}/status.json")["num_heartbeating"] == count,
        what=f"{count} heartbeating replicas",
    )


# Every test here runs on the default server (ftdist's HTTP/2 one); these two
# also run on grpcio's core, which TLS uses and FTDIST_LIGHTHOUSE_RPC_SERVER picks.
_BOTH_SERVERS = pytest.mark.parametrize("rpc_server", ["h2", "grpcio"])


@_BOTH_SERVERS
def test_many_concurrent_clients_get_one_sorted_quorum(
    lh: Lighthouses, rpc_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FTDIST_LIGHTHOUSE_RPC_SERVER", rpc_server)
    n = 48
    server = lh.server(min_replicas=n)
    client = lh.client(server)
    ids = [f"replica_{i:02d}" for i in reversed(range(n))]
    with pool(n) as executor:
        futures = {
            rid: executor.submit(
                client.quorum,
                rid,
                timedelta(seconds=TIMEOUT),
                address=f"http://m/{rid}",
                store_address=f"s:{i}",
                step=i,
                world_size=2,
                data={"rank": i, 1: "x"},
            )
            for i, rid in enumerate(ids)
        }
        answers = {rid: f.result(TIMEOUT + 5) for rid, f in futures.items()}
    first = answers[ids[0]]
    assert member_ids(first) == sorted(ids)
    assert {q.quorum_id for q in answers.values()} == {1}
    assert all(q == first for q in answers.values())
    by_id = {m.replica_id: m for m in first.participants}
    for i, rid in enumerate(ids):
        member = by_id[rid]
        assert (member.address, member.store_address, member.step, member.world_size) == (
            f"http://m/{rid}",
            f"s:{i}",
            i,
            2,
        )
        assert member.data == {"rank": i, "1": "x"}  # JSON keys become strings
    assert abs(first.created.seconds - time.time()) < 600

    again = quorum_round(client, ids)
    assert {q.quorum_id for q in again.values()} == {1}


def test_new_member_joins_at_the_next_round(lh: Lighthouses) -> None:
    # A long join timeout: the joiner must get in through the fast quorum.
    server = lh.server(min_replicas=2, join_timeout_ms=60_000)
    client = lh.client(server)
    assert {q.quorum_id for q in quorum_round(client, ["a", "b"]).values()} == {1}
    with pool(1) as executor:
        joiner = executor.submit(client.quorum, "c", TIMEOUT)
        # c heartbeats but the previous members have not asked yet: it waits.
        time.sleep(0.2)
        assert not joiner.done()
        answers = quorum_round(client, ["a", "b"])
        joined = joiner.result(TIMEOUT)
    assert member_ids(joined) == ["a", "b", "c"]
    assert {q.quorum_id for q in answers.values()} == {2}


def test_member_that_stops_heartbeating_is_dropped(lh: Lighthouses) -> None:
    server = lh.server(
        min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=60_000, http_port=0
    )
    client = lh.client(server)
    beats = Heartbeater(client, ["a", "b", "c"])
    try:
        _wait_heartbeating(server.dashboard_address(), 3)
        assert member_ids(quorum_round(client, ["a", "b", "c"])["a"]) == ["a", "b", "c"]
    finally:
        beats.stop()
    beats = Heartbeater(client, ["a", "b"])
    try:
        # c is gone. Without heartbeat expiry this would wait 60 s (join timeout).
        answers = quorum_round(client, ["a", "b"])
    finally:
        beats.stop()
    assert member_ids(answers["a"]) == ["a", "b"]
    assert answers["a"].quorum_id == 2


def test_split_brain_guard_needs_more_than_half(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1, join_timeout_ms=200, http_port=0)
    client = lh.client(server)
    beats = Heartbeater(client, ["a", "b", "c"])
    try:
        _wait_heartbeating(server.dashboard_address(), 3)
        with pytest.raises(TimeoutError):
            client.quorum("a", timeout=0.6)
        with pool(1) as executor:
            alone = executor.submit(client.quorum, "a", TIMEOUT)
            wait_until(
                lambda: (
                    "need at least half of 3 healthy workers"
                    in get_json(f"{server.dashboard_address()}/status.json")["next_quorum"][
                        "reason"
                    ]
                ),
                what="split-brain reason",
            )
            pair = client.quorum("b", TIMEOUT)
            assert member_ids(alone.result(TIMEOUT)) == ["a", "b"]
        assert member_ids(pair) == ["a", "b"]
    finally:
        beats.stop()


def test_shrink_only_keeps_joiner_out_until_next_round(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=2, join_timeout_ms=60_000)
    client = lh.client(server)
    quorum_round(client, ["a", "b"])
    with pool(3) as executor:
        joiner = executor.submit(client.quorum, "c", TIMEOUT)
        time.sleep(0.2)
        shrink_a = executor.submit(client.quorum, "a", TIMEOUT, shrink_only=True)
        plain_b = executor.submit(client.quorum, "b", TIMEOUT)
        assert member_ids(shrink_a.result(TIMEOUT)) == ["a", "b"]
        assert member_ids(plain_b.result(TIMEOUT)) == ["a", "b"]
        assert not joiner.done()
        quorum_round(client, ["a", "b"])
        assert member_ids(joiner.result(TIMEOUT)) == ["a", "b", "c"]


def test_commit_failures_bump_quorum_id(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=2)
    client = lh.client(server)
    seen = []
    for failures in (0, 0, 2, 0):
        with pool(2) as executor:
            a = executor.submit(client.quorum, "a", TIMEOUT, commit_failures=failures)
            b = executor.submit(client.quorum, "b", TIMEOUT)
            seen.append((a.result(TIMEOUT).quorum_id, b.result(TIMEOUT).quorum_id))
    assert seen == [(1, 1), (1, 1), (2, 2), (2, 2)]


def test_join_timeout_waits_for_heartbeating_straggler_then_proceeds(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1, join_timeout_ms=500, http_port=0)
    client = lh.client(server)
    beats = Heartbeater(client, ["straggler"])
    try:
        # Heard before a and b ask: otherwise the quorum forms at once, no
        # one else being known to wait for.
        _wait_heartbeating(server.dashboard_address(), 1)
        with pool(2) as executor:
            futures = [executor.submit(client.quorum, rid, TIMEOUT) for rid in ("a", "b")]
            wait_until(
                lambda: (
                    "due to join timeout"
                    in get_json(f"{server.dashboard_address()}/status.json")["next_quorum"][
                        "reason"
                    ]
                ),
                what="join-timeout reason",
            )
            results = [f.result(TIMEOUT) for f in futures]
    finally:
        beats.stop()
    assert all(member_ids(q) == ["a", "b"] for q in results)


# -- item 4: bad input never takes it down ------------------------------------


def _raw_call(server_port: int, method: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{server_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(method)(payload, timeout=TIMEOUT)
    return info.value


def _quorum_request(**member: object) -> bytes:
    request: bytes = torchft_pb2.LighthouseQuorumRequest(
        requester=torchft_pb2.QuorumMember(**member)  # type: ignore[arg-type]
    ).SerializeToString()
    return request


QUORUM = "/torchft.LighthouseService/Quorum"
HEARTBEAT = "/torchft.LighthouseService/Heartbeat"


@pytest.mark.parametrize(
    "method, payload, code, words",
    [
        (QUORUM, b"", grpc.StatusCode.INVALID_ARGUMENT, "missing requester"),
        (
            QUORUM,
            _quorum_request(replica_id=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "requester.replica_id",
        ),
        (
            QUORUM,
            _quorum_request(replica_id="a", step=-3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "requester.step",
        ),
        (
            QUORUM,
            _quorum_request(replica_id="a", data="x" * 70_000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "requester.data",
        ),
        (
            QUORUM,
            _quorum_request(replica_id="a", commit_failures=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "requester.commit_failures",
        ),
        (
            QUORUM,
            _quorum_request(replica_id="a" * 5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "requester.replica_id",
        ),
        (QUORUM, b"\xff\xff\xff\xff garbage", grpc.StatusCode.INVALID_ARGUMENT, "not a valid"),
        (QUORUM, b"\x00" * (5 * 1024 * 1024), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        (HEARTBEAT, b"", grpc.StatusCode.INVALID_ARGUMENT, "replica_id must not be empty"),
        (HEARTBEAT, b"\x0a\xff", grpc.StatusCode.INVALID_ARGUMENT, "not a valid"),
        ("/torchft.LighthouseService/Nope", b"", grpc.StatusCode.UNIMPLEMENTED, "unknown method"),
    ],
    ids=[
        "missing-requester",
        "empty-replica-id",
        "negative-step",
        "oversized-data",
        "negative-commit-failures",
        "oversized-replica-id",
        "garbage-message",
        "message-over-grpc-limit",
        "heartbeat-empty-id",
        "heartbeat-garbage",
        "unknown-method",
    ],
)
def test_bad_request_gets_clear_error_and_server_keeps_serving(
    lh: Lighthouses, method: str, payload: bytes, code: grpc.StatusCode, words: str
) -> None:
    server = lh.server(min_replicas=1)
    error = _raw_call(server.port, method, payload)
    assert error.code() == code, error
    assert words in (error.details() or "")
    assert member_ids(lh.client(server).quorum("ok", TIMEOUT)) == ["ok"]


def test_garbage_bytes_on_the_port_are_dropped(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1)
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 64, b"PRI * HTTP/2.0"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
            sock.sendall(junk)
            sock.settimeout(2.0)
            try:
                sock.recv(1024)
            except (TimeoutError, ConnectionError):
                pass
    assert member_ids(lh.client(server).quorum("ok", TIMEOUT)) == ["ok"]


@_BOTH_SERVERS
def test_client_that_disconnects_mid_call_is_withdrawn(
    lh: Lighthouses, rpc_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FTDIST_LIGHTHOUSE_RPC_SERVER", rpc_server)
    server = lh.server(min_replicas=2, http_port=0)
    status = f"{server.dashboard_address()}/status.json"
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    future = channel.unary_unary(QUORUM).future(_quorum_request(replica_id="ghost"), timeout=60)
    wait_until(
        lambda: [w["replica_id"] for w in get_json(status)["waiting"]] == ["ghost"],
        what="ghost parked",
    )
    channel.close()
    with pytest.raises(grpc.RpcError):
        future.result(TIMEOUT)
    wait_until(lambda: get_json(status)["waiting"] == [], what="ghost withdrawn")
    client = lh.client(server)
    answers = quorum_round(client, ["a", "b"])
    assert member_ids(answers["a"]) == ["a", "b"]


def test_client_side_validation_happens_before_any_call(lh: Lighthouses) -> None:
    client = lh.client(lh.server())
    with pytest.raises(ValueError):
        client.quorum("", TIMEOUT)
    with pytest.raises(ValueError):
        client.quorum("a", TIMEOUT, step=-1)
    with pytest.raises(TypeError):
        client.quorum("a", TIMEOUT, data={"x": object()})
    with pytest.raises(ValueError):
        client.heartbeat("")


# -- item 5: restarts ---------------------------------------------------------


def test_quorum_in_flight_fails_clearly_when_lighthouse_stops(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=2)
    client = lh.client(server)
    errors: queue.Queue[BaseException] = queue.Queue()

    def ask() -> None:
        try:
            client.quorum("a", timeout=60)
        except BaseException as exc:
            errors.put(exc)

    thread = threading.Thread(target=ask, name="test-quorum")
    thread.start()
    time.sleep(0.3)
    server.shutdown()
    thread.join(TIMEOUT)
    error = errors.get(timeout=1)
    assert isinstance(error, CoordinationError) and not isinstance(error, TimeoutError)
    assert "shutting down" in str(error)


def test_client_reconnects_with_backoff_after_restart(lh: Lighthouses) -> None:
    first = lh.server(min_replicas=1)
    port = first.port
    client = lh.client(first, connect_timeout=15)
    assert client.quorum("a", TIMEOUT).quorum_id == 1
    first.shutdown()
    with pytest.raises(CoordinationTimeoutError, match="reconnecting"):
        client.heartbeat("a", timeout=1.0)

    started = threading.Event()

    def restart_later() -> None:
        time.sleep(0.8)
        lh.server(bind=f"127.0.0.1:{port}", min_replicas=1)
        started.set()

    thread = threading.Thread(target=restart_later, name="test-restart")
    thread.start()
    try:
        # The lighthouse is down when this starts: the call waits, reconnecting
        # with backoff, and succeeds once the new lighthouse serves.
        quorum = client.quorum("a", TIMEOUT)
    finally:
        thread.join()
    assert started.is_set()
    assert member_ids(quorum) == ["a"] and quorum.quorum_id == 1


def test_reconnect_gives_up_after_connect_timeout(lh: Lighthouses) -> None:
    server = lh.server()
    client = lh.client(server, connect_timeout=0.5)
    server.shutdown()
    with hold_port(server.port):
        with pytest.raises(CoordinationError):
            client.heartbeat("a", timeout=1.0)
        with pytest.raises(CoordinationError, match="failed to connect"):
            client.heartbeat("a", timeout=5.0)


def test_connect_fails_when_nothing_listens() -> None:
    with hold_port() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(CoordinationError, match="failed to connect"):
            LighthouseClient(f"http://127.0.0.1:{port}", timedelta(milliseconds=300))


def test_deadline_maps_to_timeout_error(lh: Lighthouses) -> None:
    client = lh.client(lh.server(min_replicas=2))
    with pytest.raises(CoordinationTimeoutError) as info:
        client.quorum("a", timedelta(milliseconds=300))
    assert isinstance(info.value, TimeoutError)
    assert "DEADLINE_EXCEEDED" in str(info.value)


def test_bind_conflict_raises(lh: Lighthouses) -> None:
    server = lh.server()
    with pytest.raises(OSError):
        lh.server(bind=f"127.0.0.1:{server.port}")


# -- item 3: failure news ------------------------------------------------------


def _collect(stream: object, into: queue.Queue[object]) -> None:
    try:
        for event in stream:  # type: ignore[attr-defined]
            into.put(event)
    except BaseException as exc:
        into.put(exc)
    into.put("end")


def test_failure_news_reaches_survivors_without_a_quorum_call(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=60_000)
    client = lh.client(server)
    events: queue.Queue[object] = queue.Queue()
    stream = client.subscribe("a")
    reader = threading.Thread(target=_collect, args=(stream, events), name="test-news")
    reader.start()
    try:
        first = events.get(timeout=TIMEOUT)
        assert isinstance(first, LighthouseEvent) and first.kind == "subscribed"
        quorum_round(client, ["a", "b"])
        formed = events.get(timeout=TIMEOUT)
        assert isinstance(formed, LighthouseEvent)
        assert (formed.kind, formed.quorum_id, formed.replica_ids) == (
            "quorum_formed",
            1,
            ("a", "b"),
        )

        beats = Heartbeater(client, ["a"])  # b dies: no heartbeat, no quorum call
        try:
            failed = events.get(timeout=TIMEOUT)
        finally:
            beats.stop()
        assert isinstance(failed, LighthouseEvent)
        assert (failed.kind, failed.replica_id, failed.quorum_id) == ("member_failed", "b", 1)
        assert "no heartbeat" in failed.reason
    finally:
        stream.close()
        reader.join(TIMEOUT)
    assert events.get(timeout=1) == "end"


def test_event_stream_ends_with_error_when_lighthouse_stops(lh: Lighthouses) -> None:
    server = lh.server()
    client = lh.client(server)
    events: queue.Queue[object] = queue.Queue()
    stream = client.subscribe()
    reader = threading.Thread(target=_collect, args=(stream, events), name="test-news")
    reader.start()
    try:
        assert isinstance(events.get(timeout=TIMEOUT), LighthouseEvent)
        server.shutdown()
        error = events.get(timeout=TIMEOUT)
        assert isinstance(error, CoordinationError)
        assert "shutting down" in str(error)
    finally:
        stream.close()
        reader.join(TIMEOUT)
