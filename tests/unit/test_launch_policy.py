"""The supervisor's rule, over every small state and every kind of exit."""

from __future__ import annotations

import itertools

import pytest

from ftdist.launch.policy import (
    Action,
    ChildExit,
    SupervisorState,
    decide,
    describe_exit,
)

EXITS = [
    (0, False),  # returned
    (1, True),  # raised
    (3, False),  # exited non-zero without a report
    (-9, False),  # SIGKILL
    (-15, False),  # SIGTERM
    (0, True),  # reported an error yet exited 0
]


def _states() -> list[tuple[SupervisorState, ChildExit]]:
    cases = []
    world, groups = 4, 2
    for fault_tolerant, max_restarts in itertools.product((False, True), (0, 1, 2)):
        for used in itertools.product(range(max_restarts + 2), repeat=groups):
            for done_mask in range(1 << world):
                done = frozenset(r for r in range(world) if done_mask >> r & 1)
                for rank in range(world):
                    if rank in done:
                        continue
                    for exitcode, raised in EXITS:
                        state = SupervisorState(world, fault_tolerant, max_restarts, used, done)
                        cases.append((state, ChildExit(rank, rank // 2, exitcode, raised)))
    return cases


def test_every_case_follows_the_rules() -> None:
    cases = _states()
    assert len(cases) > 5000
    for state, event in cases:
        decision = decide(state, event)
        assert decision.reason.startswith(describe_exit(event))
        if not event.failed:
            done_after = len(state.done) + 1
            expected = Action.DONE if done_after == state.world_size else Action.WAIT
            assert decision.action is expected, (state, event)
            assert decision.group is None
        elif not state.fault_tolerant:
            assert decision.action is Action.FAIL and decision.group == event.group
        elif state.restarts[event.group] < state.max_restarts:
            assert decision.action is Action.RESTART_GROUP and decision.group == event.group
            assert f"restart {state.restarts[event.group] + 1} of" in decision.reason
        else:
            assert decision.action is Action.FAIL and decision.group == event.group
            assert "used all" in decision.reason


@pytest.mark.parametrize(
    "event,text",
    [
        (ChildExit(2, 0, 1, raised=True), "rank 2 raised an exception"),
        (ChildExit(1, 0, -9), "rank 1 was killed by SIGKILL"),
        (ChildExit(1, 0, -200), "rank 1 was killed by signal 200"),
        (ChildExit(0, 0, 4), "rank 0 exited with code 4"),
        (ChildExit(3, 1, 0), "rank 3 returned"),
    ],
)
def test_exits_are_described(event: ChildExit, text: str) -> None:
    assert describe_exit(event) == text


def test_a_failure_never_counts_as_done() -> None:
    state = SupervisorState(1, False, 0, (0,))
    assert decide(state, ChildExit(0, 0, 0, raised=True)).action is Action.FAIL
    assert decide(state, ChildExit(0, 0, 0)).action is Action.DONE
