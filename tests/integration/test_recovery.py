"""Recovery end to end: replica groups SIGKILLed and restarted heal live and end bit-identical."""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any

import pytest

from ftdist.coordination import LighthouseClient, LighthouseServer
from ftdist.launch.ranks import Ranks
from tests.integration.ft_training import assert_one_membership_per_quorum_id, train
from tests.integration.lighthouse_helpers import Lighthouses
from tests.integration.test_manager import assert_consistent


@pytest.fixture
def patient_lighthouse(lh: Lighthouses) -> str:
    """A lighthouse that waits for every live replica group.

    These tests check that each replica commits every step from where it
    joined (``assert_consistent``). With a short join timeout, a loaded
    machine lets the lighthouse form a quorum without a live replica that is
    merely late, which then (correctly) heals forward and skips steps; and
    at start-up, late replicas still at step 0 can even start a second
    lineage of their own. The heartbeat timeout is long for the same reason
    (a stall of the whole machine expires every heartbeat at once); a dead
    replica is still dropped within ~0.5 s, as soon as its failure-news
    stream closes.
    """
    return str(lh.server(join_timeout_ms=30_000, heartbeat_timeout_ms=5_000).address())


def _wait_dead(ranks: Ranks, members: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(ranks.exitcode(r) is None for r in members):
        assert time.monotonic() < deadline, f"ranks {members} did not die"
        time.sleep(0.02)
    assert all(ranks.exitcode(r) == -9 for r in members), [ranks.exitcode(r) for r in members]


def _run(
    lighthouse: str,
    groups: int,
    group_size: int,
    steps: int,
    actions: dict[int, dict[str, Any]],
    restarts: list[dict[int, dict[str, Any]]],
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run, and each time the victims die, restart them with the next actions
    (every process with ``env`` added to its environment)."""
    world = groups * group_size
    victims = sorted(actions.keys() & {r for r in range(world) if "die_at_step" in actions[r]})
    with Ranks(train, world, args=(lighthouse, group_size, steps, actions), env=env or {}) as ranks:
        for attempt, next_actions in enumerate(restarts, start=1):
            _wait_dead(ranks, victims)
            for r in victims:
                ranks.restart(r, lighthouse, group_size, steps, next_actions, attempt)
        outcomes = ranks.join(timeout=120)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    return [o.value for o in outcomes]


SLOW = {"step_sleep_s": 0.08}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("groups", "group_size"), [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_killed_group_restarts_heals_and_ends_identical(
    patient_lighthouse: str, groups: int, group_size: int
) -> None:
    rng = random.Random(groups * 10 + group_size)
    victim = rng.randrange(groups)
    die_at = rng.randrange(3, 10)
    steps = 40
    actions = {r: {**SLOW, "hold_until_rejoin_at": die_at + 2} for r in range(groups * group_size)}
    for g in range(group_size):
        actions[victim * group_size + g] = {"die_at_step": die_at, **SLOW}
    results = _run(
        patient_lighthouse,
        groups,
        group_size,
        steps,
        actions,
        [dict.fromkeys(range(groups * group_size), SLOW)],
    )
    assert_consistent(results, steps)
    healed = [r for r in results if r["replica"] == victim]
    assert all(any(h["role"] == "receive" and h["step"] > 0 for h in r["heals"]) for r in healed), (
        "the restarted group must heal live from a peer"
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("reserve_mb", [None, "0"])
def test_a_replacements_fresh_state_lands_in_memory_populated_during_its_quorum_wait(
    patient_lighthouse: str, reserve_mb: str | None
) -> None:
    # The replacement holds its 4 MiB ballast but not the 2 MiB "lazy"
    # tensor (an optimizer's momentum, say) that the survivor has: its heal
    # carves that one out of the memory it populated while the quorum formed.
    env = {} if reserve_mb is None else {"FTDIST_CHECKPOINT_RECEIVE_RESERVE_MB": reserve_mb}
    state = {**SLOW, "ballast_mb": 4, "lazy_mb": 2}
    actions = {0: {**state, "hold_until_rejoin_at": 5}, 1: {**state, "die_at_step": 3}}
    restart = [dict.fromkeys(range(2), state)]
    results = _run(patient_lighthouse, 2, 1, 12, actions, restart, env)
    assert_consistent(results, 12)
    assert len({r["lazy"] for r in results}) == 1, [r["lazy"] for r in results]
    heals = [h for r in results if r["replica"] == 1 for h in r["heals"] if h["role"] == "receive"]
    live = [h for h in heals if h["step"] > 0]
    assert len(live) == 1, heals
    from ftdist.checkpointing._prefault import ReceiveReserve

    usable = ReceiveReserve.possible(1)  # a kernel with MADV_POPULATE_WRITE
    expected = 2 << 20 if reserve_mb is None and usable else 0
    assert live[0]["reserved_bytes"] == expected, live


def _assert_gaps_healed(result: dict[str, Any]) -> None:
    """Each step this replica did not commit, it skipped by healing to the step it resumed at."""
    committed = result["committed"]
    healed_to = {h["step"] for h in result["heals"] if h["role"] == "receive"}
    resumed = [b for a, b in itertools.pairwise([-1, *committed]) if b != a + 1]
    assert set(resumed) <= healed_to, (
        result["replica"],
        result["group_rank"],
        committed[:12],
        result["heals"],
    )


@pytest.mark.timeout(150)
def test_live_group_left_out_of_quorums_heals_forward_and_ends_identical(
    lh: Lighthouses,
) -> None:
    # Replica group 2 (two ranks) pauses between two steps while staying
    # healthy; the join timeout lets the others go on without it. When it
    # asks again, both of its ranks heal forward to the same step and every
    # group rank ends bit-identical. min_replicas=2 of 3: any two quorums
    # share a member, so no second lineage can start.
    # The join timeout is what lets the others go on without the paused
    # group (once; later quorums of the same members are fast). It must not
    # be so short that a group merely slow on a loaded machine is left out
    # of the last step: the others then finish and leave, and with
    # min_replicas=2 it can never commit its last step (seen under a soak
    # with a 200 ms join timeout).
    server = lh.server(min_replicas=2, join_timeout_ms=2_000, heartbeat_timeout_ms=5_000)
    steps = 20
    # The others wait at step 10 too, so that they cannot finish (and stop
    # forming quorums) before replica 2 is back.
    actions: dict[int, dict[str, Any]] = {r: {**SLOW, "hold_until_rejoin_at": 10} for r in range(4)}
    for r in (4, 5):
        actions[r] = {**SLOW, "hold_until_rejoin_at": 5, "hold_for_request": False}
    with (
        Ranks(train, 6, args=(server.address(), 2, steps, actions)) as ranks,
        LighthouseClient(server.address(), 10) as client,
    ):
        seen, deadline = False, time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline, "the others never went on without replica 2"
            quorum = client.status()["quorum"] or {"members": [], "max_step": -1}
            in_quorum = any(m["replica_id"].startswith("replica2:") for m in quorum["members"])
            seen = seen or in_quorum
            # (Or the others reached their own hold: replica 2 was late
            # before step 5 already and healed past it.)
            if seen and quorum["max_step"] >= (8 if not in_quorum else 9):
                break
            time.sleep(0.02)
        ranks.parent_store().add("rejoined", 1)
        outcomes = ranks.join(timeout=120)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    results = [o.value for o in outcomes]
    for r in results:
        assert r["step"] == steps, r
        assert r["committed"] == sorted(set(r["committed"])), r
        _assert_gaps_healed(r)
    for group_rank in (0, 1):
        assert len({r["hash"] for r in results if r["group_rank"] == group_rank}) == 1, results
    left_out = [r for r in results if r["replica"] == 2]
    # A replica that had committed heals into fresh memory (its committed
    # state stays whole until the heal is loaded); one that never did, in place.
    for r in results:
        assert all(in_place == fresh for fresh, in_place in r["loads"]), r["loads"]
    # Both ranks of the group skipped the same steps.
    assert left_out[0]["committed"] == left_out[1]["committed"]
    # Steps skipped at the start count too: a group late to its first quorum
    # on a loaded machine heals forward from step 0 and never reaches step 5.
    committed = [-1, *left_out[0]["committed"]]
    assert any(b > a + 1 for a, b in itertools.pairwise(committed)), committed


@pytest.mark.timeout(150)
def test_group_killed_while_healing_restarts_again(patient_lighthouse: str) -> None:
    # The survivor holds for each replacement: the first joins at step 6 and
    # dies in its heal (the survivor's step 7 fails), so the second must be
    # asking by step 9, or a loaded machine lets the survivor finish alone
    # and the second start a new run from step 0.
    actions: dict[int, dict[str, Any]] = {
        0: {**SLOW, "hold_until_rejoin_at": 6, "later_holds": {9: 2}},
        1: {"die_at_step": 4, **SLOW},
    }
    again: dict[int, dict[str, Any]] = {0: dict(SLOW), 1: {"die_during_heal": True}}
    results = _run(patient_lighthouse, 2, 1, 40, actions, [again, {0: dict(SLOW), 1: dict(SLOW)}])
    assert_consistent(results, 40)


@pytest.mark.timeout(150)
def test_healing_source_killed_mid_transfer(patient_lighthouse: str) -> None:
    # Replica 2 dies and restarts; when it heals, whichever replica serves it
    # dies while the (large) state is still streaming. It heals from the other.
    big = {"ballast_mb": 64, "finishers": 2, **SLOW}
    actions = {
        0: {**big, "die_while_serving": True, "hold_until_rejoin_at": 5},
        1: {**big, "die_while_serving": True, "hold_until_rejoin_at": 5},
        2: {"die_at_step": 3, **big},
    }
    world = 3
    with Ranks(train, world, args=(patient_lighthouse, 1, 40, actions)) as ranks:
        _wait_dead(ranks, [2])
        ranks.restart(2, patient_lighthouse, 1, 40, {2: dict(big)}, 1)
        deadline = time.monotonic() + 60
        while ranks.exitcode(0) is None and ranks.exitcode(1) is None:
            assert time.monotonic() < deadline, "no source died while serving"
            time.sleep(0.02)
        outcomes = ranks.join(timeout=120)
    served_and_died = [o for o in outcomes[:2] if o.exitcode == -9]
    assert len(served_and_died) == 1, "\n".join(o.describe() for o in outcomes)
    alive = [o for o in outcomes if o.exitcode != -9]
    bad = [o for o in alive if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    assert_consistent([o.value for o in alive], 40)


@pytest.mark.timeout(45)
def test_failure_news_aborts_the_collective_instead_of_waiting_out_the_timeout() -> None:
    # Default collective timeout (60 s) and heartbeat timeout (5 s): only the
    # lighthouse's failure news can get the survivor going within this
    # test's 45 s limit. The recovery benchmark prints how long it took.
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200)
    try:
        actions = {
            0: {"timeout_s": 60, "finishers": 1, **SLOW},
            1: {"timeout_s": 60, "die_at_step": 5, "mid_allreduce": True, **SLOW},
        }
        with Ranks(train, 2, args=(server.address(), 1, 12, actions)) as ranks:
            outcomes = ranks.join(timeout=40)
    finally:
        server.shutdown()
    assert outcomes[1].exitcode == -9, outcomes[1].describe()
    survivor = outcomes[0]
    assert survivor.ok, survivor.describe()
    assert survivor.value["step"] == 12
    # The step the victim died in failed; every other step committed once
    # (from wherever the survivor started: it may have healed at step 0 or 1).
    committed = survivor.value["committed"]
    assert committed == list(range(committed[0], 12))
    assert survivor.value["attempts"] == len(committed) + 1


def _expect_raise(outcome: Any, *needles: str) -> None:
    assert outcome.error is not None, f"rank {outcome.rank} should have raised: {outcome.value}"
    for needle in needles:
        assert needle in outcome.error, outcome.error[-2000:]


@pytest.mark.timeout(90)
def test_a_heal_that_loads_incompletely_is_reported_and_never_commits(lighthouse: str) -> None:
    actions = {
        0: {**SLOW, "finishers": 1, "hold_until_rejoin_at": 5},
        1: {"die_at_step": 3, **SLOW},
    }
    with Ranks(train, 2, args=(lighthouse, 1, 30, actions)) as ranks:
        _wait_dead(ranks, [1])
        ranks.restart(1, lighthouse, 1, 30, {1: {"stale_lr_on_heal": True, "max_retries": 2}}, 1)
        outcomes = ranks.join(timeout=80)
    assert outcomes[0].ok, outcomes[0].describe()
    _expect_raise(
        outcomes[1],
        "should_commit failed 3 times",
        "StateDivergenceError",
        "optimizer/param_groups",
    )


@pytest.mark.timeout(150)
def test_a_restarted_lighthouse_never_gives_a_quorum_id_out_again() -> None:
    # Found by bench/lighthouse_failover.py: a restarted lighthouse counted
    # ids from 1 again; the group that asked first got "quorum 1" alone, then
    # both got "quorum 2", which the other group already held (with another
    # group, under the same store prefix) and so never rebuilt: the first one
    # waited for it until the collective timeout. Members now report the
    # last id they used, and a new lighthouse goes on above it.
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    port = server.port
    steps = 30
    actions = {r: {**SLOW} for r in range(2)}
    try:
        with Ranks(train, 2, args=(server.address(), 1, steps, actions)) as ranks:
            deadline = time.monotonic() + 60
            with LighthouseClient(server.address(), 10) as client:
                while (client.status().get("quorum") or {}).get("max_step", 0) < 5:
                    assert time.monotonic() < deadline, "the groups did not reach step 5"
                    time.sleep(0.05)
                old_last = client.status()["quorum_id"]
            server.shutdown()
            time.sleep(0.5)
            server = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=100)
            # Every id the new lighthouse gives out, from its failure news
            # (subscribed before the groups, which back off 100 ms, are back).
            formed: list[int] = []
            news_client = LighthouseClient(server.address(), 10)
            news = news_client.subscribe()

            def listen() -> None:
                for event in news:
                    if event.kind == "quorum_formed":
                        formed.append(event.quorum_id)

            listener = threading.Thread(target=listen, name="test-news", daemon=True)
            listener.start()
            try:
                outcomes = ranks.join(timeout=120)
            finally:
                news.close()
                listener.join(timeout=10)
                news_client.close()
    finally:
        server.shutdown()
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    results = [o.value for o in outcomes]
    # A quorum of one may form while the other group has not found the new
    # lighthouse yet (min_replicas=1): that group heals forward, so steps
    # may be skipped; what must hold is one history and no id reused.
    assert {r["step"] for r in results} == {steps}
    assert len({r["hash"] for r in results}) == 1, results
    assert_one_membership_per_quorum_id(results)
    assert formed, "the new lighthouse formed no quorum"
    # It went on above the ids its predecessor gave out.
    assert min(formed) > old_last, (old_last, formed)
