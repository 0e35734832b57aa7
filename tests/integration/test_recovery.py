"""Recovery end to end: replica groups SIGKILLed and restarted heal live and end bit-identical."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ftdist.coordination import LighthouseServer
from ftdist.testing import Ranks
from tests.integration.ft_training import train
from tests.integration.test_manager import assert_consistent


@pytest.fixture
def lighthouse() -> Iterator[str]:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200,
                              heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def _wait_dead(ranks: Ranks, members: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(ranks.exitcode(r) is None for r in members):
        assert time.monotonic() < deadline, f"ranks {members} did not die"
        time.sleep(0.02)
    assert all(ranks.exitcode(r) == -9 for r in members), [ranks.exitcode(r) for r in members]


def _run(lighthouse: str, groups: int, group_size: int, steps: int,
         actions: dict[int, dict[str, Any]],
         restarts: list[dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run, and each time the victims die, restart them with the next actions."""
    world = groups * group_size
    victims = sorted(actions.keys() & {r for r in range(world) if "die_at_step" in actions[r]})
    with Ranks(train, world, args=(lighthouse, group_size, steps, actions)) as ranks:
        for attempt, next_actions in enumerate(restarts, start=1):
            _wait_dead(ranks, victims)
            for r in victims:
                ranks.restart(r, lighthouse, group_size, steps, next_actions, attempt)
        outcomes = ranks.join(timeout=120)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"rank {o.rank}: exit {o.exitcode}\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


SLOW = {"step_sleep_s": 0.08}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("groups", "group_size"), [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_killed_group_restarts_heals_and_ends_identical(lighthouse: str, groups: int,
                                                         group_size: int) -> None:
    rng = random.Random(groups * 10 + group_size)
    victim = rng.randrange(groups)
    die_at = rng.randrange(3, 10)
    steps = 40
    actions = {r: dict(SLOW) for r in range(groups * group_size)}
    for g in range(group_size):
        actions[victim * group_size + g] = {"die_at_step": die_at, **SLOW}
    results = _run(lighthouse, groups, group_size, steps, actions, [dict.fromkeys(range(groups * group_size), SLOW)])
    assert_consistent(results, steps)
    healed = [r for r in results if r["replica"] == victim]
    assert all(any(h["role"] == "receive" and h["step"] > 0 for h in r["heals"]) for r in healed), \
        "the restarted group must heal live from a peer"


@pytest.mark.timeout(150)
def test_group_killed_while_healing_restarts_again(lighthouse: str) -> None:
    actions = {0: dict(SLOW), 1: {"die_at_step": 4, **SLOW}}
    again = {0: dict(SLOW), 1: {"die_during_heal": True}}
    results = _run(lighthouse, 2, 1, 40, actions, [again, {0: dict(SLOW), 1: dict(SLOW)}])
    assert_consistent(results, 40)


@pytest.mark.timeout(150)
def test_healing_source_killed_mid_transfer(lighthouse: str) -> None:
    # Replica 2 dies and restarts; when it heals, whichever replica serves it
    # dies while the (large) state is still streaming. It heals from the other.
    big = {"ballast_mb": 64, "finishers": 2, **SLOW}
    actions = {0: {**big, "die_while_serving": True}, 1: {**big, "die_while_serving": True},
               2: {"die_at_step": 3, **big}}
    world = 3
    with Ranks(train, world, args=(lighthouse, 1, 40, actions)) as ranks:
        _wait_dead(ranks, [2])
        ranks.restart(2, lighthouse, 1, 40, {2: dict(big)}, 1)
        deadline = time.monotonic() + 60
        while ranks.exitcode(0) is None and ranks.exitcode(1) is None:
            assert time.monotonic() < deadline, "no source died while serving"
            time.sleep(0.02)
        outcomes = ranks.join(timeout=120)
    served_and_died = [o for o in outcomes[:2] if o.exitcode == -9]
    assert len(served_and_died) == 1, [(o.rank, o.exitcode, o.error) for o in outcomes]
    alive = [o for o in outcomes if o.exitcode != -9]
    bad = [o for o in alive if not o.ok]
    assert not bad, [o.error for o in bad]
    assert_consistent([o.value for o in alive], 40)
