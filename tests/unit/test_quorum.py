"""The pure quorum rule, with a fake clock: torchft's vectors, exhaustive small
universes checked against a literal transcription of the spec, and properties."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from ftdist.lighthouse.quorum import (
    LighthouseState,
    Participant,
    QuorumConfig,
    QuorumDecision,
    compute_quorum,
    next_quorum_id,
    reported_quorum_id,
)

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0
HEARTBEAT_TIMEOUT = 5.0
NOW = 1000.0


@dataclass(frozen=True)
class M:
    """A quorum request as the rule sees it."""

    replica_id: str
    shrink_only: bool = False
    commit_failures: int = 0
    step: int = 0


def settings(min_replicas: int = 1, join_timeout: float = HOUR) -> QuorumConfig:
    return QuorumConfig(
        min_replicas=min_replicas,
        join_timeout_s=join_timeout,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT,
    )


def state(
    participants: dict[str, float] | None = None,
    heartbeats: dict[str, float] | None = None,
    prev: tuple[str, ...] | None = None,
    shrink: set[str] | frozenset[str] = frozenset(),
) -> LighthouseState[M]:
    """participants: replica id -> joined; heartbeats: replica id -> last seen."""
    return LighthouseState(
        participants={
            rid: Participant(joined=joined, member=M(rid, shrink_only=rid in shrink))
            for rid, joined in (participants or {}).items()
        },
        heartbeats=dict(heartbeats or {}),
        prev_member_ids=prev,
    )


def ids(decision: QuorumDecision[M]) -> list[str] | None:
    return None if decision.members is None else [m.replica_id for m in decision.members]


# -- torchft's unit-test vectors (torchft-semantics.md section 1.10) --------


def test_vector_join_timeout() -> None:
    opts = settings(min_replicas=1, join_timeout=HOUR)
    decision = compute_quorum(NOW, state(), opts)
    assert decision.members is None
    assert decision.reason.startswith(
        "New quorum not ready, only have 0 participants, need min_replicas 1 "
        "[0/0 participants healthy]"
    )

    st = state(participants={"a": NOW, "b": NOW}, heartbeats={"a": NOW, "b": NOW})
    assert ids(compute_quorum(NOW, st, opts)) == ["a", "b"]

    st.heartbeats["c"] = NOW  # heartbeating, not asking
    decision = compute_quorum(NOW, st, opts)
    assert decision.members is None
    assert "join timeout" in decision.reason

    st.participants["a"].joined = NOW - 10 * HOUR
    decision = compute_quorum(NOW, st, opts)
    assert ids(decision) == ["a", "b"]
    assert decision.reason.startswith("Valid quorum found")


def test_vector_heartbeats() -> None:
    opts = settings(min_replicas=1)
    st = state(participants={"a": NOW}, heartbeats={"a": NOW})
    decision = compute_quorum(NOW, st, opts)
    assert ids(decision) == ["a"]
    assert "[1/1 participants healthy][1 heartbeating]" in decision.reason

    st.heartbeats["a"] = NOW - 10.0
    decision = compute_quorum(NOW, st, opts)
    assert decision.members is None
    assert "[0/1 participants healthy][0 heartbeating]" in decision.reason

    st.participants["b"] = Participant(joined=NOW, member=M("b"))
    st.heartbeats["b"] = NOW
    assert ids(compute_quorum(NOW, st, opts)) == ["b"]


def test_vector_fast_prev_quorum() -> None:
    opts = settings(min_replicas=1)
    st = state(participants={"a": NOW}, heartbeats={"a": NOW, "b": NOW})
    decision = compute_quorum(NOW, st, opts)
    assert decision.members is None
    assert "need at least half" in decision.reason

    st.prev_member_ids = ("a",)
    decision = compute_quorum(NOW, st, opts)
    assert ids(decision) == ["a"]
    assert decision.reason.startswith("Fast quorum found!")

    st.participants["b"] = Participant(joined=NOW, member=M("b"))
    assert ids(compute_quorum(NOW, st, opts)) == ["a", "b"]


def test_vector_shrink_only() -> None:
    st = state(
        participants={"a": NOW, "c": NOW},
        heartbeats={"a": NOW, "c": NOW},
        prev=("a", "b"),
        shrink={"a"},
    )
    decision = compute_quorum(NOW, st, settings(min_replicas=1))
    assert ids(decision) == ["a"]
    assert "[shrink_only=true]" in decision.reason


def test_vector_split_brain() -> None:
    opts = settings(min_replicas=1)
    st = state(participants={"a": NOW}, heartbeats={"a": NOW})
    assert ids(compute_quorum(NOW, st, opts)) == ["a"]

    st.heartbeats["b"] = NOW
    decision = compute_quorum(NOW, st, opts)
    assert decision.members is None
    assert decision.reason == (
        "New quorum not ready, only have 1 participants, need at least half of 2 healthy "
        "workers [1/1 participants healthy][2 heartbeating][shrink_only=false]"
    )


def test_vector_join_during_shrink() -> None:
    opts = settings(min_replicas=1)
    st = state(
        participants={"a": NOW, "b": NOW},
        heartbeats={"a": NOW, "b": NOW},
        prev=("a",),
        shrink={"a"},
    )
    assert ids(compute_quorum(NOW, st, opts)) == ["a"]
    st = state(participants={"a": NOW, "b": NOW}, heartbeats={"a": NOW, "b": NOW}, prev=("a",))
    assert ids(compute_quorum(NOW, st, opts)) == ["a", "b"]


def test_vector_commit_failures() -> None:
    members = [M("a"), M("b")]
    first = next_quorum_id(0, None, members)
    assert first.quorum_id == 1 and first.reason is not None
    assert "Detected quorum change, bumping quorum_id to 1" in first.reason
    stable = next_quorum_id(first.quorum_id, ("a", "b"), members)
    assert stable.quorum_id == 1 and stable.reason is None
    failed = next_quorum_id(1, ("a", "b"), [M("a"), M("b", commit_failures=2)])
    assert failed.quorum_id == 2
    assert failed.reason == "Detected commit failures in ['b'], bumping quorum_id to 2"


# -- the quorum_id rule -----------------------------------------------------


def test_quorum_id_ignores_address_and_step_changes() -> None:
    assert next_quorum_id(4, ("a", "b"), [M("a", step=9), M("b", step=3)]).quorum_id == 4


@pytest.mark.parametrize(
    "prev, now_ids",
    [
        (("a", "b"), ("a",)),
        (("a",), ("a", "b")),
        (("a", "b"), ("a", "c")),
        (("a", "b"), ("b", "a")),
    ],
)
def test_quorum_id_bumps_on_membership_change(
    prev: tuple[str, ...], now_ids: tuple[str, ...]
) -> None:
    decision = next_quorum_id(7, prev, [M(rid) for rid in now_ids])
    assert decision.quorum_id == 8
    assert decision.reason == "Detected quorum change, bumping quorum_id to 8"


# -- a literal transcription of torchft-semantics.md 1.6, as the oracle --------


def reference_rule(
    now: float, st: LighthouseState[M], opts: QuorumConfig
) -> tuple[list[str] | None, str]:
    healthy_replicas = {
        rid for rid, t in st.heartbeats.items() if now - t < opts.heartbeat_timeout_s
    }
    healthy_participants = {rid: d for rid, d in st.participants.items() if rid in healthy_replicas}
    candidates = sorted(
        (d.member for d in healthy_participants.values()), key=lambda m: m.replica_id
    )
    shrink_only = any(d.member.shrink_only for d in healthy_participants.values())
    metadata = (
        f"[{len(healthy_participants)}/{len(st.participants)} participants healthy]"
        f"[{len(healthy_replicas)} heartbeating][shrink_only={str(shrink_only).lower()}]"
    )
    if st.prev_member_ids is not None:
        prev_ids = set(st.prev_member_ids)
        if shrink_only:
            candidates = [c for c in candidates if c.replica_id in prev_ids]
        if all(rid in healthy_participants for rid in st.prev_member_ids):
            return [c.replica_id for c in candidates], f"Fast quorum found! {metadata}"
    n, h = len(healthy_participants), len(healthy_replicas)
    if n < opts.min_replicas:
        return None, (
            f"New quorum not ready, only have {n} participants, need min_replicas "
            f"{opts.min_replicas} {metadata}"
        )
    if n <= h // 2:
        return None, (
            f"New quorum not ready, only have {n} participants, need at least half of {h} "
            f"healthy workers {metadata}"
        )
    all_healthy_joined = n == h
    first_joined = min((d.joined for d in healthy_participants.values()), default=now)
    if not all_healthy_joined and now - first_joined < opts.join_timeout_s:
        return None, (
            f"Valid quorum with {n} participants, waiting for {h - n} healthy but not "
            f"participating stragglers due to join timeout {metadata}"
        )
    if not candidates:
        # Deliberate deviation from torchft, which forms an empty quorum here.
        return None, (
            f"New quorum not ready, shrink_only excludes all {n} participants (none was in "
            f"the previous quorum) {metadata}"
        )
    return [c.replica_id for c in candidates], f"Valid quorum found {metadata}"


def _check_against_reference(st: LighthouseState[M], opts: QuorumConfig) -> None:
    decision = compute_quorum(NOW, st, opts)
    expected_ids, expected_reason = reference_rule(NOW, st, opts)
    assert (ids(decision), decision.reason) == (expected_ids, expected_reason), st


# Per replica: whether and how it asks, and its heartbeat.
_ASKS = ("no", "yes", "shrink")
_BEATS = ("none", "fresh", "expired")
_JOINED = (NOW, NOW - 2 * HOUR)


def test_exhaustive_three_replicas_match_reference() -> None:
    replicas = ("a", "b", "c")
    prevs: list[tuple[str, ...] | None] = [None] + [
        combo for k in (1, 2, 3) for combo in itertools.combinations(replicas, k)
    ]
    checked = 0
    for asks in itertools.product(_ASKS, repeat=3):
        for beats in itertools.product(_BEATS, repeat=3):
            for joined in itertools.product(_JOINED, repeat=sum(a != "no" for a in asks)):
                joined_iter = iter(joined)
                participants = {
                    rid: next(joined_iter)
                    for rid, a in zip(replicas, asks, strict=True)
                    if a != "no"
                }
                heartbeats = {
                    rid: NOW if b == "fresh" else NOW - 2 * HEARTBEAT_TIMEOUT
                    for rid, b in zip(replicas, beats, strict=True)
                    if b != "none"
                }
                shrink = {rid for rid, a in zip(replicas, asks, strict=True) if a == "shrink"}
                for prev in prevs:
                    st = state(participants, heartbeats, prev, shrink)
                    for min_replicas in (1, 2, 3):
                        _check_against_reference(st, settings(min_replicas))
                        checked += 1
    assert checked > 50_000


def _random_state(rng: random.Random, universe: int) -> LighthouseState[M]:
    replicas = [f"r{i:03d}" for i in rng.sample(range(1000), universe)]
    participants = {
        rid: NOW - rng.choice([0.0, 1.0, 100.0, 2 * HOUR]) for rid in replicas if rng.random() < 0.6
    }
    heartbeats = {
        rid: NOW - rng.choice([0.0, 1.0, 4.999, 5.0, 50.0])
        for rid in replicas
        if rng.random() < 0.8
    }
    shrink = {rid for rid in participants if rng.random() < 0.05}
    prev = None
    if rng.random() < 0.7:
        k = rng.randint(1, universe)
        prev = tuple(sorted(rng.sample(replicas, k)))
    return state(participants, heartbeats, prev, shrink)


def test_random_states_match_reference() -> None:
    rng = random.Random(20240601)
    for _ in range(3000):
        st = _random_state(rng, rng.randint(1, 40))
        _check_against_reference(st, settings(rng.randint(1, 8), rng.choice([0.0, 60.0, HOUR])))


# -- properties ---------------------------------------------------------------


def test_properties_over_random_states() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        st = _random_state(rng, rng.randint(1, 30))
        opts = settings(rng.randint(1, 6), rng.choice([0.0, 60.0, HOUR]))
        decision = compute_quorum(NOW, st, opts)
        healthy = {rid for rid, t in st.heartbeats.items() if NOW - t < HEARTBEAT_TIMEOUT}
        if decision.members is None:
            assert "not ready" in decision.reason or "join timeout" in decision.reason
            continue
        member_ids = [m.replica_id for m in decision.members]
        # Sorted, unique, and only healthy participants.
        assert member_ids == sorted(set(member_ids))
        assert set(member_ids) <= set(st.participants) & healthy
        if decision.reason.startswith("Fast quorum found!"):
            assert st.prev_member_ids is not None
            assert set(st.prev_member_ids) <= set(st.participants) & healthy
        else:
            healthy_participants = set(st.participants) & healthy
            # Split-brain guard: a strict majority of the healthy replicas, so
            # two disjoint quorums can never form from the same population.
            assert len(healthy_participants) > len(healthy) // 2
            assert len(healthy_participants) >= opts.min_replicas
        if "[shrink_only=true]" in decision.reason and st.prev_member_ids is not None:
            assert set(member_ids) <= set(st.prev_member_ids)


def test_split_brain_two_halves_never_both_form() -> None:
    heartbeats = {rid: NOW for rid in "abcdef"}
    opts = settings(min_replicas=1, join_timeout=0.0)
    left = compute_quorum(NOW, state({r: NOW for r in "abc"}, heartbeats), opts)
    right = compute_quorum(NOW, state({r: NOW for r in "def"}, heartbeats), opts)
    assert left.members is None and right.members is None
    bigger = compute_quorum(NOW, state({r: NOW for r in "abcd"}, heartbeats), opts)
    assert ids(bigger) == ["a", "b", "c", "d"]


def test_members_sorted_by_replica_id_not_arrival() -> None:
    st = state(
        participants={"zeta": NOW, "alpha": NOW - 1, "mid": NOW - 2},
        heartbeats={"zeta": NOW, "alpha": NOW, "mid": NOW},
    )
    assert ids(compute_quorum(NOW, st, settings())) == ["alpha", "mid", "zeta"]


def test_shrink_only_never_forms_an_empty_quorum() -> None:
    # Only newcomers ask, one of them shrink_only, and the old members are gone.
    st = state(
        participants={"c": NOW, "d": NOW},
        heartbeats={"c": NOW, "d": NOW},
        prev=("a", "b"),
        shrink={"c"},
    )
    decision = compute_quorum(NOW, st, settings(min_replicas=1))
    assert decision.members is None
    assert "shrink_only excludes all 2 participants" in decision.reason
    st.participants["c"].member = M("c")
    assert ids(compute_quorum(NOW, st, settings(min_replicas=1))) == ["c", "d"]


def test_fast_quorum_skips_min_replicas() -> None:
    # torchft quirk kept on purpose: the fast path has no min_replicas check.
    st = state(participants={"a": NOW}, heartbeats={"a": NOW}, prev=("a",))
    assert ids(compute_quorum(NOW, st, settings(min_replicas=3))) == ["a"]


def test_heartbeat_exactly_at_timeout_is_unhealthy() -> None:
    st = state(participants={"a": NOW}, heartbeats={"a": NOW - HEARTBEAT_TIMEOUT})
    decision = compute_quorum(NOW, st, settings())
    assert decision.members is None
    assert "[0/1 participants healthy][0 heartbeating]" in decision.reason


def test_join_timeout_counts_from_first_healthy_participant() -> None:
    heartbeats = {"a": NOW, "b": NOW, "c": NOW}
    opts = settings(min_replicas=1, join_timeout=10.0)
    waiting = compute_quorum(NOW, state({"a": NOW - 9.9, "b": NOW}, heartbeats), opts)
    assert waiting.members is None
    assert "waiting for 1 healthy but not participating stragglers" in waiting.reason
    ready = compute_quorum(NOW, state({"a": NOW - 10.0, "b": NOW}, heartbeats), opts)
    assert ids(ready) == ["a", "b"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_replicas": 0, "join_timeout_s": 1.0, "heartbeat_timeout_s": 1.0},
        {"min_replicas": 1, "join_timeout_s": -1.0, "heartbeat_timeout_s": 1.0},
        {"min_replicas": 1, "join_timeout_s": 1.0, "heartbeat_timeout_s": 0.0},
    ],
)
def test_settings_reject_invalid_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        QuorumConfig(**kwargs)  # type: ignore[arg-type]


def test_a_restarted_lighthouse_goes_on_above_the_ids_its_members_used() -> None:
    members = [M("a"), M("b")]
    # A fresh lighthouse whose members used ids up to 5 with its predecessor.
    decision = next_quorum_id(0, None, members, seen=5)
    assert decision.quorum_id == 6
    assert decision.reason == (
        "Members used quorum ids up to 5 (an earlier lighthouse's): bumping quorum_id to 6"
    )
    # Members at the lighthouse's own id change nothing.
    assert next_quorum_id(6, ("a", "b"), members, seen=6).quorum_id == 6
    assert next_quorum_id(6, ("a", "b"), members, seen=3).quorum_id == 6


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ('{"quorum_id": 7}', 7),
        ('{"quorum_id": 7, "unreachable": {}}', 7),
        ("", 0),
        ('{"k": 1}', 0),
        ('{"quorum_id": "7"}', 0),
        ('{"quorum_id": true}', 0),
        ('{"quorum_id": -3}', 0),
        ("not json quorum_id", 0),
        ('["quorum_id"]', 0),
    ],
)
def test_reported_quorum_ids_are_read_defensively(data: str, expected: int) -> None:
    assert reported_quorum_id(data) == expected
