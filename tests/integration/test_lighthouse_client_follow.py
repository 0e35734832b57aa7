"""``LighthouseClient`` given several replicas follows the leader.

The replicated lighthouse is played here by real :class:`LighthouseServer`
instances as leaders and a test-only follower: a plain ``grpc.server`` that
answers every call as a replica that is not the leader does (the wire
protocol of :mod:`ftdist._rpc.common`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from functools import partial
from typing import Any

import grpc
import pytest

from ftdist._rpc import common as _rpc
from ftdist.errors import CoordinationError, CoordinationTimeoutError
from ftdist.lighthouse.client import LighthouseClient
from ftdist.manager.news import FailureNews
from tests.integration.lighthouse_helpers import Lighthouses, hold_port, member_ids, wait_until

pytestmark = pytest.mark.timeout(60)

LOGGER = "ftdist.lighthouse.client"


class Follower:
    """A replica that is not the leader: every call is refused, naming :attr:`leader`."""

    def __init__(self, leader: str = "") -> None:
        self.leader = leader  # "" while no leader is known (an election)
        # (method, its follow-leader metadata) of every call refused
        self.calls: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(4, thread_name_prefix="test-follower")
        self._server = grpc.server(self._pool)
        for service, methods in (
            (_rpc.LIGHTHOUSE_SERVICE, {"Quorum": False, "Heartbeat": False}),
            (_rpc.EVENTS_SERVICE, {"Subscribe": True, "Status": False, "Leave": False}),
        ):
            handlers = {
                name: (
                    grpc.unary_stream_rpc_method_handler(partial(self._refuse_stream, name))
                    if streams
                    else grpc.unary_unary_rpc_method_handler(partial(self._refuse, name))
                )
                for name, streams in methods.items()
            }
            self._server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service, handlers),)
            )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, method: str) -> int:
        with self._lock:
            return sum(1 for m, _ in self.calls if m == method)

    def _refuse(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        metadata = dict(context.invocation_metadata())
        with self._lock:
            self.calls.append((method, metadata.get(_rpc.FOLLOW_LEADER_METADATA)))
        context.set_trailing_metadata(((_rpc.LEADER_METADATA, self.leader),))
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{_rpc.NOT_LEADER_PREFIX}; the leader is {self.leader or 'being elected'}",
        )
        raise AssertionError("abort returns only by raising")

    def _refuse_stream(
        self, method: str, request: bytes, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        self._refuse(method, request, context)
        yield b""  # never reached: a generator, as a stream handler is

    def stop(self) -> None:
        self._server.stop(None).wait()
        self._pool.shutdown(wait=True)


@pytest.fixture
def followers() -> Iterator[list[Follower]]:
    """Start followers with ``followers.append(Follower(...))``; all stopped after the test."""
    started: list[Follower] = []
    try:
        yield started
    finally:
        for follower in started:
            follower.stop()


@pytest.fixture
def clients() -> Iterator[list[LighthouseClient]]:
    """Clients to close after the test (before the servers stop)."""
    made: list[LighthouseClient] = []
    try:
        yield made
    finally:
        for client in made:
            client.close()


def _follower(followers: list[Follower], leader: str = "") -> Follower:
    follower = Follower(leader)
    followers.append(follower)
    return follower


def _client(clients: list[LighthouseClient], *addresses: str, **kwargs: Any) -> LighthouseClient:
    kwargs.setdefault("connect_timeout", 10.0)
    client = LighthouseClient(",".join(addresses), **kwargs)
    clients.append(client)
    return client


def _waiting(lighthouse: str, replica_id: str) -> bool:
    with LighthouseClient(lighthouse, 10.0) as client:
        return any(w["replica_id"] == replica_id for w in client.status().get("waiting", []))


def test_client_given_a_follower_and_the_leader_reaches_the_leader(
    lh: Lighthouses, followers: list[Follower], clients: list[LighthouseClient]
) -> None:
    leader = lh.server(min_replicas=1)
    follower = _follower(followers, leader.address())
    client = _client(clients, follower.address(), leader.address())
    assert member_ids(client.quorum("r1", timeout=10)) == ["r1"]
    assert client.status()["quorum_id"] >= 1
    # The follower was asked once at most: the client stays with the leader.
    assert len(follower.calls) <= 1
    assert all(follow == "1" for _, follow in follower.calls)


def test_every_call_follows_the_leader_named(
    lh: Lighthouses,
    followers: list[Follower],
    clients: list[LighthouseClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    leader = lh.server(min_replicas=1)
    # Only followers listed: the leader is reached under the name they give.
    first, second = _follower(followers, leader.address()), _follower(followers, leader.address())
    client = _client(clients, first.address(), second.address())

    # The stream opens at a follower and follows the leader before its
    # first event.
    with client.subscribe("r1", "test:1") as stream:
        assert next(stream).kind == "subscribed"
    assert first.count("Subscribe") + second.count("Subscribe") == 1
    moves = [r.getMessage() for r in caplog.records if "moving from replica" in r.getMessage()]
    assert moves and leader.address() in moves[0] and "not the leader" in moves[0]

    quorum = client.quorum("r1", timeout=10)
    assert member_ids(quorum) == ["r1"]
    client.heartbeat("r1")
    assert client.status()["quorum_id"] == quorum.quorum_id
    client.renew_connection()
    client.heartbeat("r1")
    assert client.leave("r1") is True
    # Once moved, the client stays with the leader.
    calls = first.calls + second.calls
    assert len(calls) == 1
    assert calls[0][1] == "1"  # the follow-leader metadata


def test_one_address_does_not_follow(followers: list[Follower], lh: Lighthouses) -> None:
    leader = lh.server(min_replicas=1)
    follower = _follower(followers, leader.address())
    with LighthouseClient(follower.address(), 10.0) as client:
        with pytest.raises(CoordinationError, match="FAILED_PRECONDITION: not the leader"):
            client.quorum("r1", timeout=10)
    assert follower.calls == [("Quorum", None)]


def test_quorum_in_flight_at_a_leader_that_stops_is_answered_by_the_next(
    lh: Lighthouses,
    followers: list[Follower],
    clients: list[LighthouseClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    # The first leader never forms a quorum of one: the request stays parked.
    first = lh.server(min_replicas=2)
    second = lh.server(min_replicas=1)
    follower = _follower(followers, first.address())
    client = _client(clients, first.address(), follower.address())
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            result["quorum"] = client.quorum("r1", timeout=30)
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=ask, name="test-quorum")
    thread.start()
    try:
        wait_until(lambda: _waiting(first.address(), "r1"), what="r1 parked at the first")
        # The second is elected (not listed: named by the follower).
        follower.leader = second.address()
        first.shutdown()
    finally:
        thread.join(40)
    assert "error" not in result, result
    assert member_ids(result["quorum"]) == ["r1"]
    assert any(second.address() in r.getMessage() for r in caplog.records)


def test_heartbeats_go_on_across_the_switch(
    lh: Lighthouses, followers: list[Follower], clients: list[LighthouseClient]
) -> None:
    first = lh.server(min_replicas=1)
    second = lh.server(min_replicas=1)
    follower = _follower(followers, first.address())
    client = _client(clients, follower.address(), first.address())
    errors: list[Exception] = []
    beats = [0]
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                client.heartbeat("r1", timeout=5)
                beats[0] += 1
            except Exception as exc:
                errors.append(exc)
            stop.wait(0.02)

    def heartbeating(lighthouse: str) -> bool:
        with LighthouseClient(lighthouse, 10.0) as probe:
            return bool(probe.status()["num_heartbeating"])

    thread = threading.Thread(target=beat, name="test-heartbeat")
    thread.start()
    elected = threading.Timer(0.3, lambda: setattr(follower, "leader", second.address()))
    try:
        wait_until(lambda: heartbeating(first.address()), what="heartbeats at the first")
        # The leader stops; an election names the second (not listed) a bit later.
        follower.leader = ""
        first.shutdown()
        elected.start()
        before = beats[0]
        wait_until(lambda: heartbeating(second.address()), what="heartbeats at the second")
        wait_until(lambda: beats[0] > before + 5, what="more heartbeats")
    finally:
        elected.cancel()
        if elected.is_alive():
            elected.join()
        stop.set()
        thread.join(10)
    assert errors == []


def test_no_leader_named_waits_for_the_election(
    lh: Lighthouses, followers: list[Follower], clients: list[LighthouseClient]
) -> None:
    leader = lh.server(min_replicas=1)
    first, second = _follower(followers), _follower(followers)
    # The leader is not listed: a replica reached under a name of its own.
    client = _client(clients, first.address(), second.address())
    elected = threading.Timer(0.8, lambda: setattr(second, "leader", leader.address()))
    elected.start()
    began = time.monotonic()
    try:
        quorum = client.quorum("r1", timeout=20)
    finally:
        elected.cancel()
        elected.join()
    assert member_ids(quorum) == ["r1"]
    assert time.monotonic() - began >= 0.7
    # Waited out with pauses, not a busy loop: 50 ms growing to 500 ms.
    asked = first.count("Quorum") + second.count("Quorum")
    assert 2 <= asked <= 20, asked


def test_timeout_holds_while_no_leader_is_named(
    followers: list[Follower], clients: list[LighthouseClient]
) -> None:
    first, second = _follower(followers), _follower(followers)
    client = _client(clients, first.address(), second.address())
    began = time.monotonic()
    with pytest.raises(CoordinationTimeoutError, match="Timeout expired"):
        client.quorum("r1", timeout=1.0)
    assert 0.9 <= time.monotonic() - began < 2.0
    began = time.monotonic()
    with pytest.raises(CoordinationTimeoutError):
        client.heartbeat("r1", timeout=0.3)
    assert time.monotonic() - began < 1.3


def test_timeout_holds_when_every_replica_is_gone(
    followers: list[Follower], clients: list[LighthouseClient]
) -> None:
    first, second = _follower(followers), _follower(followers)
    patient = _client(clients, first.address(), second.address(), connect_timeout=30)
    hasty = _client(clients, first.address(), second.address(), connect_timeout=1.0)
    with contextlib.ExitStack() as held:
        for follower in (first, second):
            follower.stop()
            held.enter_context(hold_port(follower.port))  # no other test's server takes it
        followers.clear()
        began = time.monotonic()
        with pytest.raises(CoordinationTimeoutError):
            patient.quorum("r1", timeout=1.0)
        assert time.monotonic() - began < 2.0
        # connect_timeout shorter than the call's: the call gives up after it.
        began = time.monotonic()
        with pytest.raises(CoordinationError, match="no replica reachable"):
            hasty.quorum("r1", timeout=30)
        assert time.monotonic() - began < 2.5
        began = time.monotonic()
        a, b = (held.enter_context(hold_port()).getsockname()[1] for _ in range(2))
        with pytest.raises(CoordinationError, match="any lighthouse replica"):
            LighthouseClient(f"http://127.0.0.1:{a},http://127.0.0.1:{b}", 0.5)
        assert time.monotonic() - began < 1.5


def test_stream_broken_by_a_failover_reopens_at_the_new_leader(
    lh: Lighthouses, followers: list[Follower], clients: list[LighthouseClient]
) -> None:
    first = lh.server(min_replicas=1)
    second = lh.server(min_replicas=1)
    follower = _follower(followers, first.address())
    client = _client(clients, first.address(), follower.address())
    stream = client.subscribe("r1", "test:1")
    try:
        assert next(stream).kind == "subscribed"
        follower.leader = second.address()
        first.shutdown()
        with pytest.raises(CoordinationError):
            next(stream)
    finally:
        stream.close()
    # The client moved when the stream broke; the follower names the second.
    with client.subscribe("r1", "test:1") as again:
        assert next(again).kind == "subscribed"
    with LighthouseClient(second.address(), 10.0) as probe:
        wait_until(lambda: probe.status()["num_subscribers"] == 0, what="stream closed")


def test_failure_news_follows_a_failover(lh: Lighthouses, followers: list[Follower]) -> None:
    first = lh.server(min_replicas=1)
    second = lh.server(min_replicas=1)
    follower = _follower(followers, first.address())

    def subscribers(lighthouse: str) -> int:
        with LighthouseClient(lighthouse, 10.0) as probe:
            return int(probe.status()["num_subscribers"])

    # The Manager's news thread opens a new client for each stream.
    addresses = f"{follower.address()},{first.address()}"
    news = FailureNews(addresses, "r1", lambda rid, why: None, connect_timeout=5.0)
    try:
        wait_until(lambda: subscribers(first.address()) == 1, what="news at the first")
        follower.leader = second.address()
        first.shutdown()
        wait_until(lambda: subscribers(second.address()) == 1, what="news at the second")
    finally:
        news.close()
