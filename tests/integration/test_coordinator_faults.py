"""A coordinator over ftdist groups survives a member's death and is rebuilt in place.

Four processes serve a two-block MLP as a pipeline of two stages, each
stage tensor-parallel over two ranks (column- then row-parallel, with an
all-reduce), the way vLLM runs a model: stage 0's TP rank 0 broadcasts the
step's input to its TP group (through the shared-memory queue), stage 0
sends its activations to stage 1 as 1/TP slices re-assembled by an
all-gather, and the output is broadcast to every rank.

Rank 3 dies (SIGKILL) at the start of step 3. Every survivor's operation in
flight must fail with an ftdist error, not a timeout; then the survivors
rebuild the same coordinator objects as one tensor-parallel group of three
(``reconfigure_model_parallel``) and must compute exactly what a single
process computes, for every step. Weights and inputs are small integers in
float64, so every sum is exact whatever the order.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from ftdist.launch.ranks import RankContext, Ranks

D, H, STEPS, DIES_AT = 6, 12, 6, 3


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"{k}{b}": torch.randint(-3, 4, shape, generator=gen).double()
        for b in range(2)
        for k, shape in (("A", (D, H)), ("B", (H, D)))
    }


def _input(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(-3, 4, (4, D), generator=gen).double()


def reference(step: int) -> torch.Tensor:
    w, h = _weights(), _input(step)
    for b in range(2):
        h = torch.relu(h @ w[f"A{b}"]) @ w[f"B{b}"]
    return h


def _block(h: torch.Tensor, w: dict[str, torch.Tensor], b: int) -> torch.Tensor:
    from ftdist.coordinator import get_tp_group

    tp = get_tp_group()
    shard = H // tp.world_size
    cols = slice(tp.rank_in_group * shard, (tp.rank_in_group + 1) * shard)
    partial = torch.relu(h @ w[f"A{b}"][:, cols]) @ w[f"B{b}"][cols, :]
    return tp.all_reduce(partial)


def _step(step: int, w: dict[str, torch.Tensor]) -> torch.Tensor:
    from ftdist.coordinator import get_pp_group, get_tp_group, get_world_group

    tp, pp, world = get_tp_group(), get_pp_group(), get_world_group()
    if pp.is_first_rank:
        x = {"x": _input(step), "step": step} if tp.rank_in_group == 0 else None
        msg = tp.broadcast_tensor_dict(x, src=0)
        assert msg is not None and msg["step"] == step
        h = msg["x"]
    else:
        msg = pp.recv_tensor_dict(all_gather_group=tp)
        assert msg is not None
        h = msg["hidden"]
    per_stage = 2 // pp.world_size
    for b in range(pp.rank_in_group * per_stage, (pp.rank_in_group + 1) * per_stage):
        h = _block(h, w, b)
    if not pp.is_last_rank:
        pp.send_tensor_dict({"hidden": h}, all_gather_group=tp)
    # The output lives on the last stage's TP rank 0; everyone gets it.
    src = (pp.world_size - 1) * tp.world_size
    out = world.broadcast_tensor_dict({"out": h} if world.rank_in_group == src else None, src=src)
    assert out is not None
    result: torch.Tensor = out["out"]
    return result


def _serve(ctx: RankContext) -> dict[str, Any]:
    from ftdist.coordinator import (
        destroy_distributed_environment,
        destroy_model_parallel,
        get_pp_group,
        get_tp_group,
        init_distributed_environment,
        initialize_model_parallel,
        reconfigure_model_parallel,
    )
    from ftdist.errors import CollectiveTimeoutError, CommunicationError

    init_distributed_environment(
        ctx.world_size, ctx.rank, ctx.addr("epoch0"), ctx.rank, "ftdist-gloo", timedelta(seconds=30)
    )
    initialize_model_parallel(2, 2)
    tp, pp = get_tp_group(), get_pp_group()
    w = _weights()
    outputs: dict[int, list[float]] = {}
    error: Exception | None = None
    failed_at = None
    for step in range(STEPS):
        if ctx.rank == 3 and step == DIES_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            outputs[step] = _step(step, w).flatten().tolist()
        except CommunicationError as exc:
            error, failed_at = exc, step
            break
    assert error is not None, "the survivors never noticed rank 3's death"
    # The failure was detected, not waited out.
    assert not isinstance(error, CollectiveTimeoutError), repr(error)

    # A supervisor (here the test) names the survivors and a fresh store prefix.
    store = ctx.store()
    store.wait(["survivors"], timedelta(seconds=60))
    survivors = [int(r) for r in store.get("survivors").decode().split(",")]
    reconfigure_model_parallel(
        ctx.addr("epoch1"), survivors, tensor_model_parallel_size=3, pipeline_model_parallel_size=1
    )
    assert (tp.world_size, tp.ranks, pp.world_size) == (3, survivors, 1)
    assert tp is get_tp_group() and pp is get_pp_group()  # the same objects, rebuilt
    assert tp.mq_broadcaster is not None  # rebuilt for the new membership
    after = {step: _step(step, w).flatten().tolist() for step in range(STEPS)}
    destroy_model_parallel()
    destroy_distributed_environment()
    return {
        "before": outputs,
        "after": after,
        "failed_at": failed_at,
        "error": f"{type(error).__name__}: {error}",
    }


@pytest.mark.timeout(180)
def test_survivors_rebuild_a_smaller_layout_that_computes_the_same() -> None:
    with Ranks(_serve, 4) as ranks:
        deadline = time.monotonic() + 60
        while ranks.exitcode(3) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ranks.exitcode(3) == -signal.SIGKILL
        ranks.parent_store().set("survivors", "0,1,2")
        outcomes = ranks.join(timeout=120)
    # Every survivor's outcome: one that waits on another is explained by it.
    bad = [o for o in outcomes[:3] if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    want = {step: reference(step).flatten().tolist() for step in range(STEPS)}
    for o in outcomes[:3]:
        got = o.value
        assert got["failed_at"] == DIES_AT, got
        assert got["before"] == {s: want[s] for s in range(DIES_AT)}
        assert got["after"] == want
