"""RankContext.barrier: ranks wait for each other through the run's store."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ftdist.launch.ranks import RankContext, run_ranks


def _late_rank_two(ctx: RankContext) -> tuple[float, float]:
    if ctx.rank == 2:
        time.sleep(0.5)
    arrived = time.time()
    ctx.barrier("late")
    return arrived, time.time()


@pytest.mark.timeout(60)
def test_no_rank_leaves_before_the_last_arrives() -> None:
    results = run_ranks(_late_rank_two, 3, timeout=50)
    # Rank 2 sleeps first, so a barrier that let anyone through early would
    # show a rank leaving before rank 2 arrived.
    last_arrival = max(arrived for arrived, _ in results)
    assert all(left >= last_arrival for _, left in results), results


def _alone(ctx: RankContext) -> str:
    if ctx.rank == 1:
        return "skipped"
    try:
        ctx.barrier("never", timeout=timedelta(milliseconds=300))
    except dist.DistStoreError as exc:
        return f"raised: {exc}"
    return "passed"


@pytest.mark.timeout(60)
def test_a_missing_rank_makes_the_barrier_time_out() -> None:
    alone, skipped = run_ranks(_alone, 2, timeout=50)
    assert skipped == "skipped"
    assert alone.startswith("raised:") and "300ms" in alone, alone
