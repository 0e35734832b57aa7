"""The manager server over real gRPC: aggregation, votes, step checks, errors."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from ftdist.coordination import LighthouseServer
from ftdist.errors import CoordinationError, CoordinationTimeoutError
from ftdist.manager.client import ManagerClient
from ftdist.manager.server import ManagerServer
from tests.integration.lighthouse_helpers import Lighthouses

T = timedelta(seconds=5)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lighthouse(lh: Lighthouses) -> LighthouseServer:
    return lh.server(join_timeout_ms=100)


# Every test that takes this fixture runs on both of the server's gRPC servers.
@pytest.fixture(params=["h2", "grpcio"])
def server(lighthouse: LighthouseServer, request: pytest.FixtureRequest) -> Iterator[ManagerServer]:
    manager = _manager(lighthouse, "127.0.0.1:0", request.param)
    yield manager
    manager.shutdown()


def _manager(
    lighthouse: LighthouseServer, bind: str, rpc_server: str | None, world_size: int = 2
) -> ManagerServer:
    return ManagerServer(
        "rep:uuid",
        lighthouse.address(),
        "127.0.0.1",
        bind,
        "127.0.0.1:1234",
        world_size=world_size,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
        rpc_server=rpc_server,
    )


def _in_threads(*calls: Any) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(i: int, fn: Any) -> None:
        try:
            results[i] = fn()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_one_lighthouse_round_answers_every_group_rank(server: ManagerServer) -> None:
    with ManagerClient(server.address(), T) as c:
        r0, r1 = _in_threads(
            lambda: c.quorum(0, 3, "meta0", False, True, 0, T),
            lambda: c.quorum(1, 3, "meta1", False, True, 0, T),
        )
        assert r0.replica_ids == r1.replica_ids == ["rep:uuid"]
        assert (r0.max_step, r0.replica_world_size, r0.heal) == (3, 1, False)
        assert r0.store_address == "127.0.0.1:1234"
        assert r0.created_ns > 0
        assert c.checkpoint_metadata(1, T) == "meta1"
        with pytest.raises(CoordinationError, match="rank not found"):
            c.checkpoint_metadata(5, T)


def test_group_ranks_at_different_steps_report_the_oldest(server: ManagerServer) -> None:
    # A heal that reached only some ranks: the group is as old as its oldest
    # rank (and asks to heal; alone in its quorum, there is nobody to heal from).
    with ManagerClient(server.address(), T) as c:
        results = _in_threads(
            lambda: c.quorum(0, 3, "", False, True, 0, T),
            lambda: c.quorum(1, 4, "", False, True, 0, T),
        )
    for r in results:
        assert not isinstance(r, Exception), r
        assert r.max_step == 3 and not r.heal


def test_should_commit_is_an_and_of_every_rank_on_the_same_step(server: ManagerServer) -> None:
    with ManagerClient(server.address(), T) as c:
        assert _in_threads(
            lambda: c.should_commit(0, 1, True, T), lambda: c.should_commit(1, 1, True, T)
        ) == [True, True]
        assert _in_threads(
            lambda: c.should_commit(0, 2, True, T), lambda: c.should_commit(1, 2, False, T)
        ) == [False, False]
        # Votes on different steps never commit.
        assert _in_threads(
            lambda: c.should_commit(0, 3, True, T), lambda: c.should_commit(1, 4, True, T)
        ) == [False, False]
        # A rank left alone times out instead of hanging.
        with pytest.raises(CoordinationTimeoutError):
            c.should_commit(0, 5, True, timedelta(milliseconds=300))


def test_bad_requests_get_clear_errors(server: ManagerServer) -> None:
    with ManagerClient(server.address(), T) as c:
        with pytest.raises(CoordinationError, match="group_rank 7 is outside"):
            c.quorum(7, 0, "", False, True, 0, T)
        with pytest.raises(CoordinationError, match="step -1 is negative"):
            c.quorum(0, -1, "", False, True, 0, T)
        with pytest.raises(CoordinationError, match="group_rank -2 is outside"):
            c.should_commit(-2, 0, True, T)


def test_a_failed_lighthouse_call_reaches_every_waiting_rank_at_once(
    lighthouse: LighthouseServer,
) -> None:
    # min_replicas=1 but a second, heartbeating replica never asks: the
    # split-brain guard holds the quorum, so the lighthouse call times out.
    # Both group ranks must get that error when it happens, not later.
    server = ManagerServer(
        "solo:uuid",
        lighthouse.address(),
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:1",
        world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    other = ManagerServer(
        "other:uuid",
        lighthouse.address(),
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:2",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    try:
        time.sleep(0.5)  # let "other" heartbeat: the lighthouse now counts it healthy
        with ManagerClient(server.address(), T) as c:
            results = _in_threads(
                lambda: c.quorum(0, 0, "", False, True, 0, timedelta(seconds=1)),
                lambda: c.quorum(1, 0, "", False, True, 0, timedelta(seconds=20)),
            )
        # Both fail, with the lighthouse's error, by the earliest deadline.
        for r in results:
            assert isinstance(r, (CoordinationError, CoordinationTimeoutError)), r
        assert "lighthouse quorum failed" in str(results[1]), results[1]
    finally:
        other.shutdown()
        server.shutdown()


def _serve_until_killed(ctx: Any, lighthouse: str) -> None:
    server = ManagerServer(
        "victim:uuid",
        lighthouse,
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    ctx.store().set("addr", server.address())
    time.sleep(60)


def test_kill_exits_the_server_process(lighthouse: LighthouseServer) -> None:
    from ftdist.launch.ranks import Ranks

    with Ranks(_serve_until_killed, 1, args=(lighthouse.address(),)) as ranks:
        from ftdist.launch.ranks import RankContext

        store = RankContext(0, 1, "127.0.0.1", ranks.store_port, ranks._prefix).store()
        address = store.get("addr").decode()
        with ManagerClient(address, T) as c:
            c.kill("killed by the test")
        outcome = ranks.join(timeout=20)[0]
    assert outcome.exitcode == 1


def test_the_in_process_client_answers_like_the_network_one(server: ManagerServer) -> None:
    # Group rank 0 hosts the server and calls it without the network: same
    # rounds (mixed with a remote rank), same answers, same errors.
    local = server.local_client()
    with ManagerClient(server.address(), T) as remote:
        r0, r1 = _in_threads(
            lambda: local.quorum(0, 2, "meta0", False, True, 0, T),
            lambda: remote.quorum(1, 2, "meta1", False, True, 0, T),
        )
        assert (r0.replica_ids, r0.max_step) == (r1.replica_ids, r1.max_step) == (["rep:uuid"], 2)
        assert local.checkpoint_metadata(1, T) == "meta1"
        assert _in_threads(
            lambda: local.should_commit(0, 2, True, T), lambda: remote.should_commit(1, 2, True, T)
        ) == [True, True]
    with pytest.raises(CoordinationError, match="group_rank 7 is outside"):
        local.quorum(7, 0, "", False, True, 0, T)
    with pytest.raises(CoordinationTimeoutError, match="commit vote incomplete"):
        local.should_commit(0, 3, True, timedelta(milliseconds=200))
    local.close()


def test_torchft_spellings_of_both_generations(server: ManagerServer) -> None:
    with ManagerClient(server.address(), T) as c:
        seed, today = _in_threads(
            # torchft early 2025: (rank, step, checkpoint_metadata, shrink_only, timeout)
            lambda: c._quorum(
                rank=0, step=4, checkpoint_metadata="m0", shrink_only=False, timeout=T
            ),
            # today: (..., timeout, commit_failures, reconfigure_handle, init_sync)
            lambda: c._quorum(1, 4, "m1", False, T, 0, "", True),
        )
        assert seed.max_step == today.max_step == 4
        assert seed.max_rank == seed.max_replica_rank == 0
        assert today.recover_dst_ranks == today.recover_dst_replica_ranks == []
        assert _in_threads(
            lambda: c.should_commit(rank=0, step=4, should_commit=True, timeout=T),
            lambda: c.should_commit(1, 4, True, timeout=T),
        ) == [True, True]
        with pytest.raises(TypeError, match="give the group rank once"):
            c._quorum(0, 4, "", False, T, rank=0)


@pytest.mark.parametrize("rpc_client", ["h2", "grpcio"])
def test_both_client_transports_serve_rounds_and_votes(
    server: ManagerServer, rpc_client: str
) -> None:
    # h2 (the default) sends each call's timeout: without it the server
    # refuses the call (next test), so these rounds show that it arrives.
    with ManagerClient(server.address(), T, rpc_client=rpc_client) as c:
        for step in (1, 2):
            r0, r1 = _in_threads(
                lambda s=step: c.quorum(0, s, "m0", False, True, 0, T),
                lambda s=step: c.quorum(1, s, "m1", False, True, 0, T),
            )
            assert r0.quorum_id == r1.quorum_id and r0.max_step == r1.max_step == step
            assert (
                _in_threads(
                    lambda s=step: c.should_commit(0, s, True, T),
                    lambda s=step: c.should_commit(1, s, s == 1, T),
                )
                == [step == 1] * 2
            )
        with pytest.raises(CoordinationError, match="group_rank 7 is outside"):
            c.quorum(7, 0, "", False, True, 0, T)
        with pytest.raises(CoordinationTimeoutError):
            c.should_commit(0, 9, True, timedelta(milliseconds=300))


def test_a_call_without_a_deadline_is_refused_and_the_server_serves_on(
    server: ManagerServer,
) -> None:
    import grpc

    from ftdist._rpc import common as rpc
    from ftdist._rpc._proto import torchft_pb2 as pb
    from ftdist._rpc.h2_client import H2Channel

    vote = pb.ShouldCommitRequest(group_rank=0, step=1, should_commit=True)
    ask = pb.ManagerQuorumRequest(group_rank=0, step=1)
    h2 = H2Channel(rpc.grpc_target(server.address()))  # sends no grpc-timeout
    channel = grpc.insecure_channel(rpc.grpc_target(server.address()))
    try:
        calls: list[tuple[Any, Any]] = []
        for open_call in (h2.unary_unary, channel.unary_unary):
            calls.append(
                (
                    open_call(
                        rpc.MANAGER_SHOULD_COMMIT,
                        pb.ShouldCommitRequest.SerializeToString,
                        pb.ShouldCommitResponse.FromString,
                    ),
                    vote,
                )
            )
            calls.append(
                (
                    open_call(
                        rpc.MANAGER_QUORUM,
                        pb.ManagerQuorumRequest.SerializeToString,
                        pb.ManagerQuorumResponse.FromString,
                    ),
                    ask,
                )
            )
        for call, request in calls:
            # grpcio's server once told these handlers "centuries left", and
            # waiting on that failed as UNKNOWN ("timestamp out of range").
            with pytest.raises(grpc.RpcError) as caught:
                call(request)  # no timeout
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert "missing timeout" in caught.value.details()
    finally:
        h2.close()
        channel.close()
    with ManagerClient(server.address(), T) as c:
        assert _in_threads(
            lambda: c.should_commit(0, 1, True, T), lambda: c.should_commit(1, 1, True, T)
        ) == [True, True]


def test_an_unknown_client_transport_is_refused_before_connecting() -> None:
    # Nothing listens there: a check made after the connect wait would end
    # in CoordinationError ("unreachable"), not this ValueError.
    with pytest.raises(ValueError, match=r"rpc_client \('tonic'\).*FTDIST_MANAGER_RPC_CLIENT"):
        ManagerClient("127.0.0.1:1", timedelta(seconds=2), rpc_client="tonic")


def _raw_call(
    port: int, method: str, request: bytes, grpc_timeout: str
) -> tuple[float, dict[str, str]]:
    """One call over hand-written HTTP/2 that sends ``grpc-timeout`` but never
    gives up on its own (unlike every gRPC client): the seconds until the
    server ended it, and the fields of its last header block."""
    from tests.integration import h2_wire as w

    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        headers = w.request_headers(port, method) + w.literal("grpc-timeout", grpc_timeout)
        body = b"\0" + len(request).to_bytes(4, "big") + request
        sock.sendall(
            w.PREFACE
            + w.frame(w.SETTINGS, 0, 0)
            + w.frame(w.HEADERS, w.END_HEADERS, 1, headers)
            + w.frame(w.DATA, w.END_STREAM, 1, body)
        )
        start = time.monotonic()
        reader = w.Reader(sock)
        while True:
            kind, flags, stream, payload = reader.frame()
            if kind == w.HEADERS and stream == 1 and flags & w.END_STREAM:
                return time.monotonic() - start, _literal_fields(payload)


def _literal_fields(block: bytes) -> dict[str, str]:
    """The fields of a header block of literals with new names, no Huffman
    coding and lengths below 127: what this server's error trailers are."""
    fields: dict[str, str] = {}
    at = 0
    while at < len(block):
        assert block[at] == 0, f"not a plain literal at {at}: {block!r}"
        name_len = block[at + 1]
        name = block[at + 2 : at + 2 + name_len].decode()
        at += 2 + name_len
        value_len = block[at]
        fields[name] = block[at + 1 : at + 1 + value_len].decode()
        at += 1 + value_len
    return fields


def test_a_parked_call_past_its_deadline_is_told_what_the_round_lacks(
    lighthouse: LighthouseServer,
) -> None:
    # A client that never gives up on its own still gets an answer at its
    # deadline (the server checks parked calls every 100 ms), naming what the
    # round lacks, and the server serves on.
    from ftdist._rpc import common as rpc
    from ftdist._rpc._proto import torchft_pb2 as pb

    server = _manager(lighthouse, "127.0.0.1:0", "h2")
    try:
        port = int(server.address().rsplit(":", 1)[1])
        ask = pb.ManagerQuorumRequest(group_rank=1, step=3).SerializeToString()
        waited, fields = _raw_call(port, rpc.MANAGER_QUORUM, ask, "300m")
        assert fields.get("grpc-status") == "4", fields  # DEADLINE_EXCEEDED
        assert "quorum did not complete: 1 of 2 group ranks arrived" in fields["grpc-message"]
        assert waited > 0.25, waited  # not before its deadline
        vote = pb.ShouldCommitRequest(group_rank=1, step=3, should_commit=True)
        _, fields = _raw_call(port, rpc.MANAGER_SHOULD_COMMIT, vote.SerializeToString(), "200m")
        assert "commit vote incomplete: 1 of 2 group ranks voted" in fields["grpc-message"]
        with ManagerClient(server.address(), T) as c:
            assert c.checkpoint_metadata(1, T) == ""
            # The expired vote still counts, as a vote that timed out always
            # did: this round completes with rank 0's.
            assert c.should_commit(0, 3, True, T) is True
    finally:
        server.shutdown()


def test_shutdown_answers_every_parked_call_at_once(server: ManagerServer) -> None:
    with ManagerClient(server.address(), T) as c:
        results: list[Any] = []
        waiter = threading.Thread(
            target=lambda: results.extend(_in_threads(lambda: c.should_commit(1, 5, True, T)))
        )
        waiter.start()
        end = time.monotonic() + 10
        while not server._commit_round.arrivals and time.monotonic() < end:
            time.sleep(0.01)  # until the vote is parked at the server
        server.shutdown()
        waiter.join(timeout=20)
        # The server's answer, not the client's own deadline (a timeout error).
        assert len(results) == 1 and isinstance(results[0], CoordinationError), results
        assert not isinstance(results[0], CoordinationTimeoutError), results[0]
        assert "shutting down" in str(results[0]), results[0]
    # Group rank 0's own calls after the shutdown are refused, never parked.
    local = server.local_client()
    with pytest.raises(CoordinationError, match="shutting down"):
        local.should_commit(0, 5, True, T)
    with pytest.raises(CoordinationError, match="shutting down"):
        local.quorum(0, 5, "", False, True, 0, T)


def test_an_unknown_server_kind_or_a_taken_port_is_refused_clearly(
    lighthouse: LighthouseServer,
) -> None:
    def make(bind: str, rpc_server: str | None) -> ManagerServer:
        return _manager(lighthouse, bind, rpc_server, world_size=1)

    with pytest.raises(ValueError, match=r"rpc_server \('tonic'\).*FTDIST_MANAGER_RPC_SERVER"):
        make("127.0.0.1:0", "tonic")
    # A bind that fails past the lighthouse connection leaves no heartbeat behind.
    with pytest.raises(ValueError):
        make("127.0.0.1", "h2")  # no port
    deadline = time.monotonic() + 10
    while any(t.name == "ftdist-mgr-heartbeat" for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)
    first = make("127.0.0.1:0", None)
    try:
        taken = first.address().rsplit(":", 1)[1]
        for kind in ("h2", "grpcio"):
            with pytest.raises(
                OSError, match=f"cannot bind the manager server to 127.0.0.1:{taken}"
            ):
                make(f"127.0.0.1:{taken}", kind)
    finally:
        first.shutdown()
