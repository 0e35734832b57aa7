"""Quantized allreduce: the wire formats, their error bounds, and the collective
over a simulated group of distinct ranks (all ranks must agree bit for bit)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftdist.collectives import (
    BLOCK,
    allreduce_quantized,
    check_allreduce,
    decode,
    encode,
    quantization_mode,
    quantize_int8,
)
from ftdist.process_group.work import CompletedWork

pytestmark = pytest.mark.timeout(60)

# fp32 rounding of the decode and the sum, relative to the values summed.
FP32_SLACK = 4 * 2**-24


def _inputs(kind: str, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    if kind == "scaled":
        return x * 1000
    if kind == "tiny":
        return x * 1e-30
    if kind == "mixed":
        # Blocks of very different magnitudes: per-block scales matter.
        scale = torch.logspace(-6, 6, steps=-(-numel // BLOCK)).repeat_interleave(BLOCK)[:numel]
        return x * scale
    if kind == "sparse":
        return torch.where(torch.rand(numel, generator=g) < 0.9, torch.zeros(numel), x)
    return x


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per element: the largest magnitude in its block."""
    rows = -(-x.numel() // BLOCK)
    padded = torch.zeros(rows * BLOCK)
    padded[: x.numel()] = x.abs()
    return padded.view(rows, BLOCK).amax(dim=1).repeat_interleave(BLOCK)[: x.numel()]


def _total(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(tensors)`` of at least one tensor (typed: the builtin starts from the int 0)."""
    total = sum(tensors)
    assert isinstance(total, torch.Tensor)
    return total


def _bound(mode: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The documented per-element bound on |decoded sum - exact sum|."""
    magnitude = _total(x.double().abs() for x in inputs)
    if mode == "int8":
        quant = _total(_block_absmax(x).double() / 254 for x in inputs)
    else:
        quant = magnitude * 2**-8
    return quant + magnitude * FP32_SLACK + 1e-45


KINDS = ["normal", "scaled", "tiny", "mixed", "sparse"]
SIZES = [1, BLOCK - 1, BLOCK, 3 * BLOCK + 7, 4096]


@pytest.mark.parametrize("mode", ["int8", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel", SIZES)
def test_one_rank_round_trip_is_within_the_bound(mode: str, kind: str, numel: int) -> None:
    x = _inputs(kind, numel, seed=numel)
    wire = encode(x, mode)
    assert wire.dtype == torch.uint8
    rows = -(-numel // BLOCK)
    assert wire.numel() == (numel + 4 * rows if mode == "int8" else 2 * numel)
    err = (decode(wire, numel, mode).double() - x.double()).abs()
    assert bool((err <= _bound(mode, [x])).all()), err.max()


@pytest.mark.parametrize("mode", ["int8", "bf16"])
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_a_sum_over_ranks_is_within_the_bound(mode: str, world: int, kind: str) -> None:
    inputs = [_inputs(kind, 1000, seed=10 * world + r) for r in range(world)]
    total = torch.zeros(1000)
    for x in inputs:
        total += decode(encode(x, mode), 1000, mode)
    exact = sum(x.double() for x in inputs)
    err = (total.double() - exact).abs()
    assert bool((err <= _bound(mode, inputs)).all()), err.max()


def test_int8_uses_the_whole_range_and_zero_blocks_stay_zero() -> None:
    x = torch.cat([torch.zeros(BLOCK), torch.linspace(-3, 3, BLOCK)])
    q, scales = quantize_int8(x)
    assert scales[0] == 0 and bool((q[0] == 0).all())
    assert q[1].min() == -127 and q[1].max() == 127
    assert torch.equal(decode(encode(x, "int8"), 2 * BLOCK, "int8")[:BLOCK], torch.zeros(BLOCK))


def test_a_non_finite_value_poisons_its_block_only() -> None:
    x = torch.randn(2 * BLOCK)
    x[5] = float("inf")
    out = decode(encode(x, "int8"), 2 * BLOCK, "int8")
    assert bool(out[:BLOCK].isnan().all())
    assert bool(out[BLOCK:].isfinite().all())


def test_wrong_lengths_and_modes_are_refused() -> None:
    wire = encode(torch.ones(10), "int8")
    with pytest.raises(ValueError, match="do not encode"):
        decode(wire, 11, "int8")
    with pytest.raises(ValueError, match="unknown quantization mode"):
        encode(torch.ones(3), "fp4")
    with pytest.raises(ValueError, match="1-D"):
        quantize_int8(torch.ones(2, 2))


@pytest.mark.parametrize(
    ("value", "mode"),
    [(False, None), (None, None), (True, "int8"), ("int8", "int8"), ("bf16", "bf16")],
)
def test_should_quantize_values(value: Any, mode: str | None) -> None:
    assert quantization_mode(value) == mode


def test_bad_allreduce_arguments_fail_before_sending() -> None:
    with pytest.raises(ValueError, match="should_quantize"):
        quantization_mode("fp8")
    with pytest.raises(ValueError, match=r"ReduceOp\.AVG"):
        check_allreduce(torch.ones(2, dtype=torch.int64), dist.ReduceOp.AVG, False)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        check_allreduce(torch.ones(2, dtype=torch.int64), dist.ReduceOp.SUM, True)
    assert check_allreduce(torch.ones(2), dist.ReduceOp.MAX, "bf16") == "bf16"


class SimulatedRank:
    """Rank ``rank`` of a group whose other ranks' inputs are known in advance."""

    def __init__(self, rank: int, inputs: list[list[torch.Tensor]], mode: str) -> None:
        self.rank = rank
        self.others = [
            torch.cat([encode(t.reshape(-1).float(), mode) for t in ts]) for ts in inputs
        ]

    def size(self) -> int:
        return len(self.others)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor) -> CompletedWork:
        chunks = output.view(self.size(), -1)
        for r, wire in enumerate(self.others):
            chunks[r].copy_(inp if r == self.rank else wire)
        return CompletedWork(output)


@pytest.mark.parametrize("mode", ["int8", "bf16"])
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_every_rank_computes_the_same_result(mode: str, op: Any) -> None:
    world = 3
    inputs = [
        [_inputs("mixed", 700, seed=r), _inputs("normal", 5, seed=99 + r).reshape(5, 1)]
        for r in range(world)
    ]
    results = []
    for rank in range(world):
        mine = [t.clone() for t in inputs[rank]]
        work = allreduce_quantized(mine, op, SimulatedRank(rank, inputs, mode), mode=mode)
        assert work.wait() and work.is_completed()
        results.append(mine)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
    divisor = world if op == dist.ReduceOp.AVG else 1
    for i in range(2):
        flat = [inputs[r][i].reshape(-1) for r in range(world)]
        exact = sum(x.double() for x in flat) / divisor
        bound = _bound(mode, flat) / divisor
        assert results[0][i].shape == inputs[0][i].shape
        assert bool(((results[0][i].reshape(-1).double() - exact).abs() <= bound).all())


def test_other_ops_and_dtypes_are_refused() -> None:
    group = SimulatedRank(0, [[torch.ones(2)]], "int8")
    with pytest.raises(NotImplementedError, match="only AVG and SUM"):
        allreduce_quantized([torch.ones(2)], dist.ReduceOp.MAX, group)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.PRODUCT)
    with pytest.raises(NotImplementedError):
        allreduce_quantized([torch.ones(2)], opts, group)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        allreduce_quantized([torch.ones(2, dtype=torch.int32)], dist.ReduceOp.SUM, group)


def test_a_failed_gather_fails_the_work() -> None:
    class Failing(SimulatedRank):
        def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor) -> Any:
            from ftdist.testing import _FailedWork

            return _FailedWork(RuntimeError("peer gone"))

    t = torch.ones(4)
    work = allreduce_quantized([t], dist.ReduceOp.SUM, Failing(0, [[t], [t]], "int8"))
    with pytest.raises(RuntimeError, match="peer gone"):
        work.wait()
    assert torch.equal(t, torch.ones(4))  # untouched


@pytest.mark.parametrize("mode", [True, "bf16"])
def test_the_manager_sends_quantized_when_asked(mode: Any) -> None:
    from ftdist.manager import Manager
    from ftdist.testing import FakeManagerClient, FakeProcessGroup, quorum_result

    pg = FakeProcessGroup()
    manager = Manager(
        pg, None, None, min_replica_size=1, client=FakeManagerClient(), timeout=timedelta(seconds=5)
    )
    try:
        manager.register_state_dict_fn("x", lambda sd: None, dict)
        client = manager._client
        assert isinstance(client, FakeManagerClient)
        client.push_quorum(quorum_result(replica_world_size=2, max_world_size=2))
        manager.start_quorum()
        x = _inputs("mixed", 600, seed=3)
        t = x.clone()
        manager.allreduce(t, should_quantize=mode).wait()
        assert manager.should_commit()
        # Two identical peers: the average is this rank's decoded input.
        name = "int8" if mode is True else "bf16"
        assert pg.ops == ["all_gather_single"]
        assert torch.equal(t, decode(encode(x, name), 600, name))
        with pytest.raises(ValueError, match="should_quantize"):
            manager.allreduce(torch.ones(2), should_quantize="fp8")
    finally:
        manager.shutdown()
