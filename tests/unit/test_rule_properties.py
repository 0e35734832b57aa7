"""Hypothesis properties of the two pure rules: the lighthouse's quorum rule
(who trains together, and the quorum id) and the manager's per-rank rule
(ranks, heal sources, who sends to whom)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftdist.lighthouse.quorum import (
    LighthouseState,
    Participant,
    QuorumConfig,
    compute_quorum,
    next_quorum_id,
)
from ftdist.manager.rule import compute_quorum_results

pytestmark = pytest.mark.timeout(60)

NOW = 1000.0
IDS = [f"r{i}" for i in range(8)]
# Bounded so that the whole file runs in a few seconds.
PROPERTY = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass(frozen=True)
class Req:
    replica_id: str
    shrink_only: bool = False
    commit_failures: int = 0


@dataclass(frozen=True)
class Member:
    replica_id: str
    step: int
    commit_failures: int = 0

    @property
    def address(self) -> str:
        return f"manager-{self.replica_id}"

    @property
    def store_address(self) -> str:
        return f"store-{self.replica_id}"


@st.composite
def lighthouse_views(draw: st.DrawFn) -> tuple[LighthouseState[Req], QuorumConfig]:
    config = QuorumConfig(
        min_replicas=draw(st.integers(1, 5)),
        join_timeout_s=draw(st.sampled_from([0.0, 0.5, 2.0])),
        heartbeat_timeout_s=draw(st.sampled_from([0.5, 1.0, 3.0])),
    )
    ids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=len(IDS)))
    heartbeats: dict[str, float] = {}
    participants: dict[str, Participant[Req]] = {}
    for rid in ids:
        if draw(st.booleans()):
            heartbeats[rid] = NOW - draw(st.floats(0.0, 5.0))
        if draw(st.booleans()):
            request = Req(
                rid, shrink_only=draw(st.booleans()), commit_failures=draw(st.integers(0, 2))
            )
            participants[rid] = Participant(joined=NOW - draw(st.floats(0.0, 3.0)), member=request)
    prev = draw(st.none() | st.lists(st.sampled_from(IDS), unique=True, min_size=1))
    state = LighthouseState(
        participants=participants,
        heartbeats=heartbeats,
        prev_member_ids=None if prev is None else tuple(sorted(prev)),
        quorum_id=draw(st.integers(0, 5)),
    )
    return state, config


def _healthy(state: LighthouseState[Req], config: QuorumConfig) -> set[str]:
    return {
        rid for rid, seen in state.heartbeats.items() if NOW - seen < config.heartbeat_timeout_s
    }


def _shuffled(state: LighthouseState[Req], seed: int) -> LighthouseState[Req]:
    rng = random.Random(seed)
    parts, beats = list(state.participants.items()), list(state.heartbeats.items())
    rng.shuffle(parts)
    rng.shuffle(beats)
    return LighthouseState(dict(parts), dict(beats), state.prev_member_ids, state.quorum_id)


@PROPERTY
@given(lighthouse_views(), st.integers(0, 2**32 - 1))
def test_quorum_rule_invariants(view: tuple[LighthouseState[Req], QuorumConfig], seed: int) -> None:
    state, config = view
    decision = compute_quorum(NOW, state, config)
    assert isinstance(decision.reason, str) and decision.reason.strip()
    # Deterministic, and blind to the order the lighthouse heard things in.
    again = compute_quorum(NOW, _shuffled(state, seed), config)
    assert (again.members, again.reason) == (decision.members, decision.reason)

    healthy = _healthy(state, config)
    healthy_participants = healthy & set(state.participants)
    prev = state.prev_member_ids
    fast = prev is not None and set(prev) <= healthy_participants
    if fast:
        assert decision.ready and decision.reason.startswith("Fast quorum found!")
    if decision.members is None:
        return
    ids = [m.replica_id for m in decision.members]
    assert ids and ids == sorted(ids) and len(set(ids)) == len(ids)
    assert len(ids) <= len(state.participants)
    # Members are the participants' own requests, and only healthy ones.
    for member in decision.members:
        assert state.participants[member.replica_id].member is member
        assert member.replica_id in healthy
    shrink = any(state.participants[r].member.shrink_only for r in healthy_participants)
    if shrink and prev is not None:
        assert set(ids) <= set(prev)  # shrink_only adds no one
    elif not fast:
        assert set(ids) == healthy_participants
    if not fast:
        assert decision.reason.startswith("Valid quorum found")
        # min_replicas and the split-brain guard hold for the participants the
        # rule counted; shrink_only may then drop joiners (torchft's order).
        assert len(healthy_participants) >= config.min_replicas
        assert len(healthy_participants) > len(healthy) // 2
        if len(healthy_participants) < len(healthy):  # stragglers: waited the join timeout
            first = min(state.participants[r].joined for r in healthy_participants)
            assert NOW - first >= config.join_timeout_s


@PROPERTY
@given(
    st.integers(0, 100),
    st.none() | st.lists(st.sampled_from(IDS), unique=True).map(lambda x: tuple(sorted(x))),
    st.lists(
        st.builds(Req, st.sampled_from(IDS), st.just(False), st.integers(0, 2)),
        unique_by=lambda r: r.replica_id,
        min_size=1,
    ).map(lambda ms: sorted(ms, key=lambda m: m.replica_id)),
)
def test_quorum_id_grows_by_one_exactly_on_a_change(
    quorum_id: int, prev: tuple[str, ...] | None, members: list[Req]
) -> None:
    decision = next_quorum_id(quorum_id, prev, members)
    changed = prev is None or [m.replica_id for m in members] != list(prev)
    failed = any(m.commit_failures > 0 for m in members)
    if changed or failed:
        assert decision.quorum_id == quorum_id + 1
        assert decision.reason and str(quorum_id + 1) in decision.reason
    else:
        assert (decision.quorum_id, decision.reason) == (quorum_id, None)
    assert next_quorum_id(quorum_id, prev, members) == decision


members_strategy = st.lists(
    st.builds(Member, st.sampled_from(IDS), st.integers(0, 3), st.integers(0, 2)),
    unique_by=lambda m: m.replica_id,
    min_size=1,
)


@PROPERTY
@given(members_strategy, st.integers(0, 3), st.booleans(), st.integers(0, 2**32 - 1))
def test_manager_rule_invariants(
    members: list[Member], group_rank: int, init_sync: bool, seed: int
) -> None:
    ordered = sorted(members, key=lambda m: m.replica_id)
    n = len(ordered)
    max_step = max(m.step for m in ordered)
    results = {
        m.replica_id: compute_quorum_results(m.replica_id, group_rank, 7, members, init_sync)
        for m in members
    }
    shuffled = list(members)
    random.Random(seed).shuffle(shuffled)
    for m in members:  # the order members are listed in does not matter
        assert (
            compute_quorum_results(m.replica_id, group_rank, 7, shuffled, init_sync)
            == results[m.replica_id]
        )

    assert sorted(r.replica_rank for r in results.values()) == list(range(n))
    up_to_date = [m.replica_id for m in ordered if m.step == max_step]
    recovering = {i for i, m in enumerate(ordered) if results[m.replica_id].heal}
    for i, m in enumerate(ordered):
        r = results[m.replica_id]
        assert r.replica_rank == i and r.replica_world_size == n
        assert r.replica_ids == [x.replica_id for x in ordered]
        assert (r.quorum_id, r.max_step, r.max_world_size) == (7, max_step, len(up_to_date))
        assert r.commit_failures == max(x.commit_failures for x in ordered)
        assert r.max_replica_rank == (
            up_to_date.index(m.replica_id) if m.replica_id in up_to_date else None
        )
        # The store is an up-to-date member's; everyone of this group rank meets there.
        assert r.store_address in {f"store-{rid}" for rid in up_to_date}
        assert r.store_address == results[ordered[0].replica_id].store_address
        if m.step < max_step:
            assert r.heal  # a member behind always heals
        if r.heal:
            src = r.recover_src_replica_rank
            assert src is not None and src != i
            source = ordered[src]
            # Its source is up to date and not healing itself.
            assert source.step == max_step and src not in recovering
            assert r.recover_src_manager_address == source.address
            assert i in results[source.replica_id].recover_dst_replica_ranks
            assert not r.recover_dst_replica_ranks  # a healing member sends nothing
        else:
            assert r.recover_src_replica_rank is None and r.recover_src_manager_address == ""
    # Every recovering member is sent to exactly once; at least one source remains.
    sent = [d for r in results.values() for d in r.recover_dst_replica_ranks]
    assert sorted(sent) == sorted(recovering)
    assert len(recovering) < n
    if not (init_sync and max_step == 0):
        assert recovering == {i for i, m in enumerate(ordered) if m.step < max_step}
    else:
        assert len(recovering) == n - 1  # all but the primary copy its initial state


@PROPERTY
@given(members_strategy, st.sampled_from(["x", "r9", ""]))
def test_manager_rule_refuses_a_replica_outside_the_quorum(
    members: list[Member], outsider: str
) -> None:
    with pytest.raises(LookupError, match="not a member"):
        compute_quorum_results(outsider, 0, 1, members, False)
