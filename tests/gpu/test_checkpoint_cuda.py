"""Checkpoint transports with CUDA tensors: the HTTP server copies them to the host in pieces
and the receiver puts them back on the GPU; every PGTransport message is a CUDA tensor (as
NCCL needs). Skipped without CUDA."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from ftdist.checkpointing import HTTPTransport, PGTransport
from tests.unit.test_checkpoint_pg_wire import Loopback

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TIMEOUT = timedelta(seconds=30)
State = dict[str, torch.Tensor]


def _state() -> dict[str, torch.Tensor]:
    w = torch.randn(1024, 513, device="cuda")
    # Small tensors, on the GPU and the host, empty ones among them: one
    # batched PGTransport message, joined and copied out on the GPU.
    small = {f"s{i}": torch.randn(i % 9, device="cuda" if i % 3 else "cpu") for i in range(200)}
    return {
        "w": w,
        "w_t": w.t(),
        "b": torch.arange(7, device="cuda"),
        "cpu": torch.ones(3),
        **small,
    }


def _check(state: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    for k, v in state.items():
        assert got[k].device.type == v.device.type and torch.equal(got[k].cpu(), v.cpu())


@pytest.mark.timeout(60)
def test_http_round_trip_of_cuda_tensors() -> None:
    src: HTTPTransport[State] = HTTPTransport(TIMEOUT, hostname="127.0.0.1")
    dst: HTTPTransport[State] = HTTPTransport(TIMEOUT, hostname="127.0.0.1")
    try:
        state = _state()
        src.send_checkpoint([1], 1, state, TIMEOUT)
        _check(state, dst.recv_checkpoint(0, src.metadata(), 1, TIMEOUT))
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_place", [False, True])
def test_pg_transport_messages_are_cuda_tensors(in_place: bool) -> None:
    loop = Loopback()
    state = _state()
    PGTransport[State](loop, TIMEOUT, device="cuda").send_checkpoint([1], 1, state)
    mine = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    receiver: PGTransport[State] = PGTransport(
        loop, TIMEOUT, device="cuda", state_dict=(lambda: mine) if in_place else None
    )
    got = receiver.recv_checkpoint(0, "<n/a>", 1)
    assert {d.type for _, d in loop.sent} == {"cuda"}
    assert {d.type for _, d in loop.received} == {"cuda"}
    for k, v in state.items():
        assert torch.equal(got[k].cpu(), v.cpu())
    if in_place:
        assert got["w"].data_ptr() == mine["w"].data_ptr()
