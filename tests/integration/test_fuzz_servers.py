"""Fuzzing the coordination servers over real sockets, for a bounded count.

Each test throws random and mutated messages at one server (valid messages
with their bytes flipped, cut or stretched, random bytes, oversized fields,
wrong methods, wrong tokens, garbage on the raw port, truncated streams),
checks that every answer is a proper refusal and never a crash, then checks
that the server still answers well-formed clients correctly. Seeds are fixed,
so a failure replays.
"""

from __future__ import annotations

import random
import socket
import struct
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
import pytest

from ftdist._rpc import common as _rpc
from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist.lighthouse.client import LighthouseClient
from ftdist.manager.client import ManagerClient
from ftdist.manager.server import ManagerServer
from tests.integration.lighthouse_helpers import (
    TIMEOUT,
    Heartbeater,
    Lighthouses,
    get_json,
    member_ids,
    pool,
    quorum_round,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)

TOKEN = "fuzz-token"
GOOD = (("authorization", f"Bearer {TOKEN}"),)
T = timedelta(seconds=10)
# What a server may answer a bad request with. INTERNAL and UNKNOWN mean a
# handler crashed, and are failures (but see the manager server's decoder).
REFUSALS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
}


# -- generators ------------------------------------------------------------------------


def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.5:
        return rng.choice(["a", "b", "r0", "replica_1", "", "x:y"])
    if kind < 0.8:
        return "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(1, 40)))
    return "z" * rng.choice([4096, 4097, 20000, 70000])


def _int(rng: random.Random) -> int:
    return rng.choice([0, 1, -1, 7, 2**31 - 1, -(2**31), 2**62, rng.randrange(-1000, 1000)])


def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        if op == 0 and out:  # flip bits
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert random bytes
            i = rng.randrange(len(out) + 1)
            out[i:i] = rng.randbytes(rng.randrange(1, 16))
        elif op == 2 and out:  # cut
            out = out[: rng.randrange(len(out))]
        elif op == 3 and out:  # duplicate a chunk
            i = rng.randrange(len(out))
            out[i:i] = out[i : i + rng.randrange(1, 32)]
        else:  # a field with a huge declared length
            out += bytes([0x0A]) + b"\xff\xff\xff\xff\x0f"
    return bytes(out)


def _lighthouse_message(rng: random.Random) -> tuple[str, bytes]:
    method = rng.choice(
        [
            _rpc.LIGHTHOUSE_QUORUM,
            _rpc.LIGHTHOUSE_HEARTBEAT,
            _rpc.EVENTS_SUBSCRIBE,
            _rpc.EVENTS_STATUS,
        ]
    )
    member = torchft_pb2.QuorumMember(
        replica_id=_text(rng),
        address=_text(rng),
        store_address=_text(rng),
        step=_int(rng),
        world_size=abs(_int(rng)),
        shrink_only=rng.random() < 0.3,
        data=rng.choice(["", '{"k": 1}', "not json", "d" * 70000]),
        commit_failures=_int(rng),
        reconfigure_handles=[_text(rng) for _ in range(rng.randrange(3))],
    )
    if rng.random() < 0.5:  # a plausible request, so that quorums form too
        member = torchft_pb2.QuorumMember(
            replica_id=rng.choice(["a", "b", "c"]), step=rng.randrange(3), world_size=1
        )
    messages: list[Any] = [
        torchft_pb2.LighthouseQuorumRequest(requester=member),
        torchft_pb2.LighthouseHeartbeatRequest(replica_id=_text(rng)),
        ftdist_pb2.SubscribeRequest(replica_id=_text(rng)),
        ftdist_pb2.StatusRequest(),
    ]
    payload = rng.choice(messages).SerializeToString()  # often the wrong message type
    roll = rng.random()
    if roll < 0.4:
        payload = _mutate(rng, payload)
    elif roll < 0.5:
        payload = rng.randbytes(rng.randrange(0, 2000))
    if rng.random() < 0.05:
        method = rng.choice(["/torchft.LighthouseService/Nope", "/x/y", "/" + "m" * 300])
    return method, payload


def _metadata(rng: random.Random, method: str) -> Any:
    roll = rng.random()
    if roll < 0.8:
        return GOOD
    if roll < 0.9:
        return None
    return (
        (
            "authorization",
            rng.choice(["Bearer", "Bearer ", "bearer " + TOKEN, TOKEN, "Bearer " + TOKEN[:-1]]),
        ),
    )


def _call(
    channel: grpc.Channel,
    method: str,
    payload: bytes,
    metadata: Any,
    stream: bool,
    timeout: float = 0.1,
) -> Any:
    try:
        if stream:
            call = channel.unary_stream(method)(payload, timeout=timeout, metadata=metadata)
            try:
                for _ in zip(range(2), call, strict=False):
                    pass
            finally:
                call.cancel()
            return grpc.StatusCode.OK, ""
        channel.unary_unary(method)(payload, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _run_grpc_fuzz(
    port: int,
    count: int,
    seed: int,
    generate: Callable[[random.Random], tuple[str, bytes]],
    metadata: Callable[[random.Random, str], Any],
) -> list[tuple[str, grpc.StatusCode, str]]:
    """Send ``count`` generated calls from 8 threads; return every answer."""
    answers: list[tuple[str, grpc.StatusCode, str]] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:

        def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            for _ in range(count // 8):
                method, payload = generate(rng)
                md = metadata(rng, method)
                code, details = _call(
                    channel, method, payload, md, stream=method == _rpc.EVENTS_SUBSCRIBE
                )
                answers.append((method, code, details))

        with pool(8) as executor:
            for future in [executor.submit(worker, i) for i in range(8)]:
                future.result(60)
    return answers


def _raw_garbage(port: int, seed: int, count: int) -> None:
    """Bytes that are not gRPC, or gRPC cut short, on the raw port."""
    rng = random.Random(seed)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for _ in range(count):
        roll = rng.random()
        if roll < 0.3:
            payload = rng.randbytes(rng.randrange(1, 4000))
        elif roll < 0.6:
            payload = preface[: rng.randrange(len(preface))]
        else:
            # The preface, then frames with random type, flags and lengths.
            payload = preface
            for _ in range(rng.randrange(1, 5)):
                body = rng.randbytes(rng.randrange(0, 64))
                length = rng.choice([len(body), 1 << 20, 0xFFFFFF])
                header = struct.pack(">I", length)[1:] + bytes(
                    [rng.randrange(11), rng.randrange(256)]
                )
                payload += header + struct.pack(">I", rng.randrange(1 << 31)) + body
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            try:
                sock.sendall(payload)
                if rng.random() < 0.5:
                    sock.settimeout(0.05)
                    sock.recv(4096)
            except OSError:
                pass  # the server may close on us: that is its right


def _assert_refusals(answers: list[tuple[str, grpc.StatusCode, str]]) -> None:
    crashes = [a for a in answers if a[1] not in REFUSALS]
    assert not crashes, f"{len(crashes)} calls crashed a handler, e.g. {crashes[:3]}"
    assert {a[1] for a in answers} >= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


# -- the lighthouse ------------------------------------------------------------------


def test_fuzzed_lighthouse_stays_up_and_correct(lh: Lighthouses) -> None:
    # Short heartbeats: the fuzz's replica ids expire quickly afterwards.
    server = lh.server(min_replicas=2, heartbeat_timeout_ms=300, quorum_tick_ms=50, token=TOKEN)
    answers = _run_grpc_fuzz(
        server.port, 480, seed=1, generate=_lighthouse_message, metadata=_metadata
    )
    _assert_refusals(answers)
    assert any(code == grpc.StatusCode.UNAUTHENTICATED for _, code, _ in answers)
    _raw_garbage(server.port, seed=2, count=40)
    # Above gRPC's receive limit.
    big = torchft_pb2.LighthouseHeartbeatRequest(replica_id="b" * (5 << 20))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        code, _ = _call(
            channel, _rpc.LIGHTHOUSE_HEARTBEAT, big.SerializeToString(), GOOD, False, TIMEOUT
        )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED

    with LighthouseClient(server.address(), 10, token=TOKEN) as client:
        # Every fuzzed call has left: nothing parked, no stream open.
        wait_until(
            lambda: (s := client.status())["waiting"] == [] and s["num_subscribers"] == 0,
            what="the fuzzed calls to be withdrawn",
        )
        before = client.status()["quorum_id"]
        beats = Heartbeater(client, ["well", "formed"])  # as managers do
        try:
            answers_ok = quorum_round(client, ["well", "formed"], step=3)
        finally:
            beats.stop()
        for quorum in answers_ok.values():
            assert member_ids(quorum) == ["formed", "well"]
            assert quorum.quorum_id == before + 1
            assert [m.step for m in quorum.participants] == [3, 3]
        stream = client.subscribe("well")
        try:
            event = next(stream)
            assert event.kind == "subscribed" and list(event.replica_ids) == ["formed", "well"]
        finally:
            stream.close()


# -- the manager server --------------------------------------------------------------


def _manager_message(rng: random.Random) -> tuple[str, bytes]:
    method = rng.choice(
        [_rpc.MANAGER_QUORUM, _rpc.MANAGER_SHOULD_COMMIT, _rpc.MANAGER_CHECKPOINT_METADATA]
    )
    messages: list[Any] = [
        torchft_pb2.ManagerQuorumRequest(
            group_rank=rng.choice([0, 0, 1, -1, _int(rng)]),
            step=rng.choice([0, 5, -3, _int(rng)]),
            checkpoint_metadata=_text(rng),
            shrink_only=rng.random() < 0.2,
            init_sync=rng.random() < 0.5,
            commit_failures=rng.choice([0, 1, _int(rng)]),
            fingerprint=rng.choice(["", '{"0": {"m": 1}}', "[1]", "{", "[" * 5000, "{}"]),
        ),
        torchft_pb2.ShouldCommitRequest(
            group_rank=rng.choice([0, 1, _int(rng)]),
            step=_int(rng),
            should_commit=rng.random() < 0.5,
        ),
        torchft_pb2.CheckpointMetadataRequest(rank=rng.choice([0, 1, _int(rng)])),
    ]
    payload = rng.choice(messages).SerializeToString()
    roll = rng.random()
    if roll < 0.4:
        payload = _mutate(rng, payload)
    elif roll < 0.5:
        payload = rng.randbytes(rng.randrange(0, 500))
    if rng.random() < 0.1:
        method = _rpc.MANAGER_KILL  # without the token (see _manager_metadata)
    elif rng.random() < 0.03:
        method = "/torchft.ManagerService/Nope"
    return method, payload


def _manager_metadata(rng: random.Random, method: str) -> Any:
    if method == _rpc.MANAGER_KILL:
        # Never the token: a Kill that went through would end this very
        # process (which would fail the run loudly).
        return rng.choice([None, (("authorization", "Bearer not-it"),)])
    return _metadata(rng, method)


def test_fuzzed_manager_server_stays_up_and_correct(lh: Lighthouses) -> None:
    lighthouse = lh.server(min_replicas=1, token=TOKEN)
    server = ManagerServer(
        "rep:uuid",
        lighthouse.address(),
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
        token=TOKEN,
    )
    try:
        port = int(server.address().rsplit(":", 1)[1])

        answers = _run_grpc_fuzz(
            port, 320, seed=3, generate=_manager_message, metadata=_manager_metadata
        )
        kills = [code for method, code, _ in answers if method == _rpc.MANAGER_KILL]
        # This process is alive, and every Kill without the token was refused.
        assert kills and set(kills) == {grpc.StatusCode.UNAUTHENTICATED}, kills
        # Bytes that are not the method's message are INVALID_ARGUMENT too:
        # the server decodes them itself (grpcio's thread-pool server said INTERNAL).
        _assert_refusals(answers)
        _raw_garbage(port, seed=4, count=30)

        with ManagerClient(server.address(), T, token=TOKEN) as client:
            result = client.quorum(0, 11, "where", False, False, 0, T)
            assert result.replica_ids == ["rep:uuid"] and result.max_step == 11
            assert result.replica_rank == 0 and not result.heal
            assert client.checkpoint_metadata(0, T) == "where"
            assert client.should_commit(0, 11, True, T) is True
            assert client.should_commit(0, 11, False, T) is False
    finally:
        server.shutdown()


# -- the dashboard -------------------------------------------------------------------


def _http_request(rng: random.Random) -> bytes:
    method = rng.choice([b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"G\x00T", b""])
    path = rng.choice(
        [
            b"/",
            b"/status.json",
            b"/metrics",
            b"/replica/a/kill",
            b"/replica/%ff%00/kill",
            b"/replica//kill",
            b"/" + rng.randbytes(rng.randrange(1, 40)).replace(b"\n", b"").replace(b" ", b""),
            b"/" + b"p" * rng.choice([100, 20000]),
        ]
    )
    version = rng.choice([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b""])
    headers = [b"Host: fuzz"]
    if rng.random() < 0.5:
        headers.append(
            b"Content-Length: "
            + rng.choice([b"0", b"5", b"-1", b"abc", b"1e3", b"70000", b"\xb2", b"9" * 30])
        )
    if rng.random() < 0.3:
        headers.append(b"Authorization: " + rng.choice([b"Bearer " + TOKEN.encode(), b"x"]))
    if rng.random() < 0.1:
        headers.append(b"Transfer-Encoding: chunked")
    if rng.random() < 0.1:
        headers.append(b"X-Big: " + b"b" * 20000)
    if rng.random() < 0.1:
        headers.append(rng.randbytes(rng.randrange(1, 200)).replace(b"\n", b""))
    head = method + b" " + path + (b" " + version if version else b"") + b"\r\n"
    request = head + b"\r\n".join(headers) + b"\r\n\r\n" + rng.randbytes(rng.randrange(0, 10))
    roll = rng.random()
    if roll < 0.2:
        request = _mutate(rng, request)
    elif roll < 0.3:
        request = request[: rng.randrange(len(request))]  # truncated
    elif roll < 0.35:
        request = rng.randbytes(rng.randrange(1, 3000))
    elif roll < 0.45:
        request = request + b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n"  # pipelined
    return request


def _http_exchange(port: int, request: bytes, rng: random.Random) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        try:
            sock.sendall(request)
            if rng.random() < 0.2:
                return b""  # hang up without reading
            sock.settimeout(0.3)
            return sock.recv(4096)
        except OSError:
            return b""


def test_fuzzed_dashboard_stays_up_and_correct(lh: Lighthouses) -> None:
    server = lh.server(min_replicas=1, http_port=0, token=TOKEN)
    address = server.dashboard_address()
    assert address is not None
    port = int(address.rsplit(":", 1)[1])
    replies: list[bytes] = []

    def worker(index: int) -> None:
        rng = random.Random(5000 + index)
        for _ in range(40):
            replies.append(_http_exchange(port, _http_request(rng), rng))

    with pool(8) as executor:
        for future in [executor.submit(worker, i) for i in range(8)]:
            future.result(60)
    answered = [r for r in replies if r]
    assert len(answered) > len(replies) // 3
    for reply in answered:
        assert reply.startswith(b"HTTP/1."), reply[:100]
        code = int(reply[9:12])
        # Refusals and answers, never a server error (503 is "too busy").
        assert code < 500 or code in (501, 503, 505), reply[:300]

    status = get_json(f"{address}/status.json")
    assert status["quorum"] is None and status["settings"]["kill_enabled"] is True
    with LighthouseClient(server.address(), 10, token=TOKEN) as client:
        assert member_ids(client.quorum("a", TIMEOUT)) == ["a"]
    assert get_json(f"{address}/status.json")["quorum"]["members"][0]["replica_id"] == "a"
