"""Replicas that must hold the same state do: a replica that drifts apart, or
that started apart, heals from the majority; state that may differ (BatchNorm
statistics) never stalls the job."""

from __future__ import annotations

from typing import Any

import pytest

from ftdist.launch.ranks import Ranks
from tests.integration.ft_training import train
from tests.integration.lighthouse_helpers import Lighthouses
from tests.integration.test_manager import assert_consistent
from tests.integration.test_recovery import SLOW, _run, _wait_dead

pytestmark = pytest.mark.slow


@pytest.fixture
def patient_lighthouse(lh: Lighthouses) -> str:
    """Waits for every live replica group (see test_recovery.patient_lighthouse)."""
    return str(lh.server(join_timeout_ms=30_000, heartbeat_timeout_ms=5_000).address())


def _receives(result: dict[str, Any]) -> list[int]:
    return [h["step"] for h in result["heals"] if h["role"] == "receive"]


@pytest.mark.timeout(120)
def test_a_replica_that_drifts_apart_heals_from_the_majority(patient_lighthouse: str) -> None:
    # Replica 2 silently corrupts its weights after step 10; the replicas
    # compare fingerprints every 5 steps, see replica 2 apart from the
    # majority, and it heals from them. Nobody fails a step for it.
    steps = 30
    check = {"manager_kwargs": {"check_consistency_every": 5}, "finishers": 3, **SLOW}
    actions = {0: dict(check), 1: dict(check), 2: {**check, "corrupt_at_step": 10}}
    results = _run(patient_lighthouse, 3, 1, steps, actions, [])
    assert_consistent(results, steps, complete=True)
    by_replica = {r["replica"]: r for r in results}
    assert [s for s in _receives(by_replica[2]) if s > 10], by_replica[2]["heals"]
    # assert_consistent checked that each replica committed every step from
    # where it joined: healing the drifted replica cost nobody a step.


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seeds", [(1, 2, 1), (1, 2)], ids=["majority", "tie"])
def test_replicas_that_start_apart_converge_on_one_history(
    lh: Lighthouses, seeds: tuple[int, ...]
) -> None:
    # Without init_sync every replica keeps its own initial weights: two
    # histories of the same step. The minority (a tie: the replica whose id
    # sorts last) heals from the majority's history.
    steps = 12
    actions = {
        r: {**SLOW, "init_sync": False, "seed": seed, "finishers": len(seeds)}
        for r, seed in enumerate(seeds)
    }
    # Every replica takes step 0 in the first quorum: they all start at the
    # same step, each with its own history.
    lighthouse = lh.server(min_replicas=len(seeds), join_timeout_ms=30_000).address()
    results = _run(lighthouse, len(seeds), 1, steps, actions, [])
    assert_consistent(results, steps, complete=True)
    by_replica = {r["replica"]: r for r in results}
    assert _receives(by_replica[1]), "the odd replica never healed"
    assert not _receives(by_replica[0])


@pytest.mark.timeout(240)
def test_batchnorm_statistics_never_stall_a_job_with_kills(patient_lighthouse: str) -> None:
    # Three replica groups of a BatchNorm model, each on its own data (its
    # running statistics differ from the others'); one crashes at step 20 and
    # another at step 120, and each comes back. Every replica commits every
    # step from where it (re)joined, and the weights end bit-identical.
    steps = 200
    base = {"batchnorm": True, "finishers": 3}
    actions: dict[int, dict[str, Any]] = {
        0: dict(base),
        1: {**base, "die_at_step": 20},
        2: {**base, "die_at_step": 120},
    }
    with Ranks(train, 3, args=(patient_lighthouse, 1, steps, actions)) as ranks:
        _wait_dead(ranks, [1])
        ranks.restart(1, patient_lighthouse, 1, steps, {1: dict(base)}, 1)
        _wait_dead(ranks, [2], timeout=120)
        ranks.restart(2, patient_lighthouse, 1, steps, {2: dict(base)}, 1)
        outcomes = ranks.join(timeout=180)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"rank {o.rank}: exit {o.exitcode}\n{o.error}" for o in bad)
    results = [o.value for o in outcomes]
    assert_consistent(results, steps)
    survivor = next(r for r in results if r["replica"] == 0)
    assert survivor["committed"][-1] == steps - 1
    assert not survivor["errors"], survivor["errors"]
