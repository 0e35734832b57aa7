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
