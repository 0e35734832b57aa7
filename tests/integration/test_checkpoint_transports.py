"""Live checkpoint transports over real sockets and real Gloo."""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import itertools
import logging
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import uuid
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftdist import _auth
from ftdist.checkpointing import HTTPTransport, PGTransport, _receive, _wire
from ftdist.checkpointing._checksum import WordSum
from ftdist.checkpointing._prefault import ReceiveReserve
from ftdist.checkpointing.http_transport import CheckpointHTTPError, CheckpointTimeoutError
from ftdist.checkpointing.transport import TransferStats
from ftdist.errors import CheckpointError
from ftdist.launch.ranks import RankContext, Ranks, run_ranks

TIMEOUT = timedelta(seconds=10)
# torchft's transport tests accept any of these in a timeout's message.
TIMEOUT_REGEX = r"(Timed out|timed out|timeout|time out)"

State = dict[str, Any]


def _state(seed: int = 0) -> State:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 33, generator=g)
    return {
        "model": {
            "w": weight,
            "w_t": weight.t(),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(7), "exp_avg": torch.randn(10, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.99)}],
        },
        "torchft": {"step": 7, "batches_committed": 14},
        "note": "non-tensor leaves travel too",
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert type(b) is type(a) and a.dtype == b.dtype and a.shape == b.shape
        if type(a).__name__ == "DTensor":
            # A DTensor's fields, without importing torch.distributed.tensor.
            dt_a: Any = a
            dt_b: Any = b
            assert dt_a._spec == dt_b._spec
            a, b = dt_a._local_tensor, dt_b._local_tensor
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert type(a) is type(b) and a == b


# How a receiver reaches its source: the metadata it is given, and the route
# the bytes must then take. "direct" copies from the source's memory (the
# default on this host), "local" streams over the local socket (a receiver
# with direct reads off).
ROUTES = ["direct", "local", "tcp", "elsewhere"]


def _receiver(route: str, **kwargs: Any) -> HTTPTransport[State]:
    return HTTPTransport[State](TIMEOUT, direct_reads=route != "local", **kwargs)


def _metadata(src: HTTPTransport[Any], route: str) -> str:
    if route in ("direct", "local"):  # the source's own metadata: it is on this host
        return src.metadata()
    if route == "elsewhere":  # a source on another host: its local socket is not here
        return f"{src.address()}#local=ftdist-checkpoint-{'0' * 32}"
    if route == "unusable":  # a local socket this host cannot connect to (name too long)
        return f"{src.address()}#local={'x' * 200}"
    return src.address()  # no local socket named: TCP


def _assert_sums_vouch_for(transport: HTTPTransport[Any] | PGTransport[Any], got: Any) -> None:
    """The transport's sums of each received tensor are those of its bytes."""
    from torch.utils._pytree import tree_flatten

    assert transport.last_transfer is not None
    want = {}
    for leaf in tree_flatten(got)[0]:
        if type(leaf) is torch.Tensor and leaf.is_contiguous() and leaf.numel():
            digest = WordSum()
            _wire.sum_tensor(digest, leaf)
            want[(leaf.data_ptr(), leaf.numel() * leaf.element_size())] = digest.total()
    assert len(want) >= 4
    assert {k: transport.last_transfer.tensor_sums.get(k) for k in want} == want
    # A transposed tensor's bytes travel in storage order: they are no row-major sums of it.
    t = got["model"]["w_t"]
    assert (
        TransferStats.of_receive(1, 1.0, "", {0: t}, {0: next(iter(want.values()))}).tensor_sums
        == {}
    )


def _check_route(dst: HTTPTransport[Any], route: str) -> None:
    assert dst.last_transfer is not None
    assert dst.last_transfer.route == (route if route in ("direct", "local") else "tcp")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("route", [*ROUTES, "unusable"])
def test_http_round_trip_is_exact(
    transports: tuple[HTTPTransport[State], HTTPTransport[State]], route: str
) -> None:
    src, _ = transports
    dst = _receiver(route, hostname="127.0.0.1")
    try:
        state = _state()
        src.send_checkpoint([1], step=7, state_dict=state, timeout=TIMEOUT)
        got = dst.recv_checkpoint(0, _metadata(src, route), step=7, timeout=TIMEOUT)
        _assert_same(state, got)
        _assert_sums_vouch_for(dst, got)
        assert got["model"]["w_t"].stride() == (1, 33)  # a transposed tensor arrives transposed
        assert dst.last_transfer is not None and dst.last_transfer.nbytes > 64 * 33 * 4
        _check_route(dst, route)
        src.disallow_checkpoint()
    finally:
        dst.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_chunks", [0, 2])
def test_a_shut_down_transport_frees_itself_and_its_state_without_the_collector(
    num_chunks: int,
) -> None:
    # The server's handler is a bound method of its transport: while that
    # cycle stood, a transport shut down and dropped kept the state it served
    # and received into (a model's, possibly on a GPU) until the cyclic
    # collector happened to run.
    state = _state()
    mine = {"into": _state(seed=1)}  # the receiver's own state, received into
    src = HTTPTransport[State](TIMEOUT, num_chunks=num_chunks, hostname="127.0.0.1")
    dst = HTTPTransport[State](
        TIMEOUT, num_chunks=num_chunks, hostname="127.0.0.1", state_dict=lambda: mine["into"]
    )
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        src.send_checkpoint([1], step=3, state_dict=state, timeout=TIMEOUT)
        got = dst.recv_checkpoint(0, src.metadata(), step=3, timeout=TIMEOUT)
        _assert_same(state, got)
        assert got["model"]["w"].data_ptr() == mine["into"]["model"]["w"].data_ptr()
        del got
        watched = {
            "source": weakref.ref(src),
            "receiver": weakref.ref(dst),
            "served tensor": weakref.ref(state["model"]["w"]),
            "received-into tensor": weakref.ref(mine["into"]["model"]["w"]),
        }
        src.shutdown()
        dst.shutdown()
        del src, dst, state
        mine.clear()
        alive = [name for name, ref in watched.items() if ref() is not None]
        assert alive == [], f"still alive after shutdown without a collection: {alive}"
    finally:
        if collecting:
            gc.enable()


def _many_small(seed: int) -> State:
    """A deep model's state: thousands of small tensors of every size a batch
    meets (odd byte counts, empty, scalar), with large ones in between that
    end a batch."""
    g = torch.Generator().manual_seed(seed)
    layers: dict[str, Any] = {}
    for i in range(1200):
        layers[f"layer{i}.weight"] = torch.randn(8, 16, generator=g)
        layers[f"layer{i}.bias"] = torch.randn(3, generator=g).half()  # 6 bytes
        if i % 97 == 0:
            layers[f"layer{i}.scale"] = torch.randn(300_000, generator=g)  # 1.2 MB
        if i % 211 == 0:
            layers[f"layer{i}.empty"] = torch.empty(0, 4)
            layers[f"layer{i}.mask"] = torch.rand(5, generator=g) > 0.5  # 5 bytes
            layers[f"layer{i}.count"] = torch.tensor(i)
    return {"model": layers, "step": seed}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_chunks", [0, 3])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("route", ["direct", "local", "tcp"])
def test_many_small_tensors_arrive_exact_in_few_reads(
    route: str, in_place: bool, num_chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ftdist.checkpointing import _direct

    # Counted, not replaced: a batch of small tensors is one read of the
    # stream or one process_vm_readv, never one per tensor.
    reads: list[int] = []
    many, batch = _direct.read_memory_many, _wire.StreamReader.read_batch

    def counted_many(pid: int, spans: list[tuple[int, int, int]]) -> None:
        reads.append(len(spans))
        many(pid, spans)

    def counted_batch(self: _wire.StreamReader, flats: Any, progress: Any) -> None:
        reads.append(len(flats))
        batch(self, flats, progress)

    monkeypatch.setattr(_direct, "read_memory_many", counted_many)
    monkeypatch.setattr(_wire.StreamReader, "read_batch", counted_batch)
    src = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1", num_chunks=num_chunks)
    dst = _receiver(route, hostname="127.0.0.1", num_chunks=num_chunks)
    try:
        state = _many_small(1)
        own = _many_small(2)
        if in_place:
            dst.receive_into = lambda: own
        src.send_checkpoint([1], step=4, state_dict=state, timeout=TIMEOUT)
        got = dst.recv_checkpoint(0, _metadata(src, route), step=4, timeout=TIMEOUT)
        _assert_same(state, got)
        _check_route(dst, route)
        if in_place:  # received into the receiver's own tensors
            for name in ("layer5.weight", "layer5.bias", "layer97.scale"):
                assert got["model"][name].data_ptr() == own["model"][name].data_ptr(), name
        small = sum(1 for t in state["model"].values() if t.numel() * t.element_size() < 1 << 18)
        assert sum(reads) == small
        # Batches end at each large tensor (13 here), else at 4 MiB or 1024 tensors.
        assert len(reads) <= small // 50, reads
        sums = dst.last_transfer.tensor_sums if dst.last_transfer is not None else {}
        for name in ("layer0.weight", "layer0.bias", "layer97.scale", "layer211.mask"):
            t = got["model"][name]
            digest = WordSum()
            _wire.sum_tensor(digest, t)
            assert sums[(t.data_ptr(), t.numel() * t.element_size())] == digest.total(), name
        src.disallow_checkpoint()
    finally:
        src.shutdown()
        dst.shutdown()


def _impostor(name: str, report: int) -> None:
    """In a forked child: serve ``name`` as another user; report the bytes any client sends."""
    try:
        os.setgid(65534)
        os.setuid(65534)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind("\0" + name)
        srv.listen(1)
        os.write(report, b"ready\n")
        srv.settimeout(20)
        conn, _ = srv.accept()
        conn.settimeout(5)
        got = b""
        try:
            while piece := conn.recv(4096):
                got += piece
        except OSError:
            pass
        os.write(report, f"received {len(got)} bytes {got[:200]!r}\n".encode())
    finally:
        os._exit(0)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a server as another user")
def test_a_local_socket_of_another_user_gets_nothing_and_the_fetch_goes_over_tcp() -> None:
    # Abstract socket names are visible to every local user, and a dead
    # source's name can be bound again by anyone: a socket that another user
    # serves must not get the request (with its token), nor be believed.
    name = f"ftdist-checkpoint-{uuid.uuid4().hex}"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _impostor(name, write_end)
    os.close(write_end)
    src = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1", token="s3cret")
    dst = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1", token="s3cret")
    try:
        with os.fdopen(read_end, "r") as report:
            assert report.readline() == "ready\n"
            state = _state(3)
            src.send_checkpoint([1], 4, state, TIMEOUT)
            got = dst.recv_checkpoint(0, f"{src.address()}#local={name}", 4, TIMEOUT)
            _assert_same(state, got)
            _check_route(dst, "tcp")
            assert report.readline() == "received 0 bytes b''\n"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        src.shutdown()
        dst.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_http_without_the_local_socket_serves_over_tcp_alone(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "environment":
        monkeypatch.setenv("FTDIST_CHECKPOINT_LOCAL_SOCKET", "0")
    src = HTTPTransport[State](
        TIMEOUT, hostname="127.0.0.1", local_socket=False if how == "argument" else None
    )
    dst = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    try:
        assert src.metadata() == src.address()
        state = _state(2)
        src.send_checkpoint([1], 5, state, TIMEOUT)
        _assert_same(state, dst.recv_checkpoint(0, src.metadata(), 5, TIMEOUT))
        _check_route(dst, "tcp")
    finally:
        src.shutdown()
        dst.shutdown()


def test_a_bad_local_socket_setting_fails_before_any_server_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FTDIST_CHECKPOINT_LOCAL_SOCKET", "sometimes")
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="FTDIST_CHECKPOINT_LOCAL_SOCKET='sometimes'"):
        HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    assert not {t.name for t in threading.enumerate()} - before


@pytest.mark.timeout(30)
@pytest.mark.parametrize("route", ROUTES)
def test_http_chunks_in_parallel(route: str) -> None:
    src = HTTPTransport[State](TIMEOUT, num_chunks=3, hostname="::1")
    dst = _receiver(route, num_chunks=3, hostname="::1")
    try:
        state = _state(1)
        src.send_checkpoint([1], 3, state, TIMEOUT)
        got = dst.recv_checkpoint(0, _metadata(src, route), 3, TIMEOUT)
        _assert_same(state, got)
        _assert_sums_vouch_for(dst, got)  # from three chunks
        _check_route(dst, route)
        # What the Manager sets for a replica that never committed: every
        # chunk lands in the receiver's own matching tensors.
        mine = {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(33, dtype=torch.bfloat16)}}
        dst.receive_into = lambda: mine
        got = dst.recv_checkpoint(0, src.metadata(), 3, TIMEOUT)
        _assert_same(state, got)
        for key in ("w", "b"):
            assert got["model"][key].data_ptr() == mine["model"][key].data_ptr(), key
            assert torch.equal(mine["model"][key], state["model"][key]), key
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_chunks", [0, 3])
def test_torchft_checkpoint_server(num_chunks: int) -> None:
    """torchft's test_checkpoint_server: its constructor, its error types and messages."""
    server: HTTPTransport[dict[str, Any]] = HTTPTransport(
        timeout=timedelta(seconds=10), num_chunks=num_chunks
    )
    try:
        expected = {"state": "dict", "tensor": torch.rand(5, 2), "cuda": torch.rand(2, 3)}
        server.send_checkpoint(dst_ranks=[], step=1234, state_dict=expected, timeout=TIMEOUT)
        # The address, and the name of the local socket that a peer on this host
        # uses (none on a host without abstract Unix sockets: the address alone).
        if server._server.local_name is None:
            assert server.metadata() == server.address()
        else:
            assert server.metadata() == f"{server.address()}#local={server._server.local_name}"
        out = server.recv_checkpoint(
            src_rank=0, metadata=server.metadata(), step=1234, timeout=TIMEOUT
        )
        _assert_same(expected, out)
        with pytest.raises(urllib.error.URLError, match=r"urlopen error") as timed_out:
            server.recv_checkpoint(0, server.metadata(), 1234, timeout=timedelta(seconds=0.0))
        assert isinstance(timed_out.value, CheckpointError)
        server.send_checkpoint(dst_ranks=[], step=2345, state_dict=expected, timeout=TIMEOUT)
        with pytest.raises(
            urllib.error.HTTPError, match=r"Error 400.*serving 2345 but got step=1234"
        ) as refused:
            server.recv_checkpoint(0, server.metadata(), 1234, timeout=TIMEOUT)
        assert isinstance(refused.value, CheckpointError) and refused.value.code == 400
    finally:
        server.shutdown()


def test_torchft_checkpoint_server_locking() -> None:
    server: HTTPTransport[Any] = HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0)
    try:
        assert server._checkpoint_lock.w_locked() and server._disallowed and server._step == -1
        server.allow_checkpoint(1)
        assert not server._checkpoint_lock.w_locked() and not server._disallowed
        assert server._step == 1
        server.allow_checkpoint(2)
        assert server._step == 2
        server.disallow_checkpoint()
        server.disallow_checkpoint()
        assert server._checkpoint_lock.w_locked() and server._disallowed and server._step == 2
    finally:
        server.shutdown()


def test_torchft_http_transport_bench(capsys: pytest.CaptureFixture[str]) -> None:
    from ftdist.checkpointing.http_transport_bench import main

    main(["--chunk-size=10", "--num-chunks=0", "--total-size=100", "--device=cpu"])
    assert "fetched 10 tensors" in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_http_refuses_wrong_step_and_unpublished_state(
    transports: tuple[HTTPTransport[State], HTTPTransport[State]],
) -> None:
    src, dst = transports
    src.send_checkpoint([1], 5, _state(), TIMEOUT)
    with pytest.raises(CheckpointHTTPError, match="serving 5 but got step=4"):
        dst.recv_checkpoint(0, src.metadata(), 4, TIMEOUT)
    src.disallow_checkpoint()
    quick = timedelta(seconds=0.5)
    src2 = HTTPTransport[State](quick, hostname="127.0.0.1")
    try:
        with pytest.raises(CheckpointHTTPError, match="503"):
            dst.recv_checkpoint(0, src2.metadata(), 5, TIMEOUT)
        with pytest.raises(CheckpointTimeoutError, match=TIMEOUT_REGEX):
            dst.recv_checkpoint(0, src2.metadata(), 5, timedelta(milliseconds=50))
    finally:
        src2.shutdown()


@pytest.mark.timeout(30)
def test_http_a_newer_step_waits_for_the_source_to_publish_it(
    transports: tuple[HTTPTransport[State], HTTPTransport[State]],
) -> None:
    src, dst = transports
    src.send_checkpoint([1], 5, _state(5), TIMEOUT)
    result: dict[str, Any] = {}
    fetch = threading.Thread(
        target=lambda: result.update(got=dst.recv_checkpoint(0, src.metadata(), 6, TIMEOUT))
    )
    fetch.start()  # the peer asks for step 6 while step 5 is still served
    while src._checkpoint_lock.readers == 0 and not src._server._shared.active:
        time.sleep(0.001)
    src.disallow_checkpoint()
    src.send_checkpoint([1], 6, _state(6), TIMEOUT)
    fetch.join(timeout=20)
    _assert_same(_state(6), result["got"])


def _serve_raw(payload: bytes, content_length: int) -> tuple[str, threading.Thread, socket.socket]:
    """A one-shot HTTP server that answers with ``payload`` as it is."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                + f"Content-Length: {content_length}\r\n\r\n".encode()
                + payload
            )

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.getsockname()[1]}/checkpoint/", thread, server


def _stream(state: State, step: int) -> bytes:
    return b"".join(bytes(b) for b in _wire.chunks(_wire.plan(state, step)[0]))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong-step"])
def test_http_detects_corruption_truncation_and_wrong_step(
    transports: tuple[HTTPTransport[State], HTTPTransport[State]], damage: str
) -> None:
    _, dst = transports
    payload = bytearray(_stream(_state(), 9 if damage != "wrong-step" else 8))
    length = len(payload)
    if damage == "flip":
        payload[len(payload) // 2] ^= 0x40
    elif damage == "truncate":
        payload = payload[: len(payload) - 100]
    url, thread, server = _serve_raw(bytes(payload), length)
    try:
        expected = {
            "flip": "is corrupt",
            "truncate": "truncated",
            "wrong-step": "refusing checkpoint of step 8",
        }[damage]
        with pytest.raises(CheckpointError, match=expected):
            dst.recv_checkpoint(0, url, 9, TIMEOUT)
    finally:
        thread.join(timeout=5)
        server.close()


@pytest.mark.timeout(30)
def test_disallow_waits_for_a_transfer_in_flight(
    transports: tuple[HTTPTransport[State], HTTPTransport[State]],
) -> None:
    src, dst = transports
    big = {"w": torch.randn(8 << 20)}  # 32 MiB: the transfer takes a while
    src.send_checkpoint([1], 1, big, TIMEOUT)
    result: dict[str, Any] = {}
    fetch = threading.Thread(
        target=lambda: result.update(got=dst.recv_checkpoint(0, src.metadata(), 1, TIMEOUT))
    )
    fetch.start()
    while src._checkpoint_lock.readers == 0 and fetch.is_alive():
        time.sleep(0.0005)
    src.disallow_checkpoint()  # returns only once the reader is done
    big["w"].zero_()  # the "optimizer step": must not reach the peer
    fetch.join()
    assert float(result["got"]["w"].abs().sum()) > 0


def _read_until_closed(sock: socket.socket) -> bytes:
    out = bytearray()
    while True:
        try:
            piece = sock.recv(1 << 20)
        except (ConnectionResetError, TimeoutError):
            return bytes(out)
        if not piece:
            return bytes(out)
        out += piece


@pytest.mark.timeout(60)
def test_a_slow_reader_cannot_hold_disallow_past_its_timeout() -> None:
    quick = timedelta(seconds=1)
    src = HTTPTransport[State](quick, hostname="127.0.0.1")
    dst = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        state = {"w": torch.randn(16 << 20)}  # 64 MiB: far more than socket buffers hold
        src.send_checkpoint([1], 1, state, quick)
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", int(src.metadata().split(":")[2].split("/")[0])))
        slow.sendall(b"GET /checkpoint/1/full HTTP/1.0\r\n\r\n")
        first = slow.recv(4096)  # then it stops reading
        assert first.startswith(b"HTTP/1.0 200")
        while not src._server.streaming():
            time.sleep(0.001)
        errors: list[BaseException] = []
        done = threading.Event()

        def disallow() -> None:
            try:
                src.disallow_checkpoint()
            except BaseException as exc:  # recorded for the assertion
                errors.append(exc)
            done.set()

        threading.Thread(target=disallow).start()
        assert done.wait(30), "disallow_checkpoint hung behind a reader that does not read"
        assert errors == []
        state["w"].zero_()  # the optimizer step
        # The slow reader was cut off: what it gets is a truncated stream.
        slow.settimeout(10)
        data = first + _read_until_closed(slow)
        head, _, body = data.partition(b"\r\n\r\n")
        size = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
        assert len(body) < size
        with pytest.raises(CheckpointError, match="truncated"):
            _receive.read_leaves(_wire.StreamReader(io.BytesIO(body).readinto, "slow"), 1)
        # The server is still up and serves the next step to a well-behaved peer.
        src.send_checkpoint([1], 2, state, quick)
        got = dst.recv_checkpoint(0, src.metadata(), 2, TIMEOUT)
        assert float(got["w"].abs().sum()) == 0
    finally:
        slow.close()
        src.shutdown()
        dst.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("route", ROUTES[:2])
def test_the_job_token_gates_checkpoint_fetches(
    monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    src = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1", token="s3cret")
    open_client = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1")
    wrong = HTTPTransport[State](TIMEOUT, hostname="127.0.0.1", token="guess")
    monkeypatch.setenv(_auth.ENV_TOKEN, "s3cret")
    from_env = _receiver(route, hostname="127.0.0.1")  # the token from the environment
    try:
        state = _state()
        src.send_checkpoint([1], 3, state, TIMEOUT)
        for client in (open_client, wrong):
            with pytest.raises(CheckpointHTTPError, match=r"401.*job token") as refused:
                client.recv_checkpoint(0, _metadata(src, route), 3, TIMEOUT)
            assert refused.value.code == 401 and _auth.ENV_TOKEN in str(refused.value)
        _assert_same(state, from_env.recv_checkpoint(0, _metadata(src, route), 3, TIMEOUT))
        _check_route(from_env, route)
        # A wrong token learns nothing, not even whether the step is right.
        with pytest.raises(CheckpointHTTPError, match="401"):
            wrong.recv_checkpoint(0, _metadata(src, route), 4, TIMEOUT)
    finally:
        for t in (src, open_client, wrong, from_env):
            t.shutdown()


def test_a_server_without_token_works_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(_auth.ENV_TOKEN, raising=False)
    monkeypatch.delenv(_auth.ENV_TOKEN_FILE, raising=False)
    monkeypatch.setattr(_auth, "_warned", threading.Event())
    with caplog.at_level(logging.WARNING, logger="ftdist.auth"):
        first = HTTPTransport[State](TIMEOUT, num_chunks=0)
        second = HTTPTransport[State](TIMEOUT, num_chunks=0)
    try:
        warnings = [r for r in caplog.records if "without a job token" in r.getMessage()]
        assert len(warnings) == 1
        first.send_checkpoint([1], 1, {"x": 1}, TIMEOUT)
        assert second.recv_checkpoint(0, first.metadata(), 1, TIMEOUT) == {"x": 1}
    finally:
        first.shutdown()
        second.shutdown()


# -- the torchft multi-recovery scenario, with DTensors, in real processes ----------------------


def _barrier(store: Any, name: str, n: int) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + 30
    while int(store.add(name, 0)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r} timed out")
        time.sleep(0.002)


def _dtensor_state() -> dict[str, Any]:
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    return {
        "rank": torch.tensor([1, 2, 3]),
        "str": "str",
        "int": 1234,
        # torchft's make_state_dict: a DTensor on DeviceMesh("cpu", 1).
        "dtensor": distribute_tensor(torch.tensor([5, 6, 7]), DeviceMesh("cpu", 1), []),
        "sharded": distribute_tensor(
            torch.arange(8.0).reshape(4, 2),
            DeviceMesh("cpu", [0], mesh_dim_names=("dp",)),
            [Shard(1)],
        ),
    }


def _multi_recovery(ctx: RankContext, kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ftdist.process_group import ProcessGroupGloo

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    store = ctx.store()
    pg = None
    out: dict[str, Any] = {}
    try:
        state = _dtensor_state()
        mine = _dtensor_state()  # a recovering replica's own state, received into in place
        transport: Any
        if kind.startswith("http"):
            transport = HTTPTransport[State](
                TIMEOUT,
                num_chunks=0,
                hostname="127.0.0.1",
                state_dict=(lambda: mine) if kind == "http-in-place" else None,
            )
            if ctx.rank == 0:
                store.set("metadata", transport.metadata())
            metadata = store.get("metadata").decode()
        else:
            pg = ProcessGroupGloo(timeout=10)
            pg.configure(ctx.addr("pg"), ctx.rank, ctx.world_size)
            transport = PGTransport[State](
                pg, timeout=TIMEOUT, device="cpu", state_dict=lambda: mine
            )
            metadata = "<n/a>"
        _barrier(store, "start", 3)
        if ctx.rank == 0:
            transport.send_checkpoint(dst_ranks=[1, 2], step=1, state_dict=state, timeout=TIMEOUT)
        else:
            got = transport.recv_checkpoint(0, metadata, 1, TIMEOUT)
            _assert_same(state, got)
            local = got["sharded"]._local_tensor
            out["in_place"] = local.data_ptr() == mine["sharded"]._local_tensor.data_ptr()
        _barrier(store, "one", 3)
        transport.disallow_checkpoint()
        if ctx.rank == 0:
            transport.send_checkpoint(dst_ranks=[2], step=2, state_dict=state, timeout=TIMEOUT)
        elif ctx.rank == 2:
            _assert_same(state, transport.recv_checkpoint(0, metadata, 2, TIMEOUT))
        _barrier(store, "two", 3)
        transport.disallow_checkpoint()
        if ctx.rank == 2:
            try:
                transport.recv_checkpoint(0, metadata, 3, timedelta(milliseconds=10))
                out["timeout"] = "returned"
            except Exception as exc:  # torchft only asks for a timeout message
                out["timeout"] = f"{type(exc).__name__}: {exc}"
        _barrier(store, "end", 3)
        return out
    finally:
        transport.shutdown()
        if pg is not None:
            pg.shutdown()
        dist.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["http", "http-in-place", "pg"])
def test_multi_recovery_with_dtensors(kind: str) -> None:
    results = run_ranks(_multi_recovery, 3, kind, timeout=80)
    assert re.search(TIMEOUT_REGEX, results[2]["timeout"]), results[2]["timeout"]
    # Given state_dict=, the transports received the DTensor's shard into the
    # target's own local tensor.
    in_place = kind != "http"
    assert results[1]["in_place"] is in_place and results[2]["in_place"] is in_place


def _pg_round_trip(ctx: RankContext, in_place: bool, wrong_step: bool) -> object:
    from ftdist.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=10)
    pg.configure(ctx.addr("t"), ctx.rank, ctx.world_size)
    try:
        if ctx.rank == 0:
            sender = PGTransport[State](pg, TIMEOUT)
            sender.send_checkpoint([1, 2], 4, _state(2))
            assert sender.last_transfer is not None
            return sender.last_transfer.route
        mine = _state(3)
        original = mine["model"]["w"].data_ptr()
        # Rank 1 copies from the sender's memory (same host); rank 2 declines
        # the offer and is sent the tensors through Gloo, in the same send.
        transport = PGTransport[State](
            pg, TIMEOUT, state_dict=(lambda: mine) if in_place else None, direct_reads=ctx.rank == 1
        )
        try:
            got = transport.recv_checkpoint(0, "<n/a>", 5 if wrong_step else 4)
        except CheckpointError as exc:
            return str(exc)
        _assert_same(_state(2), got)
        _assert_sums_vouch_for(transport, got)
        assert transport.last_transfer is not None
        return got["model"]["w"].data_ptr() == original, transport.last_transfer.route
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_place", [False, True])
def test_pg_transport_round_trip(in_place: bool) -> None:
    results = run_ranks(_pg_round_trip, 3, in_place, False, timeout=50)
    assert results[1:] == [(in_place, "direct"), (in_place, "process group")], results
    assert results[0] == "direct+process group"


@pytest.mark.timeout(60)
def test_pg_transport_refuses_wrong_step() -> None:
    with Ranks(_pg_round_trip, 2, args=(False, True)) as ranks:
        outcome = ranks.join(timeout=40, only=[1])[1]
    assert outcome.ok, outcome.error
    assert "refusing checkpoint of step 4" in str(outcome.value)


# -- torchft's PGTransportTimeoutTest: two Gloo groups in this process -------------------------


@contextlib.contextmanager
def _gloo_groups(size: int) -> Iterator[list[Any]]:
    """The ranks of one Gloo group, all in this process."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from ftdist.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def init(rank: int) -> Any:
        # Short: a stalled op's thread lives until the group's timeout.
        pg = ProcessGroupGloo(timeout=timedelta(seconds=2))
        pg.configure(f"127.0.0.1:{store.port}/group", rank, size)
        return pg

    with ThreadPoolExecutor(max_workers=size) as executor:
        pgs = list(executor.map(init, range(size)))
    try:
        yield pgs
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.fixture
def gloo_pair() -> Iterator[list[Any]]:
    with _gloo_groups(2) as pgs:
        yield pgs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("direction", ["send", "recv"])
@pytest.mark.parametrize("mode", ["default", "override"])
def test_pg_transport_stalled_peer_times_out_on_the_transport_deadline(
    gloo_pair: list[Any], direction: str, mode: str
) -> None:
    short = timedelta(milliseconds=100)
    transport: PGTransport[dict[str, Any]] = PGTransport(
        gloo_pair[0], timeout=TIMEOUT if mode == "override" else short, device=torch.device("cpu")
    )
    kwargs = {"timeout": short} if mode == "override" else {}
    with pytest.raises(RuntimeError, match=TIMEOUT_REGEX) as info:
        if direction == "send":
            transport.send_checkpoint([1], 1, {"tensor": torch.arange(4)}, **kwargs)
        else:
            transport.recv_checkpoint(1, "<n/a>", 1, **kwargs)
    # The transport's deadline applied, not the group's.
    assert "timed out after 0.1 s" in str(info.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("first", ["send", "recv"])
def test_pg_transport_explicit_timeout_wins_over_the_default(
    gloo_pair: list[Any], first: str
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    a, b = (PGTransport[State](pg, timeout=timedelta(milliseconds=20)) for pg in gloo_pair)
    expected = {"tensor": torch.arange(4), "step": 1}
    forever = timedelta(0)  # torch's "no timeout": the group's own

    def send() -> None:
        a.send_checkpoint([1], 1, expected, timeout=forever)

    def recv() -> Any:
        return b.recv_checkpoint(0, "<n/a>", 1, timeout=forever)

    with ThreadPoolExecutor(max_workers=1) as executor:
        if first == "send":
            sent = executor.submit(send)
            time.sleep(0.1)  # longer than the 20 ms default
            got = recv()
            sent.result(timeout=10)
        else:
            received = executor.submit(recv)
            time.sleep(0.1)
            send()
            got = received.result(timeout=10)
    _assert_same(expected, got)


@pytest.mark.timeout(30)
def test_pg_transport_after_a_timed_out_transfer_fails_at_once_until_reconfigured(
    gloo_pair: list[Any],
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # torchft's multi-recovery test: a receive that times out, then a send to
    # a peer that never receives; the send must not wait out its deadline.
    a, b = (PGTransport[State](pg, timeout=TIMEOUT) for pg in gloo_pair)
    with pytest.raises(RuntimeError, match=r"timed out after 0\.01 s"):
        a.recv_checkpoint(1, "<n/a>", 1, timeout=timedelta(milliseconds=10))
    assert gloo_pair[0].errored() is not None  # mid-message: the group was aborted
    with pytest.raises(TimeoutError, match="an earlier transfer on this group timed out"):
        a.send_checkpoint([1], 2, {"t": torch.arange(3)}, timeout=TIMEOUT)
    # Reconfigured, the transport works again.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with ThreadPoolExecutor(max_workers=2) as executor:
        list(
            executor.map(
                lambda r: gloo_pair[r].configure(f"127.0.0.1:{store.port}/again", r, 2), range(2)
            )
        )
        sent = executor.submit(a.send_checkpoint, [1], 3, {"t": torch.arange(3)}, TIMEOUT)
        got = b.recv_checkpoint(0, "<n/a>", 3, timeout=TIMEOUT)
        sent.result(timeout=20)
    assert torch.equal(got["t"], torch.arange(3))


def test_a_fetch_tells_its_progress_as_the_bytes_arrive(
    transports: tuple[HTTPTransport[State], HTTPTransport[State]],
) -> None:
    src, dst = transports
    state = {"big": torch.arange(6 << 20, dtype=torch.float32), "small": torch.ones(3)}
    src.send_checkpoint([1], 5, state, TIMEOUT)
    told: list[tuple[int, int]] = []
    dst.progress = lambda done, total: told.append((done, total))
    got = dst.recv_checkpoint(0, src.metadata(), 5, TIMEOUT)
    assert torch.equal(got["big"], state["big"])
    assert len(told) >= 2, told  # 24 MiB arrive in 16 MiB pieces
    dones = [d for d, _ in told]
    assert dones == sorted(dones) and dones[-1] == (6 << 20) * 4 + 12
    assert all(total >= dones[-1] for _, total in told)  # the stream's announced size


# -- a receive reserve: fresh tensors carved out of memory populated ahead --------------------

MIB = 1 << 20


def _lazy_state() -> State:
    """Weights the receiver holds, and optimizer state (a dense transposed one among it) it lacks."""
    g = torch.Generator().manual_seed(5)
    return {
        "model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(10, generator=g)},
        "optim": {
            "momentum": torch.randn(512, 1024, generator=g),  # 2 MiB
            "momentum_t": torch.randn(1024, 384, generator=g).t(),  # 1.5 MiB
            "small": torch.randn(7, generator=g),
        },
    }


def _own_weights() -> State:
    return {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(10)}}


def _check_reserved(reserve: ReceiveReserve, got: State, mine: State, room: int) -> None:
    """The receiver's own tensors were written in place, the fresh ones that fitted (in
    stream order) were carved out of the reserve, and everything holds its bytes once the
    reserve is closed."""
    reserve.close()
    _assert_same(_lazy_state(), got)
    assert got["model"]["w"].data_ptr() == mine["model"]["w"].data_ptr()
    assert not reserve.owns(got["optim"]["small"])  # the receiver's own allocator
    carved = {k: reserve.owns(got["optim"][k]) for k in ("momentum", "momentum_t")}
    nbytes = {"momentum": 2 * MIB, "momentum_t": 3 * MIB // 2}
    assert reserve.taken == sum(nbytes[k] for k, owned in carved.items() if owned)
    if room >= 4 * MIB:
        assert all(carved.values()), carved
    else:  # room for the first of them to arrive, whichever it was
        assert sum(carved.values()) == 1, carved
    for key in carved:
        t = got["optim"][key]
        assert t.untyped_storage().nbytes() == nbytes[key]  # a storage of its own
        t.add_(1)  # and an ordinary tensor to train with
    assert torch.equal(got["optim"]["momentum"], _lazy_state()["optim"]["momentum"] + 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("room", [4 * MIB, 2 * MIB])
@pytest.mark.parametrize("num_chunks", [0, 3])
@pytest.mark.parametrize("route", ["direct", "local", "tcp"])
def test_http_fresh_tensors_land_in_the_receive_reserve(
    route: str, num_chunks: int, room: int
) -> None:
    src = HTTPTransport[State](TIMEOUT, num_chunks=num_chunks, hostname="127.0.0.1")
    dst = _receiver(route, num_chunks=num_chunks, hostname="127.0.0.1")
    try:
        src.send_checkpoint([1], 3, _lazy_state(), TIMEOUT)
        mine = _own_weights()
        reserve = ReceiveReserve(room)
        dst.receive_into = lambda: mine
        dst.receive_reserve = reserve
        got = dst.recv_checkpoint(0, _metadata(src, route), 3, TIMEOUT)
        _check_route(dst, route)
        _check_reserved(reserve, got, mine, room)
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("room", [4 * MIB, 2 * MIB])
def test_pg_fresh_tensors_land_in_the_receive_reserve(gloo_pair: list[Any], room: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    mine = _own_weights()
    a = PGTransport[State](gloo_pair[0], TIMEOUT)
    b = PGTransport[State](gloo_pair[1], TIMEOUT, state_dict=lambda: mine)
    reserve = ReceiveReserve(room)
    b.receive_reserve = reserve
    with ThreadPoolExecutor(max_workers=1) as executor:
        sent = executor.submit(a.send_checkpoint, [1], 3, _lazy_state(), TIMEOUT)
        got = b.recv_checkpoint(0, "<n/a>", 3)
        sent.result(timeout=20)
    _check_reserved(reserve, got, mine, room)


def _six_tensors() -> State:
    g = torch.Generator().manual_seed(9)
    return {f"layer{i}": torch.randn(1 << 18, generator=g) for i in range(6)}  # 1 MiB each


@pytest.mark.timeout(30)
def test_pg_sender_posts_the_next_message_before_waiting_for_the_last(
    gloo_pair: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ftdist.checkpointing.pg_transport import _SENDS_IN_FLIGHT

    # Observed, not replaced: the sender's sends and waits on the real group.
    events: list[tuple[str, int]] = []
    send = gloo_pair[0].send

    class Watched:
        def __init__(self, work: Any, tag: int) -> None:
            self.work, self.tag = work, tag

        def wait(self, timeout: timedelta | None = None) -> Any:
            result = self.work.wait(timeout)
            events.append(("done", self.tag))
            return result

    def watched(tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        events.append(("post", tag))
        return Watched(send(tensors, dst, tag), tag)

    monkeypatch.setattr(gloo_pair[0], "send", watched)
    state = _six_tensors()
    # The messages through Gloo: no direct read of the sender's memory.
    a = PGTransport[State](gloo_pair[0], TIMEOUT, direct_reads=False)
    b = PGTransport[State](gloo_pair[1], TIMEOUT)
    with ThreadPoolExecutor(max_workers=1) as executor:
        sent = executor.submit(a.send_checkpoint, [1], 2, state, TIMEOUT)
        got = b.recv_checkpoint(0, "<n/a>", 2)
        sent.result()
    _assert_same(state, got)
    tensor_tags = [tag for kind, tag in events if kind == "post" and tag >= 16]
    assert len(tensor_tags) == 6, events
    # Every tensor message but the last is followed by the next one's post
    # before its own completion is awaited, and never more are out at once.
    for first, second in itertools.pairwise(tensor_tags):
        assert events.index(("post", second)) < events.index(("done", first)), events
    outstanding = 0
    for kind, _ in events:
        outstanding += 1 if kind == "post" else -1
        assert outstanding <= _SENDS_IN_FLIGHT, events
    assert outstanding == 0, events


@pytest.mark.timeout(30)
def test_pg_sender_with_sends_posted_times_out_when_the_peer_stops_mid_state(
    gloo_pair: list[Any],
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    a = PGTransport[State](gloo_pair[0], timedelta(milliseconds=500), direct_reads=False)
    peer = gloo_pair[1]

    def take_the_start_then_stop() -> None:
        # The prefix, the header and the first tensor, by hand on the real
        # group; then nothing, as a receiver that hangs half-way. On a loaded
        # machine the sender may give up before this thread takes them all:
        # its receives then fail on the group's own timeout, which is fine.
        with contextlib.suppress(RuntimeError):
            prefix = torch.empty(_wire.PREFIX_BYTES, dtype=torch.uint8)
            peer.recv([prefix], 0, 1).wait()
            flags = _wire.FLAG_BATCHED
            header_len = _wire.parse_prefix(prefix.numpy().tobytes(), "test", flags)[0]
            peer.recv([torch.empty(header_len, dtype=torch.uint8)], 0, 2).wait()
            peer.recv([torch.empty(1 << 20, dtype=torch.uint8)], 0, 16).wait()

    with ThreadPoolExecutor(max_workers=1) as executor:
        taken = executor.submit(take_the_start_then_stop)
        with pytest.raises(RuntimeError, match=TIMEOUT_REGEX) as info:
            a.send_checkpoint([1], 1, _six_tensors())
        taken.result()
    assert "checkpoint send to rank 1 timed out after 0.5 s" in str(info.value)
    # The group was aborted: the next transfer refuses at once.
    with pytest.raises(RuntimeError, match="reconfigure it first"):
        a.send_checkpoint([1], 2, _six_tensors())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("errno_", [errno.EPERM, errno.EFAULT], ids=["refused", "failed"])
def test_pg_direct_read_refused_streams_and_failed_stops_both_ends_at_once(
    gloo_pair: list[Any], monkeypatch: pytest.MonkeyPatch, errno_: int
) -> None:
    """Refused by the kernel (EPERM), the receiver is sent the tensors through
    Gloo; a copy that fails (EFAULT) fails both ends at once: their 60 s
    timeout is past the test's own."""
    from concurrent.futures import ThreadPoolExecutor

    from ftdist.checkpointing import _direct

    real = _direct.read_memory

    def read_memory(pid: int, local: int, remote: int, nbytes: int) -> None:
        if errno_ == errno.EPERM or nbytes > 1:  # EFAULT: the 1-byte probe passes
            raise OSError(errno_, os.strerror(errno_))
        real(pid, local, remote, nbytes)

    monkeypatch.setattr(_direct, "read_memory", read_memory)
    a, b = (PGTransport[State](pg, timedelta(seconds=60)) for pg in gloo_pair)
    with ThreadPoolExecutor(max_workers=1) as executor:
        sent = executor.submit(a.send_checkpoint, [1], 3, _six_tensors())
        if errno_ == errno.EPERM:
            _assert_same(_six_tensors(), b.recv_checkpoint(0, "<n/a>", 3))
            sent.result(timeout=20)
            assert a.last_transfer is not None and b.last_transfer is not None
            assert a.last_transfer.route == b.last_transfer.route == "process group"
            return
        with pytest.raises(CheckpointError, match="failed after 0 bytes of a tensor"):
            b.recv_checkpoint(0, "<n/a>", 3)
        with pytest.raises(CheckpointError, match="rank 1 failed to copy the checkpoint"):
            sent.result(timeout=20)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fails", ["probe", "copy"])
def test_pg_a_receiver_whose_copy_fails_leaves_the_others_served(
    monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """Rank 1's read of the sender's memory fails (its one-byte probe, before
    it answers the offer, or the copy after) and rank 2 is streamed to: rank
    2 still gets the state, then the sender raises rank 1's failure. The
    groups' 2 s timeout would end a wait in a CommunicationError instead."""
    from concurrent.futures import ThreadPoolExecutor

    from ftdist.checkpointing import _direct

    real = _direct.read_memory

    def read_memory(pid: int, local: int, remote: int, nbytes: int) -> None:
        if fails == "probe" or nbytes > 1:
            raise OSError(errno.EFAULT, os.strerror(errno.EFAULT))
        real(pid, local, remote, nbytes)

    monkeypatch.setattr(_direct, "read_memory", read_memory)
    state = _six_tensors()
    with _gloo_groups(3) as pgs, ThreadPoolExecutor(max_workers=2) as executor:
        sender = PGTransport[State](pgs[0], TIMEOUT)
        failing = PGTransport[State](pgs[1], TIMEOUT)
        streamed = PGTransport[State](pgs[2], TIMEOUT, direct_reads=False)
        sent = executor.submit(sender.send_checkpoint, [1, 2], 3, state)
        got = executor.submit(streamed.recv_checkpoint, 0, "<n/a>", 3)
        with pytest.raises(CheckpointError, match="reading rank 0's memory failed"):
            failing.recv_checkpoint(0, "<n/a>", 3)
        _assert_same(state, got.result(timeout=20))
        said = "answered b'X'" if fails == "probe" else "rank 1 failed to copy the checkpoint"
        with pytest.raises(CheckpointError, match=re.escape(said)):
            sent.result(timeout=20)
        assert sender.last_transfer is not None
        assert sender.last_transfer.route == "process group"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_place", [False, True])
def test_pg_small_tensors_travel_in_batches_over_gloo(gloo_pair: list[Any], in_place: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # Counted, not replaced: the receiver's messages on the real group.
    received: list[int] = []
    recv = gloo_pair[1].recv

    def counted(tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        received.append(tensors[0].numel())
        return recv(tensors, src, tag)

    gloo_pair[1].recv = counted
    state, own = _many_small(1), _many_small(2)
    a = PGTransport[State](gloo_pair[0], TIMEOUT, direct_reads=False)
    b = PGTransport[State](gloo_pair[1], TIMEOUT, state_dict=(lambda: own) if in_place else None)
    with ThreadPoolExecutor(max_workers=1) as executor:
        sent = executor.submit(a.send_checkpoint, [1], 4, state, TIMEOUT)
        got = b.recv_checkpoint(0, "<n/a>", 4)
        sent.result(timeout=20)
    _assert_same(state, got)
    if in_place:
        for name in ("layer5.weight", "layer5.bias", "layer97.scale", "layer211.mask"):
            assert got["model"][name].data_ptr() == own["model"][name].data_ptr(), name
    tensors = list(state["model"].values())
    small = sum(1 for t in tensors if 0 < t.numel() * t.element_size() < 1 << 18)
    large = len(tensors) - small - sum(1 for t in tensors if not t.numel())
    # prefix, header, trailer, each large tensor alone, the small ones batched
    # between them (13 large ones here; batches also end at 1024 tensors).
    assert len(received) <= 3 + large + (large + 1) + small // 1024 + 1, len(received)
    assert (
        sum(received)
        == sum(t.numel() * t.element_size() for t in tensors)
        + sum(received[:2])
        + _wire.TRAILER_BYTES
    )
    assert b.last_transfer is not None
    sums = b.last_transfer.tensor_sums
    for name in ("layer0.weight", "layer0.bias", "layer97.scale", "layer211.mask"):
        t = got["model"][name]
        digest = WordSum()
        _wire.sum_tensor(digest, t)
        assert sums[(t.data_ptr(), t.numel() * t.element_size())] == digest.total(), name
