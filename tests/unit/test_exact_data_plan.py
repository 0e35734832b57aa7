"""The exact data plan (ftdist.data.plan) as a ledger: over random sequences of
quorums, commits, failed steps and heals, the committed steps of every epoch
read each position exactly once, each step's shares partition its range, every
group computes the same plan, and the loss scale gives the mean over the step
whatever the quorum. Hypothesis drives the pure rule."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftdist.data.plan import cursor_at, plan_step, share, steps_per_epoch

pytestmark = pytest.mark.timeout(120)

PROPERTY = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass(frozen=True)
class Job:
    dataset_len: int
    micro_batch_size: int
    micro_batches: int  # per step
    group_world_size: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches


def _jobs(most_samples: int) -> st.SearchStrategy[Job]:
    return st.builds(
        Job,
        dataset_len=st.integers(1, most_samples),
        micro_batch_size=st.integers(1, 8),
        micro_batches=st.integers(1, 8),
        group_world_size=st.integers(1, 3),
    )


jobs = _jobs(300)


def _read(job: Job, step: int, participants: int, healing: frozenset[int]) -> Counter[int]:
    """Every position every rank of every group reads at one attempt of ``step``."""
    reads: Counter[int] = Counter()
    ranks = [p for p in range(participants) if p not in healing]
    shapes = set()
    for rank_in_quorum in range(participants):
        for group_rank in range(job.group_world_size):
            plan = plan_step(
                step,
                dataset_len=job.dataset_len,
                global_batch_size=job.global_batch_size,
                micro_batch_size=job.micro_batch_size,
                # A healing group is in the quorum but does not participate.
                participants=len(ranks),
                participant_rank=ranks.index(rank_in_quorum) if rank_in_quorum in ranks else None,
                group_rank=group_rank,
                group_world_size=job.group_world_size,
            )
            shapes.add((plan.epoch, plan.start, plan.end, plan.micro_batches))
            for positions in plan.positions:
                reads.update(positions)
    # Every group and rank computes the same step: range and micro-batches.
    assert len(shapes) == 1, shapes
    return reads


@st.composite
def histories(draw: st.DrawFn) -> tuple[Job, list[tuple[int, frozenset[int], bool]]]:
    # A history costs a plan per group and rank per step; datasets of up to
    # 100 samples give epochs of 1 to 100 steps, which holds every case of
    # the rule (partial last steps, epochs of one step) at a third of the time.
    job = draw(_jobs(100))
    epochs = draw(st.integers(1, 3))
    attempts: list[tuple[int, frozenset[int], bool]] = []
    committed = 0
    needed = epochs * steps_per_epoch(job.dataset_len, job.global_batch_size)
    while committed < needed:
        groups = draw(st.integers(1, 5))
        # Some groups heal (in the quorum, not participating); one at least trains.
        healing = frozenset(draw(st.sets(st.integers(0, groups - 1), max_size=groups - 1)))
        commits = draw(st.booleans()) or len(attempts) > 3 * needed
        attempts.append((groups, healing, commits))
        committed += commits
    return job, attempts


@PROPERTY
@given(case=histories())
def test_committed_steps_read_every_position_of_every_epoch_exactly_once(
    case: tuple[Job, list[tuple[int, frozenset[int], bool]]],
) -> None:
    job, attempts = case
    by_epoch: dict[int, Counter[int]] = {}
    step = 0
    for groups, healing, commits in attempts:
        reads = _read(job, step, groups, healing)
        plan = plan_step(
            step,
            dataset_len=job.dataset_len,
            global_batch_size=job.global_batch_size,
            micro_batch_size=job.micro_batch_size,
            participants=1,
            participant_rank=0,
        )
        # The shares of one attempt partition the step's range, whatever the quorum.
        assert reads == Counter(range(plan.start, plan.end)), (step, groups, healing)
        if commits:  # the cursor moves only on commit; a failed step reads again
            by_epoch.setdefault(plan.epoch, Counter()).update(reads)
            step += 1
    for epoch, reads in by_epoch.items():
        complete = epoch < max(by_epoch) or (
            cursor_at(step, job.dataset_len, job.global_batch_size).position == 0
        )
        if complete:
            assert reads == Counter(range(job.dataset_len)), epoch
        else:
            assert max(reads.values()) == 1


@PROPERTY
@given(
    job=jobs,
    step=st.integers(0, 200),
    participants=st.integers(1, 6),
    data=st.data(),
)
def test_the_loss_scale_gives_the_mean_over_the_step_for_any_quorum(
    job: Job, step: int, participants: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, participants - 1))
    plan = plan_step(
        step,
        dataset_len=job.dataset_len,
        global_batch_size=job.global_batch_size,
        micro_batch_size=job.micro_batch_size,
        participants=participants,
        participant_rank=rank,
        group_world_size=job.group_world_size,
    )
    # AVG over participants and over group ranks: sum * scale / (P * R) per
    # sample summed over everyone = 1 / size per sample.
    per_sample = plan.loss_scale() / (participants * job.group_world_size)
    assert per_sample == pytest.approx(1 / plan.size)
    assert plan.loss_scale("sum", "sum") == pytest.approx(1 / plan.size)
    assert plan.loss_scale("avg", "none") == pytest.approx(participants / plan.size)


@PROPERTY
@given(count=st.integers(0, 100), parts=st.integers(1, 10))
def test_shares_cover_in_order_and_differ_by_at_most_one(count: int, parts: int) -> None:
    bounds = [share(count, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [e - b for b, e in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_an_epochs_last_short_step_is_read_not_dropped() -> None:
    # 10 samples, global batch 4: steps of 4, 4 and 2, then epoch 1.
    plans = [
        plan_step(
            s,
            dataset_len=10,
            global_batch_size=4,
            micro_batch_size=2,
            participants=2,
            participant_rank=1,
        )
        for s in range(4)
    ]
    assert [(p.epoch, p.start, p.end) for p in plans] == [
        (0, 0, 4),
        (0, 4, 8),
        (0, 8, 10),
        (1, 0, 4),
    ]
    # One micro-batch of 2 for two groups: group 1 reads it, group 0 nothing.
    assert plans[2].positions == ((8, 9),)
    assert plans[1].positions == ((6, 7),)


def test_a_group_that_does_not_participate_reads_nothing() -> None:
    plan = plan_step(
        3, dataset_len=100, global_batch_size=8, micro_batch_size=2, participants=2,
        participant_rank=None,
    )  # fmt: skip
    assert plan.positions == () and plan.taken == (0, 0)


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="micro_batch_size \\(3\\) must divide"):
        plan_step(0, dataset_len=10, global_batch_size=8, micro_batch_size=3, participants=1,
                  participant_rank=0)  # fmt: skip
    with pytest.raises(ValueError, match="participant_rank must be in"):
        plan_step(0, dataset_len=10, global_batch_size=8, micro_batch_size=2, participants=1,
                  participant_rank=1)  # fmt: skip
    with pytest.raises(ValueError, match="before the sampler's start_step"):
        cursor_at(1, 10, 2, start_step=5)
