"""NCCL groups (in-process and Baby): same semantics as Gloo. Skipped without CUDA."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

import pytest
import torch

from ftdist.launch.ranks import RankContext, Ranks, run_ranks

if TYPE_CHECKING:
    from ftdist.process_group import ProcessGroup

pytestmark = [
    pytest.mark.gpu,
    # Two ranks need two devices: NCCL refuses two ranks on one GPU.
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs CUDA with at least 2 GPUs",
    ),
]


def _make(kind: str, timeout: float) -> ProcessGroup:
    from ftdist.process_group import ProcessGroupBabyNCCL, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout) if kind == "nccl" else ProcessGroupBabyNCCL(timeout)


def _device(ctx: RankContext) -> torch.device:
    torch.cuda.set_device(ctx.rank)
    return torch.device("cuda", torch.cuda.current_device())


def _collectives(ctx: RankContext, kind: str) -> list[float]:
    dev = _device(ctx)
    pg = _make(kind, 30)
    out = []
    for i in range(2):  # reconfigure once in between
        pg.configure(ctx.addr(f"c{i}"), ctx.rank, ctx.world_size)
        t = torch.full((1024,), float(ctx.rank + 1), device=dev)
        pg.allreduce([t], torch.distributed.ReduceOp.AVG).wait()
        torch.cuda.synchronize()
        out.append(float(t[0]))
        gathered = [torch.zeros(4, device=dev) for _ in range(ctx.world_size)]
        pg.allgather([gathered], [torch.full((4,), float(ctx.rank), device=dev)]).wait()
        torch.cuda.synchronize()
        out.extend(float(g[0]) for g in gathered)
    pg.shutdown()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["nccl", "baby-nccl"])
def test_nccl_collectives_and_reconfigure(kind: str) -> None:
    for values in run_ranks(_collectives, 2, kind, timeout=170):
        assert values == [1.5, 0.0, 1.0, 1.5, 0.0, 1.0]


def _peer_dies(ctx: RankContext, kind: str) -> str:
    dev = _device(ctx)
    pg = _make(kind, 5)
    pg.configure(ctx.addr("p"), ctx.rank, ctx.world_size)
    t = torch.ones(1 << 20, device=dev)
    pg.allreduce([t]).wait()
    torch.cuda.synchronize()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        pg.allreduce([t]).wait()
        torch.cuda.synchronize()
        result = "no error"
    except Exception as exc:
        result = f"{type(exc).__name__} after {time.monotonic() - start:.1f}s"
    pg.configure(ctx.addr("alone"), 0, 1)
    pg.allreduce([t]).wait()
    torch.cuda.synchronize()
    pg.shutdown()
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["nccl", "baby-nccl"])
def test_nccl_dead_peer_raises_and_group_recovers(kind: str) -> None:
    with Ranks(_peer_dies, 2, args=(kind,)) as ranks:
        outcome = ranks.join(timeout=100, only=[0])[0]
    assert outcome.ok, outcome.error
    assert outcome.value != "no error"
