"""GroupCoordinator over NCCL (torch groups and ftdist groups). Skipped without 2 GPUs."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from ftdist.launch.ranks import RankContext, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs CUDA with at least 2 GPUs",
    ),
]


def _nccl(ctx: RankContext, mode: str) -> None:
    import torch.distributed as dist

    from ftdist.coordinator import (
        destroy_distributed_environment,
        destroy_model_parallel,
        get_tp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.cuda.set_device(ctx.rank)
    if mode == "torch":
        dist.init_process_group("nccl", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
        init_distributed_environment(ctx.world_size, ctx.rank, None, ctx.rank, "nccl")
    else:
        init_distributed_environment(
            ctx.world_size,
            ctx.rank,
            ctx.addr("nccl"),
            ctx.rank,
            "ftdist-nccl",
            timedelta(seconds=60),
        )
    initialize_model_parallel(2, 1)
    tp = get_tp_group()
    assert tp.device == torch.device("cuda", ctx.rank)
    dev = tp.device
    x = torch.arange(8, dtype=torch.float32, device=dev) * (ctx.rank + 1)
    assert torch.equal(tp.all_reduce(x), torch.arange(8, dtype=torch.float32, device=dev) * 3)
    y = torch.full((2, 3), float(ctx.rank), device=dev)
    got = tp.all_gather(y, dim=1)
    assert torch.equal(got, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], 1).to(dev))
    z = torch.ones(4, 6, 2, device=dev)
    assert torch.equal(tp.reduce_scatter(z, dim=1), torch.full((4, 3, 2), 2.0, device=dev))
    d = {
        "a": torch.arange(8, device=dev, dtype=torch.float32),
        "b": torch.arange(16, dtype=torch.int8),
        "c": "test",
        "f": torch.tensor([], device=dev),
    }
    out = tp.broadcast_tensor_dict(d if ctx.rank == 0 else None, src=0)
    assert out is not None and out["a"].is_cuda and out["b"].is_cpu
    assert torch.equal(out["a"].cpu(), torch.arange(8, dtype=torch.float32))
    assert torch.equal(out["b"], torch.arange(16, dtype=torch.int8)) and out["c"] == "test"
    with tp.graph_capture() as ctx_capture:
        assert ctx_capture.stream is not None
    if ctx.rank == 0:
        tp.send(torch.arange(4, device=dev))
    else:
        assert torch.equal(tp.recv(4, torch.int64).cpu(), torch.arange(4))
    torch.cuda.synchronize()
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["torch", "ft"])
def test_coordinator_over_nccl(mode: str) -> None:
    run_ranks(_nccl, 2, mode, timeout=240)
