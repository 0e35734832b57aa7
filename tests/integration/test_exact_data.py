"""The exact sampler end to end: real processes, a real lighthouse, SIGKILLs at every point of a step.

(b) On the ``coords`` model (``exact_training``: sample ``i``'s gradient is 1
at coordinate ``i`` only; power-of-two batches, plain SGD with ``lr = G``)
every sum is exact in any order, so after one epoch every replica group,
healed ones included, must hold exactly -1 everywhere whatever failed; and
the ledger of committed steps must show every sample id exactly once.

(c) On a small float32 MLP, the run with a failure must be bit-identical to a
failure-free run up to the first membership change, and within a rounding
bound derived below afterwards.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftdist.launch.ranks import RankContext, Ranks, run_ranks
from tests import _diagnostics
from tests.integration.exact_training import (
    Job,
    accumulated_grad,
    exact_train,
    mlp_data,
    mlp_init,
    mlp_loss,
)
from tests.integration.lighthouse_helpers import Lighthouses


@pytest.fixture
def patient_lighthouse(lh: Lighthouses) -> str:
    """A lighthouse that waits for every live replica group (see ``test_recovery``).

    A group merely late on a loaded machine is never left out of a quorum,
    so the membership changes only where a test kills a group.
    """
    return str(lh.server(join_timeout_ms=30_000, heartbeat_timeout_ms=5_000).address())


# One phase of a run: wait until these ranks died (all of them, or any one
# with ``any_of``), then restart each dead one with these actions.
Phase = tuple[list[int], bool, dict[int, dict[str, Any]]]


def _wait_dead(ranks: Ranks, members: list[int], any_of: bool, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        dead = [r for r in members if ranks.exitcode(r) is not None]
        if (dead and any_of) or len(dead) == len(members):
            break
        assert time.monotonic() < deadline, f"ranks {members} did not die ({dead} did)"
        time.sleep(0.02)
    outcomes = [ranks.outcome(r) for r in dead]
    bad = [o for o in outcomes if o is None or o.exitcode != -9]
    assert not bad, "\n".join(o.describe() for o in bad if o is not None)
    return dead


def _run(
    lighthouse: str,
    world: int,
    group_size: int,
    job: Job,
    actions: dict[int, dict[str, Any]],
    phases: list[Phase],
) -> list[dict[str, Any]]:
    """Run ``world`` ranks; after each phase's deaths restart the dead; return every final result."""
    _diagnostics.watch_glob(Path(job.ledger), "*.jsonl", "exact-data ledger", limit=3000)
    attempts = [0] * world
    with Ranks(exact_train, world, args=(lighthouse, group_size, job, actions)) as ranks:
        for members, any_of, next_actions in phases:
            for r in _wait_dead(ranks, members, any_of):
                attempts[r] += 1
                ranks.restart(r, lighthouse, group_size, job, next_actions, attempts[r])
        outcomes = ranks.join(timeout=100)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    return [o.value for o in outcomes]


def _ledger(folder: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The committed-step lines and the ``killed`` lines of every process of a run.

    (The ``failed`` lines, attempts that did not commit, are for people.)
    """
    lines = [
        json.loads(line)
        for path in sorted(Path(folder).glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    committed = [x for x in lines if "killed" not in x and "failed" not in x]
    return committed, [x for x in lines if "killed" in x]


def _check_ledger(lines: list[dict[str, Any]], job: Job, lacking: set[int]) -> None:
    """Every id of the epoch committed exactly once, and each step's shares partition it.

    Each rank that committed a step logged the step's ids and its own share.
    Only a rank killed between its allreduce and its commit can have taken
    part in a committed step without logging it: ``lacking`` lists the
    steps where that may have happened; every other step's shares must
    cover it exactly.
    """
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        by_step[line["step"]].append(line)
    summary = {
        s: [(x["replica"], x["group_rank"], x["participant_rank"], x["share"]) for x in by_step[s]]
        for s in sorted(by_step)
    }
    assert sorted(by_step) == list(range(job.steps)), (
        f"committed steps {sorted(by_step)}, expected 0..{job.steps - 1}",
        summary,
    )
    epoch: list[int] = []
    for step, logged in sorted(by_step.items()):
        writers = [(x["replica"], x["group_rank"]) for x in logged]
        assert len(set(writers)) == len(writers), (
            f"step {step} committed twice by a rank: {writers}"
        )
        ids = logged[0]["ids"]
        assert all(x["ids"] == ids and x["epoch"] == 0 for x in logged), (step, logged)
        assert len({x["participants"] for x in logged}) == 1, (step, logged)
        assert len(ids) == job.global_batch_size, (step, ids)
        epoch += ids
        shares = [i for x in logged for i in x["share"]]
        assert len(shares) == len(set(shares)), f"step {step}: shares overlap: {summary[step]}"
        assert set(shares) <= set(ids), f"step {step}: read outside the step: {summary[step]}"
        if step not in lacking:
            assert sorted(shares) == sorted(ids), (
                f"step {step} committed, but its samples {sorted(set(ids) - set(shares))} were "
                f"read by no rank that committed it: {summary[step]}"
            )
    assert sorted(epoch) == list(range(job.dataset_len)), (
        "the committed steps do not read every id exactly once",
        summary,
    )


def _assert_minus_one(results: list[dict[str, Any]], job: Job, group_size: int) -> None:
    """Every replica group, healed ones included, holds exactly -1 at every coordinate."""
    expected = torch.full((job.dataset_len,), -1.0)
    by_rank: dict[int, list[torch.Tensor]] = defaultdict(list)
    for r in results:
        assert r["step"] == job.steps, r["step"]
        by_rank[r["group_rank"]].append(torch.tensor(r["theta"]))
    # With one rank per group it holds the whole vector; with more, each
    # rank keeps its own (group_reduce "none") and the ranks' vectors add up.
    for group_rank, thetas in by_rank.items():
        assert all(torch.equal(t, thetas[0]) for t in thetas), f"group rank {group_rank} differs"
    total = torch.stack([thetas[0] for thetas in by_rank.values()]).sum(0)
    wrong = {i: float(v) for i, v in enumerate(total) if v != -1.0}
    assert torch.equal(total, expected), f"coordinates not -1 (0: never read, -2: twice): {wrong}"
    if group_size > 1:
        for thetas in by_rank.values():
            assert set(thetas[0].tolist()) <= {0.0, -1.0}, thetas[0]


CASES = [
    "before_forward",
    "between_micro_batches",
    "after_allreduce",
    "healer_dies_in_load",
    "source_dies_while_serving",
    "async_between_micro_batches",
    "two_rank_groups_before_forward",
]


def _scenario(
    case: str, job: Job, group_size: int
) -> tuple[Job, dict[int, dict[str, Any]], list[Phase], set[str]]:
    """The job, the actions, the restarts and the kills expected of one case."""
    world = (2 if group_size == 2 else 3) * group_size
    victim = 1  # the middle group: the group after it changes places in the split
    if case == "healer_dies_in_load":
        # The replacement dies loading its heal (the survivors' step fails);
        # its own replacement heals and goes on.
        actions: dict[int, dict[str, Any]] = {r: {"hold": {5: 1, 8: 2}} for r in range(world)}
        actions[victim] = {"kill": "before_forward", "kill_at_step": 3}
        phases: list[Phase] = [
            ([victim], False, {victim: {"die_during_heal": True}}),
            ([victim], False, {victim: {}}),
        ]
        expected = {"before_forward", "during_heal"}
        return replace(job, dataset_len=16 * 12, steps=12), actions, phases, expected
    if case == "source_dies_while_serving":
        # Group 2 dies; whichever of 0 and 1 serves its heal dies while the
        # (64 MiB) state streams. Group 2 heals from the other; the dead
        # source restarts and heals too.
        ballast = {"ballast_mb": 64}
        actions = {r: {"hold": {5: 1, 8: 2}, "die_while_serving": True, **ballast} for r in (0, 1)}
        actions[2] = {"kill": "before_forward", "kill_at_step": 3, **ballast}
        phases = [([2], False, {2: dict(ballast)}), ([0, 1], True, {0: ballast, 1: ballast})]
        expected = {"before_forward", "while_serving"}
        return replace(job, dataset_len=16 * 12, steps=12), actions, phases, expected
    point = case.removeprefix("async_").removeprefix("two_rank_groups_")
    victims = [victim * group_size + g for g in range(group_size)]
    actions = {r: {"hold": {6: group_size}} for r in range(world)}
    for r in victims:
        actions[r] = {"kill": point, "kill_at_step": 3}
    return job, actions, [(victims, False, {r: {} for r in victims})], {point}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_every_sample_exactly_once_whatever_is_killed(
    patient_lighthouse: str, tmp_path: Path, case: str
) -> None:
    # 3 replica groups of 1 rank (one case: 2 groups of 2 ranks), one epoch,
    # G=16 in micro-batches of 2: 8 micro-batches a step, so every group has
    # at least 2 (3 groups: 2/3/3; 2 groups: 4/4) and a kill between two of
    # them leaves a share partly read. Each killed group is restarted and
    # heals. Synchronous quorum unless the case says otherwise: a group that
    # heals then reads at the very step it healed to, so its plan must
    # follow the step the heal moved it to. With the asynchronous quorum it
    # reads nothing at that step ([[]]); that case runs without init_sync
    # (see the next test).
    group_size = 2 if case.startswith("two_rank") else 1
    is_async = case.startswith("async")
    job = Job(
        model="coords",
        dataset_len=16 * 10,
        global_batch_size=16,
        micro_batch_size=2,
        steps=10,
        lr=16.0,
        ledger=str(tmp_path),
        async_quorum=is_async,
        init_sync=not is_async,
        # With 2 ranks a group, each rank keeps its own vector: they add up.
        group_reduce="none" if group_size > 1 else "sum",
    )
    job, actions, phases, expected_kills = _scenario(case, job, group_size)
    world = (2 if group_size == 2 else 3) * group_size
    results = _run(patient_lighthouse, world, group_size, job, actions, phases)

    lines, killed = _ledger(job.ledger)
    assert {k["killed"] for k in killed} == expected_kills, killed
    if "between_micro_batches" in expected_kills:
        assert all(k["micro_batches"] >= 2 for k in killed), killed
    # A rank killed after its allreduce took part in a step that may commit
    # without its line (a source killed while serving can too, in the
    # instant between the transfer's last byte and its release).
    lacking = {k["step"] for k in killed if k["killed"] in ("after_allreduce", "while_serving")}
    _check_ledger(lines, job, lacking)
    _assert_minus_one(results, job, group_size)
    restarted = [r for r in results if r["attempt"] > 0]
    assert restarted, results
    for r in restarted:
        assert any(h["role"] == "receive" and h["step"] > 0 for h in r["heals"]), (
            f"replica {r['replica']} (attempt {r['attempt']}) must heal live: {r['heals']}"
        )
        own = [x for x in lines if x["replica"] == r["replica"] and x["attempt"] == r["attempt"]]
        assert any(x["share"] for x in own), f"replica {r['replica']} never read after healing"


@pytest.mark.timeout(60)
def test_async_quorum_with_init_sync_reads_the_first_step_whole(
    patient_lighthouse: str, tmp_path: Path
) -> None:
    job = Job(
        model="coords",
        dataset_len=32,
        global_batch_size=16,
        micro_batch_size=2,
        steps=2,
        lr=16.0,
        ledger=str(tmp_path),
        async_quorum=True,
    )
    results = _run(patient_lighthouse, 2, 1, job, {}, [])
    lines, _ = _ledger(job.ledger)
    _check_ledger(lines, job, set())
    _assert_minus_one(results, job, 1)


# -- (c) a real model: bit-identical up to the first membership change, then within a bound ------

U = 2.0**-24  # float32's unit roundoff


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): any order of summing n+1 terms errs by at most
    gamma_n times the sum of their magnitudes (Accuracy and Stability, 2nd ed., (4.4))."""
    return n * U / (1 - n * U)


@contextmanager
def _one_thread() -> Iterator[None]:
    """The trainers' kernels (one thread), so that a micro-batch's gradient is theirs bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _consensus(results: list[dict[str, Any]], steps: int) -> dict[int, dict[str, Any]]:
    """Each committed step's record, which every group that committed it must share bit for bit."""
    by_step: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for r in results:
        for record in r["records"]:
            by_step[record["step"]].append((r["replica"], record))
    assert sorted(by_step) == list(range(steps)), sorted(by_step)
    agreed = {}
    for step, records in by_step.items():
        first = records[0][1]
        for replica, record in records:
            for key in ("theta", "grad", "ids", "participants"):
                assert record[key] == first[key], f"step {step}: replica {replica}'s {key} differs"
        agreed[step] = first
    return agreed


class _Step:
    """One step recomputed here from the weights it started from: its micro-batches' gradients
    (float32, the trainers' kernels), their sum in order, and the exact (float64) gradient."""

    def __init__(self, theta: torch.Tensor, ids: list[int], job: Job, data: Any) -> None:
        m, size = job.micro_batch_size, job.global_batch_size
        self.theta, self.job, self.data = theta, job, data
        self.parts = [
            accumulated_grad(theta, [ids[i : i + m]], 1.0 / size, data) for i in range(0, size, m)
        ]
        self.sum32 = self.parts[0].clone()
        for part in self.parts[1:]:
            self.sum32 += part
        self.magnitude = torch.stack([p.double().abs() for p in self.parts]).sum(0)
        x, y = (t.double()[torch.tensor(ids)] for t in data)
        self.exact = accumulated_grad(theta.double(), [list(range(size))], 1.0 / size, (x, y))
        self.loss = lambda t: mlp_loss(t, x, y) / size

    def reorder_bound(self) -> torch.Tensor:
        """|a run's reduced gradient - sum32|, any two orders of summing the M micro-batches."""
        return 2 * _gamma(len(self.parts) - 1) * self.magnitude

    def drift(self) -> torch.Tensor:
        """r: the in-order float32 gradient's error against the exact one."""
        return self.sum32.double() - self.exact

    def contraction(self, lr: float) -> float:
        """||I - lr H||_2 at these weights (H: the step's exact Hessian)."""
        hessian = torch.autograd.functional.hessian(self.loss, self.theta.double())
        return float((1 - lr * torch.linalg.eigvalsh(hessian)).abs().max())


def _update_bound(record: dict[str, Any], lr: float) -> torch.Tensor:
    """The rounding of SGD's update: 3u(|w_{t+1}| + lr |g|) per coordinate."""
    after, grad = torch.tensor(record["theta"]).double(), torch.tensor(record["grad"]).double()
    return 3 * U * (after.abs() + lr * grad.abs())


def _one_step_ratio(step: _Step, grad: torch.Tensor, after: torch.Tensor, lr: float) -> float:
    """How far a committed step is from the mean gradient over its samples, in units of the bound.

    At most 1 when (i) the reduced gradient is the step's M micro-batch
    gradients summed in some order (|deviation| <= reorder_bound) and (ii)
    the weights moved by exactly -lr times it, up to the update's three
    roundings (lr to float32, the product, the sum). A micro-batch dropped
    or read twice moves the gradient by that micro-batch's gradient.
    """
    g = grad.double()
    grad_ratio = (g - step.sum32.double()).abs() / step.reorder_bound().clamp_min(1e-300)
    update = step.theta.double() - lr * g
    update_bound = _update_bound({"theta": after.tolist(), "grad": grad.tolist()}, lr)
    update_ratio = (after.double() - update).abs() / update_bound.clamp_min(1e-300)
    return float(max(grad_ratio.max(), update_ratio.max()))


def _negative_control(
    free: dict[int, dict[str, Any]], steps: dict[int, _Step], k: int, lr: float, bounds: list[float]
) -> list[float]:
    """Replay the failure-free run from step ``k`` here with micro-batch 0 of step ``k`` dropped,
    then read twice: each must fail both the one-step check and the trajectory bound.

    Returns:
        The final ||w - w_free|| of each replay.
    """
    gaps = []
    for sign in (-1.0, 1.0):
        step = steps[k]
        grad = torch.tensor(free[k]["grad"]) + sign * step.parts[0]
        after = step.theta.clone().add_(grad, alpha=-lr)
        ratio = _one_step_ratio(step, grad, after, lr)
        assert ratio > 1e3, f"a {'dropped' if sign < 0 else 'doubled'} micro-batch passes: {ratio}"
        theta = after
        for t in range(k + 1, len(free)):
            replay = _Step(theta, free[t]["ids"], steps[t].job, steps[t].data)
            theta = theta.clone().add_(replay.sum32, alpha=-lr)
        gap = float((theta.double() - torch.tensor(free[len(free) - 1]["theta"]).double()).norm())
        assert gap > 10 * bounds[-1], (sign, gap, bounds[-1])
        gaps.append(gap)
    return gaps


@pytest.mark.timeout(150)
def test_real_model_identical_until_the_membership_changes_then_within_rounding(
    lh: Lighthouses, tmp_path: Path
) -> None:
    # A float32 tanh MLP (161 weights) on fixed data, 2 epochs of 8 steps,
    # G=32 in M=8 micro-batches of 4, 3 replica groups, plain SGD. One run
    # has no failure; in the other, group 1 is SIGKILLed before the forward
    # of step K and restarted (it heals at step 8). Synchronous quorum and a
    # patient lighthouse: every quorum before K has all three groups.
    #
    # The tolerance. Up to step K both runs compute the same thing in the
    # same order: bit-identical weights, asserted with ==. From K on, a
    # step's M micro-batches are split over other groups, so their
    # gradients (each one bit-identical for identical weights: same shapes,
    # same one-thread kernels; checked below) are summed in another order.
    # Summing M terms in any order errs by at most gamma_{M-1} sum_b |g_b|,
    # so two orders differ by at most
    #     D_t = 2 gamma_{M-1} sum_b |g_b(w_t)|            (per coordinate),
    # and SGD's update adds at most U_t = 3u(|w_{t+1}| + lr |g_t|) of
    # rounding (lr to float32, the product, the sum). Every committed step
    # of both runs is checked against this one-step bound (rigorous: IEEE
    # rounding only); a dropped or doubled micro-batch exceeds it by orders
    # of magnitude (the negative control below).
    # Across steps the runs' difference d_t = w_F - w_R propagates through
    # SGD: d_{t+1} = (I - lr H_t) d_t + (what step t injects), H_t the
    # step's Hessian, so with rho_t = ||I - lr H_t||_2 (float64, the larger
    # at either run's weights) and Euclidean norms:
    #     B_K = 0,
    #     B_{t+1} = rho_t B_t + lr (|D_t^F| + |D_t^R| + |r_t^F - r_t^R|) + |U_t^F| + |U_t^R|,
    # r_t being (the float32 micro-batch gradients summed in order) minus
    # (the float64 gradient) at each run's weights, measured here (0 at
    # step K, where the weights are equal). We assert ||d_t|| <= 2 B_t: the
    # factor 2 covers H varying along the ~1e-6 segment between the runs.
    # (Seen: ||d|| grows to ~1e-7 against 2B ~ 6e-5 at the end; one micro-
    # batch dropped or doubled at step K ends ~2e-2 away.)
    free_job = Job(
        model="mlp",
        dataset_len=256,
        global_batch_size=32,
        micro_batch_size=4,
        steps=16,
        lr=0.1,
        ledger=str(tmp_path / "free"),
    )
    killed_job = replace(free_job, ledger=str(tmp_path / "killed"))
    for job in (free_job, killed_job):
        Path(job.ledger).mkdir()
    k, victim = 5, 1
    servers = [lh.server(join_timeout_ms=30_000, heartbeat_timeout_ms=5_000) for _ in range(2)]
    free_results = _run(servers[0].address(), 3, 1, free_job, {}, [])
    actions: dict[int, dict[str, Any]] = {r: {"hold": {8: 1}} for r in range(3)}
    actions[victim] = {"kill": "before_forward", "kill_at_step": k}
    killed_results = _run(
        servers[1].address(), 3, 1, killed_job, actions, [([victim], False, {victim: {}})]
    )
    free = _consensus(free_results, free_job.steps)
    killed = _consensus(killed_results, free_job.steps)
    participants = [killed[t]["participants"] for t in range(free_job.steps)]
    assert all(free[t]["participants"] == 3 for t in free), "the failure-free run lost a group"
    assert participants[:k] == [3] * k, participants

    # Bit-identical up to the first membership change.
    for t in range(k):
        assert free[t]["theta"] == killed[t]["theta"], f"step {t} differs before the kill at {k}"

    lr, data, initial = free_job.lr, mlp_data(free_job.dataset_len), mlp_init()
    runs = {"free": (free, free_results), "killed": (killed, killed_results)}

    def before(run: dict[int, dict[str, Any]], t: int) -> torch.Tensor:
        return initial if t == 0 else torch.tensor(run[t - 1]["theta"])

    with _one_thread():
        # Each group's gradient before the allreduce is its micro-batches'
        # gradients accumulated in order, bit for bit, as recomputed here.
        for name, (run, results) in runs.items():
            for result in results:
                for record in result["records"]:
                    t = record["step"]
                    local = accumulated_grad(before(run, t), record["batches"], 1 / 32, data)
                    assert torch.equal(local, torch.tensor(record["local"])), (
                        f"{name} run, step {t}: replica {result['replica']}'s gradient is not its "
                        f"micro-batches' {record['batches']}"
                    )
        worst, bound, bounds, rows = 0.0, 0.0, [], []
        free_steps: dict[int, _Step] = {}
        for t in range(free_job.steps):
            assert free[t]["ids"] == killed[t]["ids"], f"step {t} read other samples"
            step = {
                name: _Step(before(run, t), run[t]["ids"], free_job, data)
                for name, (run, _) in runs.items()
            }
            free_steps[t] = step["free"]
            for name, (run, _) in runs.items():
                grad, after = torch.tensor(run[t]["grad"]), torch.tensor(run[t]["theta"])
                ratio = _one_step_ratio(step[name], grad, after, lr)
                worst = max(worst, ratio)
                assert ratio <= 1, f"{name} run, step {t}: {ratio:.3g} times the one-step bound"
            if t < k:
                continue
            rho = max(step["free"].contraction(lr), step["killed"].contraction(lr))
            drift = float((step["killed"].drift() - step["free"].drift()).norm())
            injected = lr * (sum(float(s.reorder_bound().norm()) for s in step.values()) + drift)
            rounding = sum(float(_update_bound(run[t], lr).norm()) for run, _ in runs.values())
            bound = rho * bound + injected + rounding
            bounds.append(2 * bound)
            gap = float(
                (torch.tensor(killed[t]["theta"]) - torch.tensor(free[t]["theta"])).double().norm()
            )
            rows.append((t, participants[t], rho, gap, 2 * bound))
            assert gap <= 2 * bound, (
                f"after step {t}: ||w_F - w_R|| = {gap:.3g} > 2B = {2 * bound:.3g}"
            )
        controls = _negative_control(free, free_steps, k, lr, bounds)
    print(f"one-step checks: at most {worst:.3g} of the bound")
    print("step, its participants, rho, ||w_F - w_R|| after it, 2B:")
    for t, count, rho, gap, tolerance in rows:
        print(f"  {t:2d}  {count}  {rho:.4f}  {gap:.3g}  {tolerance:.3g}")
    print(f"negative controls (micro-batch dropped, doubled at step {k}): final gap {controls}")


# -- a group whose step fails while it lives on ----------------------------------------------


def _one_group_reports_an_error(ctx: RankContext, lighthouse: str) -> dict[str, Any]:
    from ftdist.data import ExactSampler
    from ftdist.manager import Manager
    from ftdist.process_group import ProcessGroupGloo
    from tests.integration.lighthouse_helpers import wait_for_heartbeats

    n, g = 16, 8
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    theta = torch.nn.Parameter(torch.zeros(n))
    optim = torch.optim.SGD([theta], lr=g)

    def load(state: torch.Tensor) -> None:
        theta.data.copy_(state)

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=lambda: theta.detach(),
        min_replica_size=1,
        use_async_quorum=False,
        replica_id=f"replica{ctx.rank}",
        lighthouse_addr=lighthouse,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
    )
    sampler = ExactSampler(n, manager, global_batch_size=g, micro_batch_size=2, shuffle=False)
    if not wait_for_heartbeats(lighthouse, 2):
        raise TimeoutError("the other group never heartbeat")
    attempts: list[tuple[int, bool]] = []
    try:
        while manager.current_step() < n // g:
            optim.zero_grad()
            manager.start_quorum()
            plan = sampler.plan()
            for ids in sampler.micro_batches(plan):
                loss = theta[torch.tensor(ids, dtype=torch.long)].sum() * plan.loss_scale(
                    "sum", "sum"
                )
                loss.backward()
            if ctx.rank == 1 and not attempts:
                # Its own step fails, and it lives on: user code's error, a heal
                # that could not load. It contributes zeros and votes no.
                manager.report_error(RuntimeError("a bad batch"))
            assert theta.grad is not None
            manager.allreduce(theta.grad, reduce_op=dist.ReduceOp.SUM).wait()
            covered = sampler.verify(plan)
            committed = manager.should_commit()
            attempts.append((plan.step, committed))
            assert covered or not committed
            if committed:
                optim.step()
        return {"attempts": attempts, "theta": theta.detach().tolist()}
    finally:
        manager.shutdown()
        pg.shutdown()


@pytest.mark.timeout(90)
def test_a_group_whose_step_fails_while_it_lives_makes_the_step_fail_everywhere(
    lh: Lighthouses,
) -> None:
    # Without verify(), the other group committed step 0 without group 1's
    # micro-batches, which were then never read (found by this file's tests).
    server = lh.server(min_replicas=2, join_timeout_ms=5000)
    results = run_ranks(_one_group_reports_an_error, 2, server.address(), timeout=75)
    for result in results:
        assert result["attempts"][0] == (0, False), result["attempts"]  # nobody committed it
        assert result["attempts"][1] == (0, True), result["attempts"]  # issued again whole
        assert result["theta"] == [-1.0] * 16, result["theta"]
