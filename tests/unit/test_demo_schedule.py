"""The demo's failure plan and injection rule (pure functions), exhaustively."""

from __future__ import annotations

import collections
import itertools

import pytest

from ftdist.demo import schedule
from ftdist.demo.schedule import Injection, ReplicaHealth

pytestmark = pytest.mark.timeout(60)

DURATIONS = [1, 5, 10, 20, 45, 75, 300]
EVERY = [1, 2.5, 5, 15, 60]


@pytest.mark.parametrize(("duration", "every"), list(itertools.product(DURATIONS, EVERY)))
def test_plan_shape(duration: float, every: float) -> None:
    for seed in range(25):
        plan = schedule.plan_injections(seed, duration, every, stop_hold_s=5.0)
        assert plan == schedule.plan_injections(seed, duration, every, 5.0), "not reproducible"
        times = [i.at_s for i in plan]
        assert times == sorted(times)
        assert [i.index for i in plan] == list(range(len(plan)))
        last = duration - min(5.0, every / 2)
        assert all(0 < t <= last for t in times)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        # Rounded to 10 ms, each gap stays within the jitter band.
        assert all(every * 0.8 - 0.011 <= g <= every * 1.2 + 0.011 for g in gaps)
        kinds = [i.kind for i in plan]
        if plan:
            assert kinds.count(schedule.STOP) == 1, kinds
            assert kinds.index(schedule.STOP) == (1 if len(plan) >= 2 else 0)
            stop = plan[kinds.index(schedule.STOP)]
            assert stop.hold_s == 5.0
            assert all(i.hold_s == 0 for i in plan if i.kind == schedule.KILL)
        # The next injection after the last one would have fallen past the guard.
        assert last - (times[-1] if times else 0.0) < every * 1.2 + 0.011


def test_ci_and_default_plans_have_kills_and_a_stop() -> None:
    for seed in range(50):
        for duration, every in ((20, 5), (75, 15)):
            kinds = [i.kind for i in schedule.plan_injections(seed, duration, every, 5.0)]
            assert schedule.STOP in kinds and schedule.KILL in kinds, (seed, kinds)


def test_seeds_give_different_plans() -> None:
    plans = {tuple(i.at_s for i in schedule.plan_injections(s, 300, 15, 5.0)) for s in range(20)}
    assert len(plans) == 20


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("duration_s", {"duration_s": 0}),
        ("kill_every_s", {"kill_every_s": -1}),
        ("stop_hold_s", {"stop_hold_s": 0}),
    ],
)
def test_plan_rejects_bad_values(name: str, kwargs: dict[str, float]) -> None:
    args = {"seed": 0, "duration_s": 10.0, "kill_every_s": 2.0, "stop_hold_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match=name):
        schedule.plan_injections(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("replicas", [1, 2, 3, 5, 8])
def test_victims_cover_every_replica_evenly(replicas: int) -> None:
    counts = collections.Counter(
        schedule.choose_victim(seed, Injection(i, 1.0, schedule.KILL), replicas)
        for seed in range(40)
        for i in range(50)
    )
    assert set(counts) == set(range(replicas))
    expected = 2000 / replicas
    assert all(abs(c - expected) < 0.25 * expected for c in counts.values()), counts


def test_victim_rejects_no_replicas() -> None:
    with pytest.raises(ValueError, match="replicas"):
        schedule.choose_victim(0, Injection(0, 1.0, schedule.KILL), 0)


PLAN = [Injection(0, 10.0, schedule.KILL), Injection(1, 20.0, schedule.STOP, 5.0)]


def _health(*flags: bool) -> list[ReplicaHealth]:
    return [ReplicaHealth(r, ok, "" if ok else "healing") for r, ok in enumerate(flags)]


@pytest.mark.parametrize("flags", list(itertools.product([True, False], repeat=3)))
@pytest.mark.parametrize("now", [0.0, 9.99, 10.0, 10.4, 15.0, 25.0])
def test_decide_every_health_combination(flags: tuple[bool, ...], now: float) -> None:
    decision = schedule.decide(now, PLAN, _health(*flags), seed=7)
    if now < 10.0:
        assert decision.injection is None and decision.victim is None
        assert "due at 10.0 s" in decision.reason
    elif not all(flags):
        assert decision.injection is None
        assert "postponed" in decision.reason
        for r, ok in enumerate(flags):
            assert (f"replica{r} healing" in decision.reason) == (not ok)
    else:
        assert decision.injection == PLAN[0]
        assert decision.victim == schedule.choose_victim(7, PLAN[0], 3)
        assert f"replica{decision.victim}" in decision.reason
        assert ("late" in decision.reason) == (now - 10.0 >= 0.5)


def test_decide_without_plan_or_peer() -> None:
    assert (
        schedule.decide(50.0, [], _health(True, True), 0).reason == "no injection left in the plan"
    )
    lone = schedule.decide(50.0, PLAN, _health(True), 0)
    assert lone.injection is None and "no peer" in lone.reason
    with pytest.raises(ValueError, match="health"):
        schedule.decide(0.0, PLAN, [], 0)


# -- the replicated lighthouse's "kill the leader" ------------------------------------------


@pytest.mark.parametrize(("duration", "every"), list(itertools.product(DURATIONS, EVERY)))
def test_leader_kills_fall_halfway_between_the_group_failures(
    duration: float, every: float
) -> None:
    for seed in range(25):
        groups_only = schedule.plan_injections(seed, duration, every, 5.0)
        plan = schedule.plan_injections(seed, duration, every, 5.0, leader_kills=True)
        assert plan == schedule.plan_injections(seed, duration, every, 5.0, True)
        assert [i.index for i in plan] == list(range(len(plan)))
        assert [i.at_s for i in plan] == sorted(i.at_s for i in plan)
        # The groups' failures are those of the plan without the flag.
        others = [(i.at_s, i.kind, i.hold_s) for i in plan if i.kind != schedule.LEADER]
        assert others == [(i.at_s, i.kind, i.hold_s) for i in groups_only]
        leaders = [i for i in plan if i.kind == schedule.LEADER]
        assert len(leaders) <= schedule.MAX_LEADER_KILLS
        assert all(i.hold_s == 0 for i in leaders)
        last = duration - min(5.0, every / 2)
        bounds = [0.0, *(i.at_s for i in groups_only), last]
        for leader in leaders:
            before = max(b for b in bounds if b < leader.at_s)
            after = min(b for b in bounds if b > leader.at_s)
            assert leader.at_s == pytest.approx((before + after) / 2, abs=0.006)
        if len(groups_only) >= 2:
            # Between two group failures, never before the first or after the last.
            assert leaders and all(
                groups_only[0].at_s < i.at_s < groups_only[-1].at_s for i in leaders
            )


def test_default_and_test_plans_kill_the_leader_once_or_twice() -> None:
    for seed in range(50):
        for (duration, every), want in (((75, 15), 2), ((40, 15), 1), ((20, 5), {1, 2})):
            plan = schedule.plan_injections(seed, duration, every, 5.0, leader_kills=True)
            count = [i.kind for i in plan].count(schedule.LEADER)
            assert count in (want if isinstance(want, set) else {want}), (seed, plan)
        plain = schedule.plan_injections(seed, 75, 15, 5.0)
        assert schedule.LEADER not in [i.kind for i in plain]


@pytest.mark.parametrize(
    ("times", "last", "expected"),
    [
        ([], 10.0, [5.0]),  # no group failure: halfway through the run
        ([4.0], 10.0, [7.0]),  # one: the wider side of it
        ([2.0, 4.0], 10.0, [3.0]),  # the one gap between two
        ([2.0, 4.0, 6.0], 10.0, [5.0]),  # the middle of two gaps
        ([2.0, 4.0, 6.0, 8.0], 10.0, [3.0, 7.0]),  # the first and the last of three
        ([1.0, 2.0, 3.0, 4.0, 5.0], 6.0, [1.5, 4.5]),
        ([], -4.0, []),  # a run too short for any failure
    ],
)
def test_leader_times(times: list[float], last: float, expected: list[float]) -> None:
    assert schedule.leader_times(times, last) == expected


LEADER_PLAN = [Injection(0, 10.0, schedule.LEADER), Injection(1, 20.0, schedule.KILL)]


@pytest.mark.parametrize("flags", list(itertools.product([True, False], repeat=3)))
@pytest.mark.parametrize("busy", ["", "lighthouse failover #0 under way"])
def test_decide_kills_the_leader_only_when_all_is_calm(flags: tuple[bool, ...], busy: str) -> None:
    decision = schedule.decide(12.0, LEADER_PLAN, _health(*flags), 7, lighthouse_busy=busy)
    assert decision.victim is None
    if all(flags) and not busy:
        assert decision.injection == LEADER_PLAN[0]
        assert "kill the leader lighthouse (due at 10.0 s, 2.0 s late)" == decision.reason
    else:
        assert decision.injection is None
        assert decision.reason.startswith("leader-lighthouse kill postponed: ")
        assert ("under way" in decision.reason) == bool(busy)
        for r, ok in enumerate(flags):
            assert (f"replica{r} healing" in decision.reason) == (not ok)


def test_a_busy_lighthouse_postpones_group_failures_too() -> None:
    decision = schedule.decide(
        25.0, LEADER_PLAN[1:], _health(True, True, True), 7, "lighthouse replica 1 not running"
    )
    assert decision.injection is None and decision.victim is None
    assert decision.reason == "kill postponed: lighthouse replica 1 not running"
    calm = schedule.decide(25.0, LEADER_PLAN[1:], _health(True, True, True), 7)
    assert calm.injection == LEADER_PLAN[1] and calm.victim is not None
