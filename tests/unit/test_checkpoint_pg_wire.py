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


def _gloo_route(loop: Loopback) -> PGTransport[dict[str, Any]]:
    """A sender whose tensors travel as messages (a direct read needs a peer
    that answers while the sender waits: another thread or process)."""
    return PGTransport[dict[str, Any]](loop, TIMEOUT, direct_reads=False)


def _state() -> dict[str, Any]:
    w = torch.randn(5, 4)
    return {"w": w, "w_t": w.t(), "empty": torch.empty(0), "meta": {"step": 3, "lr": 0.5}}


def test_every_message_travels_on_the_transport_device() -> None:
    loop = Loopback()
    # "meta" stands in for an accelerator: no data, but a device of its own.
    PGTransport[dict[str, Any]](loop, TIMEOUT, device="meta").send_checkpoint([1], 3, _state())
    assert {device.type for _, device in loop.sent} == {"meta"}
    # prefix, header, the three small tensors (one empty) in one batch, trailer
    assert [tag for tag, _ in loop.sent] == [1, 2, 16, 3]


def test_round_trip_in_place_only_into_matching_tensors() -> None:
    loop = Loopback()
    state = _state()
    _gloo_route(loop).send_checkpoint([1], 3, state)
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
        _gloo_route(loop).send_checkpoint([1], 3, state)
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
        _gloo_route(loop).send_checkpoint([1], 3, {"fn": print})
    assert loop.sent == []


def _many_small() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {f"b{i}": torch.randn(i % 7, generator=g) for i in range(300)}
    state["big"] = torch.randn(100_000, generator=g)  # 400 KB: a message of its own
    state["after"] = [torch.randn(3, generator=g).half() for _ in range(5)]  # 6 bytes each
    return state


def _send_one_message_per_tensor(loop: Loopback, step: int, state: Any) -> None:
    """What a sender from before batches put on the wire: no flag, one message per tensor."""
    from ftdist.checkpointing._checksum import WordSum

    stream = _wire.plan(state, step)[0]
    on = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8)  # noqa: E731
    loop.send([on(stream.head[: _wire.PREFIX_BYTES])], 1, 1)
    loop.send([on(stream.head[_wire.PREFIX_BYTES :])], 1, 2)
    digest, total = WordSum(), len(stream.head)
    for i, t in enumerate(stream.tensors):
        flat = _wire.flat_bytes(t)
        if flat.numel():
            loop.send([flat], 1, 16 + i)
            _wire.sum_flat(digest, flat)
            total += flat.numel()
    loop.send([on(_wire.trailer_bytes(total, digest))], 1, 3)


@pytest.mark.parametrize("in_place", [False, True])
def test_small_tensors_travel_in_batches_and_arrive_exact(in_place: bool) -> None:
    loop = Loopback()
    state = _many_small()
    _gloo_route(loop).send_checkpoint([1], 3, state)
    # prefix, header, the 300 small ones in one batch, the large one alone,
    # the five after it in one batch, trailer.
    assert [tag for tag, _ in loop.sent] == [1, 2, 16, 16 + 300, 16 + 301, 3]
    mine = _many_small() if in_place else None
    if mine is not None:
        for t in mine.values():
            if isinstance(t, torch.Tensor):
                t.zero_()
    receiver = PGTransport[dict[str, Any]](loop, TIMEOUT, state_dict=lambda: mine or {})
    got = receiver.recv_checkpoint(0, "<n/a>", 3)
    assert_identical(state, got)
    if mine is not None:
        assert got["b5"].data_ptr() == mine["b5"].data_ptr()
        assert got["after"][4].data_ptr() == mine["after"][4].data_ptr()
    assert [tag for tag, _ in loop.received] == [1, 2, 16, 16 + 300, 16 + 301, 3]
    # The transport's sums of each tensor are those of its bytes.
    from ftdist.checkpointing._checksum import WordSum

    sums = receiver.last_transfer.tensor_sums if receiver.last_transfer is not None else {}
    for t in [got["b1"], got["b6"], got["big"], got["after"][2]]:
        digest = WordSum()
        _wire.sum_tensor(digest, t)
        assert sums[(t.data_ptr(), t.numel() * t.element_size())] == digest.total()


def test_a_sender_of_one_message_per_tensor_is_still_understood() -> None:
    loop = Loopback()
    state = _many_small()
    _send_one_message_per_tensor(loop, 3, state)
    got = PGTransport[dict[str, Any]](loop, TIMEOUT).recv_checkpoint(0, "<n/a>", 3)
    assert_identical(state, got)
    assert len(loop.received) == 3 + sum(
        1 for t in [*state.values(), *state["after"]] if isinstance(t, torch.Tensor) and t.numel()
    )


def test_an_unknown_flag_is_refused_before_anything_else_is_received() -> None:
    loop = Loopback()
    _send_one_message_per_tensor(loop, 3, _many_small())
    head = bytes(loop.queues[1][0].numpy())
    loop.queues[1][0] = torch.frombuffer(bytearray(_wire.with_flags(head, 4)), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"flags 0x4.*same ftdist version"):
        PGTransport[dict[str, Any]](loop, TIMEOUT).recv_checkpoint(0, "<n/a>", 3)
    assert [tag for tag, _ in loop.received] == [1]
    # A stream reader (HTTP) knows no flag: a batched process-group prefix is refused there too.
    with pytest.raises(CheckpointError, match="flags 0x1"):
        _wire.parse_prefix(_wire.with_flags(head, _wire.FLAG_BATCHED), "peer")
