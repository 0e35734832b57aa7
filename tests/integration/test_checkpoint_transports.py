"""Live checkpoint transports over real sockets and real Gloo."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from ftdist.checkpointing import HTTPTransport, PGTransport, _wire
from ftdist.errors import CheckpointError
from ftdist.launch.ranks import RankContext, run_ranks

TIMEOUT = timedelta(seconds=10)


def _state(seed: int = 0) -> dict:
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
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "torchft": {"step": 7, "batches_committed": 14},
        "note": "non-tensor leaves travel too",
    }


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            _assert_same(x, y)
    else:
        assert a == b


@pytest.fixture
def transports() -> Iterator[tuple[HTTPTransport, HTTPTransport]]:
    src = HTTPTransport(TIMEOUT, hostname="127.0.0.1")
    dst = HTTPTransport(TIMEOUT, hostname="127.0.0.1")
    yield src, dst
    src.shutdown()
    dst.shutdown()


@pytest.mark.timeout(30)
def test_http_round_trip_is_exact(transports: tuple[HTTPTransport, HTTPTransport]) -> None:
    src, dst = transports
    state = _state()
    src.send_checkpoint([1], step=7, state_dict=state, timeout=TIMEOUT)
    got = dst.recv_checkpoint(0, src.metadata(), step=7, timeout=TIMEOUT)
    _assert_same(state, got)
    assert dst.last_transfer is not None and dst.last_transfer.nbytes > 64 * 33 * 4
    src.disallow_checkpoint()


@pytest.mark.timeout(30)
def test_http_chunks_in_parallel() -> None:
    src = HTTPTransport(TIMEOUT, num_chunks=3, hostname="::1")
    dst = HTTPTransport(TIMEOUT, num_chunks=3, hostname="::1")
    try:
        state = _state(1)
        src.send_checkpoint([1], 3, state, TIMEOUT)
        _assert_same(state, dst.recv_checkpoint(0, src.metadata(), 3, TIMEOUT))
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.timeout(30)
def test_http_refuses_wrong_step_and_unpublished_state(
    transports: tuple[HTTPTransport, HTTPTransport],
) -> None:
    src, dst = transports
    src.send_checkpoint([1], 5, _state(), TIMEOUT)
    with pytest.raises(CheckpointError, match="serving the checkpoint of step 5, not step 6"):
        dst.recv_checkpoint(0, src.metadata(), 6, TIMEOUT)
    src.disallow_checkpoint()
    quick = timedelta(seconds=0.5)
    src2 = HTTPTransport(quick, hostname="127.0.0.1")
    try:
        with pytest.raises(CheckpointError, match="503"):
            dst.recv_checkpoint(0, src2.metadata(), 5, TIMEOUT)
    finally:
        src2.shutdown()


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


def _stream(state: dict, step: int) -> bytes:
    header, tensors = _wire.plan(state, step)[0]
    return b"".join(bytes(b) for b in _wire.chunks(header, tensors))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong-step"])
def test_http_detects_corruption_truncation_and_wrong_step(
    transports: tuple[HTTPTransport, HTTPTransport], damage: str
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
    transports: tuple[HTTPTransport, HTTPTransport],
) -> None:
    src, dst = transports
    big = {"w": torch.randn(8 << 20)}  # 32 MiB: the transfer takes a while
    src.send_checkpoint([1], 1, big, TIMEOUT)
    result: dict = {}
    fetch = threading.Thread(
        target=lambda: result.update(got=dst.recv_checkpoint(0, src.metadata(), 1, TIMEOUT))
    )
    fetch.start()
    while src._lock._readers == 0 and fetch.is_alive():
        pass
    src.disallow_checkpoint()  # returns only once the reader is done
    big["w"].zero_()  # the "optimizer step": must not reach the peer
    fetch.join()
    assert float(result["got"]["w"].abs().sum()) > 0


def _pg_round_trip(ctx: RankContext, in_place: bool, wrong_step: bool) -> object:
    from ftdist.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=10)
    pg.configure(ctx.addr("t"), ctx.rank, ctx.world_size)
    try:
        if ctx.rank == 0:
            PGTransport(pg, TIMEOUT).send_checkpoint([1, 2], 4, _state(2))
            return None
        mine = _state(3)
        original = mine["model"]["w"].data_ptr()
        transport = PGTransport(pg, TIMEOUT, state_dict=(lambda: mine) if in_place else None)
        try:
            got = transport.recv_checkpoint(0, "<n/a>", 5 if wrong_step else 4)
        except CheckpointError as exc:
            return str(exc)
        _assert_same(_state(2), got)
        return got["model"]["w"].data_ptr() == original
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_place", [False, True])
def test_pg_transport_round_trip(in_place: bool) -> None:
    results = run_ranks(_pg_round_trip, 3, in_place, False, timeout=50)
    assert results[1] is in_place and results[2] is in_place


@pytest.mark.timeout(60)
def test_pg_transport_refuses_wrong_step() -> None:
    from ftdist.launch.ranks import Ranks

    with Ranks(_pg_round_trip, 2, args=(False, True)) as ranks:
        outcome = ranks.join(timeout=40, only=[1])[1]
    assert outcome.ok, outcome.error
    assert "refusing checkpoint of step 4" in str(outcome.value)
