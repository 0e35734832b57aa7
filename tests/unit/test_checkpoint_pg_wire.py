"""PGTransport's messages, over an in-process loopback group: every message is a tensor on the
transport's device (NCCL needs that), in-place receives only into matching tensors, and a
peer's prefix is checked before anything else is received."""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist.checkpointing import PGTransport, _wire
from ftdist.errors import CheckpointError
from ftdist.process_group import CompletedWork
from tests.unit.checkpoint_helpers import assert_identical

TIMEOUT = timedelta(seconds=5)


class Loopback:
    """Both ends of a two-rank group in one process: sends queue up by tag, receives take them."""

    def __init__(self) -> None:
        self.queues: dict[int, list[torch.Tensor]] = {}
        self.sent: list[tuple[int, torch.device]] = []
        self.received: list[tuple[int, torch.device]] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> CompletedWork:
        self.sent.append((tag, tensors[0].device))
        self.queues.setdefault(tag, []).append(tensors[0].clone())
        return CompletedWork(None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> CompletedWork:
        self.received.append((tag, tensors[0].device))
        tensors[0].copy_(self.queues[tag].pop(0))
        return CompletedWork(None)


def _state() -> dict[str, Any]:
    w = torch.randn(5, 4)
    return {"w": w, "w_t": w.t(), "empty": torch.empty(0), "meta": {"step": 3, "lr": 0.5}}


def test_every_message_travels_on_the_transport_device() -> None:
    loop = Loopback()
    # "meta" stands in for an accelerator: no data, but a device of its own.
    PGTransport[dict[str, Any]](loop, TIMEOUT, device="meta").send_checkpoint([1], 3, _state())
    assert {device.type for _, device in loop.sent} == {"meta"}
    # prefix, header, the two non-empty tensors, trailer
    assert [tag for tag, _ in loop.sent] == [1, 2, 16, 17, 3]


def test_round_trip_in_place_only_into_matching_tensors() -> None:
    loop = Loopback()
    state = _state()
    PGTransport[dict[str, Any]](loop, TIMEOUT).send_checkpoint([1], 3, state)
    mine: dict[str, Any] = {
        "w": torch.zeros(5, 4),  # matches: received in place
        "w_t": torch.zeros(4, 5),  # same shape, other strides: a fresh tensor
        "meta": {"step": 0},
    }
    receiver = PGTransport[dict[str, Any]](loop, TIMEOUT, state_dict=lambda: mine)
    got = receiver.recv_checkpoint(0, "<n/a>", 3)
    assert_identical(state, got)
    assert got["w"].data_ptr() == mine["w"].data_ptr() and torch.equal(mine["w"], state["w"])
    assert got["w_t"].data_ptr() != mine["w_t"].data_ptr() and not mine["w_t"].any()
    assert {device.type for _, device in loop.received} == {"cpu"}
    assert receiver.last_transfer is not None and receiver.last_transfer.nbytes > 5 * 4 * 4 * 2


def test_receive_into_is_used_unless_the_transport_has_its_own_state_dict() -> None:
    loop = Loopback()
    state = _state()
    for _ in range(2):
        PGTransport[dict[str, Any]](loop, TIMEOUT).send_checkpoint([1], 3, state)
    set_by_manager = {"w": torch.zeros(5, 4)}
    own = {"w": torch.zeros(5, 4)}
    receiver = PGTransport[dict[str, Any]](loop, TIMEOUT)
    receiver.receive_into = lambda: set_by_manager
    got = receiver.recv_checkpoint(0, "<n/a>", 3)
    assert got["w"].data_ptr() == set_by_manager["w"].data_ptr()
    receiver = PGTransport[dict[str, Any]](loop, TIMEOUT, state_dict=lambda: own)
    receiver.receive_into = lambda: set_by_manager
    got = receiver.recv_checkpoint(0, "<n/a>", 3)
    assert got["w"].data_ptr() == own["w"].data_ptr()
    assert torch.equal(own["w"], state["w"])


def test_a_long_header_is_refused_before_it_is_received() -> None:
    loop = Loopback()
    prefix = struct.pack("<8sQQII", _wire.MAGIC, _wire.MAX_HEADER_BYTES + 1, 0, 0, 0)
    loop.queues[1] = [torch.frombuffer(bytearray(prefix), dtype=torch.uint8)]
    with pytest.raises(CheckpointError, match="at most"):
        PGTransport[dict[str, Any]](loop, TIMEOUT).recv_checkpoint(0, "<n/a>", 1)
    assert [tag for tag, _ in loop.received] == [1]


def test_send_refuses_what_cannot_travel_before_sending_anything() -> None:
    loop = Loopback()
    with pytest.raises(TypeError, match=r"state_dict\['fn'\]"):
        PGTransport[dict[str, Any]](loop, TIMEOUT).send_checkpoint([1], 3, {"fn": print})
    assert loop.sent == []
