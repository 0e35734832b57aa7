"""The chaos suite's plan and rule (pure functions), exhaustively."""

from __future__ import annotations

import itertools

import pytest

from ftdist.chaos import schedule
from ftdist.chaos.schedule import Armed, GroupHealth, Injection

pytestmark = pytest.mark.timeout(60)


def healthy(n: int) -> list[GroupHealth]:
    return [GroupHealth(g, True, True) for g in range(n)]


@pytest.mark.parametrize(
    ("duration", "gap", "groups", "size"),
    list(itertools.product([10, 75, 600], [(5.0, 15.0), (3.0, 6.0), (1.0, 1.0)], [2, 3], [1, 2])),
)
def test_plan_shape(duration: float, gap: tuple[float, float], groups: int, size: int) -> None:
    for seed in range(20):
        plan = schedule.plan(seed, duration, groups, size, gap_s=gap)
        assert plan == schedule.plan(seed, duration, groups, size, gap_s=gap), "not reproducible"
        assert [i.index for i in plan] == list(range(len(plan)))
        assert all(gap[0] - 0.006 <= i.gap_s <= gap[1] + 0.006 for i in plan)
        assert sum(i.gap_s for i in plan) <= duration * 0.9
        assert all(0 <= i.group < groups and 0 <= i.rank < size for i in plan)
        for i in plan:
            low, high = schedule.HOLDS.get(i.kind, (0.0, 0.0))
            assert low - 0.006 <= i.hold_s <= high + 0.006, i
        kinds = [i.kind for i in plan]
        first = kinds[: len(schedule.KINDS)]
        # Every kind once before any repeats.
        assert len(set(first)) == len(first), first
        if len(plan) >= len(schedule.KINDS):
            assert set(first) == set(schedule.KINDS)


def test_plan_uses_only_the_kinds_asked_for() -> None:
    for seed in range(30):
        plan = schedule.plan(seed, 300, 3, 2, kinds=(schedule.KILL, schedule.STOP))
        assert {i.kind for i in plan} == {schedule.KILL, schedule.STOP}


def test_the_default_full_and_short_plans_hold_every_kind() -> None:
    for seed in range(20):
        full = schedule.plan(seed, 600, 3, 2)
        short = schedule.plan(seed, 75, 3, 2, gap_s=(3.0, 6.0))
        assert {i.kind for i in full} == set(schedule.KINDS)
        assert {i.kind for i in short} == set(schedule.KINDS), [i.kind for i in short]


def test_an_ordered_plan_keeps_the_first_round_in_order() -> None:
    kinds = (schedule.KILL, schedule.STOP, schedule.LIGHTHOUSE)
    for seed in range(10):
        plan = schedule.plan(seed, 120, 3, 2, kinds=kinds, gap_s=(3.0, 6.0), ordered=True)
        assert tuple(i.kind for i in plan[:3]) == kinds


def test_seeds_give_different_plans() -> None:
    plans = {
        tuple((i.kind, i.group, i.gap_s) for i in schedule.plan(s, 300, 3, 2)) for s in range(20)
    }
    assert len(plans) == 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"duration_s": 0}, "duration_s"),
        ({"groups": 1}, "at least 2 groups"),
        ({"group_size": 0}, "at least 2 groups"),
        ({"gap_s": (0.0, 1.0)}, "gap_s"),
        ({"gap_s": (3.0, 1.0)}, "gap_s"),
        ({"kinds": ("explode",)}, "kinds"),
        ({"kinds": ("kill", "lighthouse-explode")}, "kinds"),
        ({"kinds": ()}, "kinds"),
    ],
)
def test_plan_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"seed": 0, "duration_s": 60.0, "groups": 3, "group_size": 2}
    with pytest.raises(ValueError, match=match):
        schedule.plan(**{**args, **kwargs})  # type: ignore[arg-type]


# -- the rule ------------------------------------------------------------------------------


def test_waits_until_the_gap_since_the_last_strike_passed() -> None:
    inj = Injection(0, 5.0, schedule.KILL, group=1, rank=1)
    d = schedule.decide(9.9, [inj], healthy(3), last_strike_s=5.0)
    assert d.action == "wait" and "due at 10.0" in d.reason
    d = schedule.decide(10.0, [inj], healthy(3), last_strike_s=5.0)
    assert (d.action, d.injection, d.group, d.rank) == ("strike", inj, 1, 1)


def test_nothing_left_to_do() -> None:
    assert schedule.decide(100.0, [], healthy(3), 0.0).action == "wait"


@pytest.mark.parametrize("kind", schedule.ALL_KINDS)
def test_a_strike_names_the_rank_only_for_kills_and_stops(kind: str) -> None:
    d = schedule.decide(50.0, [Injection(0, 1.0, kind, group=5, rank=1)], healthy(3), 0.0)
    assert d.action == "strike" and d.group == 5 % 3
    assert d.rank == (1 if kind in (schedule.KILL, schedule.STOP) else None)


def test_too_few_groups_is_misuse() -> None:
    with pytest.raises(ValueError, match="two replica groups"):
        schedule.decide(0.0, [], healthy(1), 0.0)


STATES = [(True, True), (False, True), (False, False)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_strikes_only_when_every_group_is_healthy(n: int) -> None:
    inj = Injection(0, 1.0, schedule.STOP, group=0, rank=0, hold_s=2.0)
    for states in itertools.product(STATES, repeat=n):
        health = [GroupHealth(g, h, u, why_not="x") for g, (h, u) in enumerate(states)]
        d = schedule.decide(5.0, [inj], health, 0.0)
        if all(h for h, _ in states):
            assert d.action == "strike"
        else:
            assert d.action == "wait" and "postponed" in d.reason
            assert all(f"group {g}" in d.reason for g, (h, _) in enumerate(states) if not h)


def _sources(n: int) -> list[tuple[tuple[int, int], ...]]:
    pairs = [(g, r) for g in range(n) for r in range(2)]
    return [tuple(c) for k in range(3) for c in itertools.combinations(pairs, k)]


@pytest.mark.parametrize("kind", schedule.MID_HEAL)
@pytest.mark.parametrize("n", [2, 3])
def test_mid_heal_follow_ups_exhaustively(kind: str, n: int) -> None:
    provoked = 0
    inj = Injection(0, 1.0, kind, group=provoked)
    armed = Armed(inj, provoked_at_s=10.0)
    for up in itertools.product([True, False], repeat=n - 1):
        for receiving in _sources(n):
            receiving = tuple(s for s in receiving if s[0] != provoked)
            health = [GroupHealth(provoked, False, False, receiving_from=receiving)]
            health += [GroupHealth(g, False, up[g - 1]) for g in range(1, n)]
            for now in (11.0, 10.0 + schedule.ARM_LIMIT_S + 1):
                d = schedule.decide(now, [], health, 0.0, armed)
                if not receiving:
                    late = now > 10.0 + schedule.ARM_LIMIT_S
                    assert d.action == ("abandon" if late else "wait"), (d, now)
                    continue
                if kind == schedule.KILL_HEALING:
                    assert (d.action, d.group) == ("follow-up", provoked)
                    continue
                src = min(receiving)
                others = [g for g in range(1, n) if up[g - 1] and g != src[0]]
                if others:
                    assert (d.action, d.group, d.rank) == ("follow-up", *src), d
                else:
                    # Never the last up-to-date copy of the state.
                    assert d.action == "abandon" and "last up-to-date" in d.reason


def test_an_armed_injection_comes_before_the_next_one() -> None:
    armed = Armed(Injection(0, 1.0, schedule.KILL_HEALING, group=1), 0.0)
    pending = [Injection(1, 1.0, schedule.KILL)]
    d = schedule.decide(30.0, pending, healthy(3), 0.0, armed)
    assert d.action == "wait" and "waiting for group 1" in d.reason


# -- the control-plane kinds (a replicated lighthouse) ---------------------------------------


def test_the_replicated_kinds_put_the_control_plane_in_place_of_the_lighthouse() -> None:
    assert schedule.LIGHTHOUSE not in schedule.REPLICATED_KINDS
    assert set(schedule.REPLICATED_KINDS) == (set(schedule.KINDS) - {schedule.LIGHTHOUSE}) | set(
        schedule.CONTROL_PLANE
    )
    assert set(schedule.ALL_KINDS) == set(schedule.KINDS) | set(schedule.CONTROL_PLANE)
    # An ordered first round still ends with the partitions, the slowest to recover.
    assert schedule.REPLICATED_KINDS[-3:] == schedule.PARTITIONS


@pytest.mark.parametrize("duration", [90, 600])
def test_replicated_plans_hold_every_kind_with_its_victim_and_hold(duration: int) -> None:
    for seed in range(20):
        plan = schedule.plan(seed, duration, 3, 2, schedule.REPLICATED_KINDS, (3.0, 6.0))
        first = [i.kind for i in plan[: len(schedule.REPLICATED_KINDS)]]
        assert set(first) == set(schedule.REPLICATED_KINDS), first
        for i in plan:
            low, high = schedule.HOLDS.get(i.kind, (0.0, 0.0))
            assert low - 0.006 <= i.hold_s <= high + 0.006, i
            if i.kind == schedule.KILL_ETCD_MEMBER:
                assert 0 <= i.member < schedule.ETCD_MEMBERS
            else:
                assert i.member == 0, i
        assert {i.member for i in plan if i.kind == schedule.KILL_ETCD_MEMBER} <= {0, 1, 2}


def test_a_leader_is_stopped_or_cut_past_its_lease() -> None:
    for kind in (schedule.STOP_LEADER_LIGHTHOUSE, schedule.CUT_LIGHTHOUSE_ETCD):
        low, _ = schedule.HOLDS[kind]
        assert low >= schedule.LEASE_TTL_S + 1.0


def test_an_ordered_replicated_plan_strikes_the_control_plane_in_order() -> None:
    kinds = schedule.CONTROL_PLANE
    for seed in range(10):
        plan = schedule.plan(seed, 60, 3, 2, kinds=kinds, gap_s=(2.5, 4.0), ordered=True)
        assert tuple(i.kind for i in plan[:4]) == kinds


def test_the_etcd_member_is_drawn_across_seeds() -> None:
    members = {
        i.member
        for seed in range(40)
        for i in schedule.plan(seed, 120, 3, 2, kinds=(schedule.KILL_ETCD_MEMBER,))
    }
    assert members == set(range(schedule.ETCD_MEMBERS))


@pytest.mark.parametrize("kind", schedule.CONTROL_PLANE)
def test_a_control_plane_strike_names_no_group_in_its_reason(kind: str) -> None:
    inj = Injection(0, 1.0, kind, group=2, rank=1, hold_s=3.0, member=2)
    d = schedule.decide(1.0, [inj], healthy(3), 0.0)
    assert d.action == "strike" and d.rank is None
    assert "group" not in d.reason
    if kind == schedule.KILL_ETCD_MEMBER:
        assert d.reason == "kill-etcd-member m2"


@pytest.mark.parametrize("kind", schedule.CONTROL_PLANE)
def test_a_control_plane_strike_waits_for_every_group(kind: str) -> None:
    inj = Injection(0, 1.0, kind, hold_s=3.0)
    for states in itertools.product(STATES, repeat=3):
        health = [GroupHealth(g, h, u, why_not="x") for g, (h, u) in enumerate(states)]
        d = schedule.decide(5.0, [inj], health, 0.0)
        assert d.action == ("strike" if all(h for h, _ in states) else "wait")
