"""The partition rule (ftdist.lighthouse.partition): which members a quorum
leaves out when members report peers they cannot reach. Hypothesis drives the
pure rule over random reports; a few cases pin the situations users meet."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftdist.lighthouse.partition import REPORT_KEY, exclude_partitioned, reported_unreachable
from ftdist.lighthouse.quorum import LighthouseState, Participant, QuorumConfig, compute_quorum

pytestmark = pytest.mark.timeout(60)

PROPERTY = settings(
    max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
IDS = [f"r{i}" for i in range(7)]


@dataclass(frozen=True)
class Member:
    replica_id: str
    address: str = ""
    step: int = 0
    data: str = ""
    shrink_only: bool = False
    commit_failures: int = 0


def _addr(rid: str, incarnation: int = 0) -> str:
    return f"http://{rid}.example:{1000 + incarnation}"


def _member(rid: str, reports: dict[str, str] | None = None, step: int = 0) -> Member:
    data = json.dumps({REPORT_KEY: reports, "fingerprint": {}}) if reports else ""
    return Member(rid, _addr(rid), step, data)


def _cut_pairs(members: list[Member]) -> set[frozenset[str]]:
    by_id = {m.replica_id: m for m in members}
    pairs = set()
    for m in members:
        for peer, address in reported_unreachable(m.data).items():
            if peer in by_id and peer != m.replica_id and by_id[peer].address == address:
                pairs.add(frozenset((m.replica_id, peer)))
    return pairs


@st.composite
def reporting_members(draw: st.DrawFn) -> list[Member]:
    ids = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=len(IDS), unique=True))
    members = []
    for rid in ids:
        peers = draw(st.lists(st.sampled_from(IDS), max_size=4, unique=True))
        # Some reports name an earlier incarnation's address: they must not count.
        reports = {p: _addr(p, draw(st.sampled_from([0, 0, 0, 1]))) for p in peers}
        members.append(_member(rid, reports, draw(st.integers(0, 3))))
    return members


@PROPERTY
@given(reporting_members(), st.randoms(use_true_random=False))
def test_the_members_kept_are_never_cut_from_each_other(
    members: list[Member], rnd: random.Random
) -> None:
    decision = exclude_partitioned(members)
    kept_ids = [m.replica_id for m in decision.kept]
    # A partition of the candidates, kept in the given order, never empty.
    assert sorted(kept_ids + decision.excluded) == sorted(m.replica_id for m in members)
    assert kept_ids == [m.replica_id for m in members if m.replica_id in set(kept_ids)]
    assert decision.kept
    assert not _cut_pairs(decision.kept)
    # Nobody is left out without a cut, and a reason is given exactly then.
    assert bool(decision.excluded) == bool(_cut_pairs(members)) == (decision.reason is not None)
    # Every member computes the same answer whatever order it sees them in.
    shuffled = list(members)
    rnd.shuffle(shuffled)
    assert set(exclude_partitioned(shuffled).excluded) == set(decision.excluded)


@PROPERTY
@given(
    st.lists(st.sampled_from(IDS), min_size=2, max_size=len(IDS), unique=True),
    st.data(),
)
def test_a_single_reporter_can_only_exclude_itself(ids: list[str], data: st.DataObject) -> None:
    reporter = data.draw(st.sampled_from(ids))
    accused = data.draw(
        st.lists(st.sampled_from([i for i in ids if i != reporter]), min_size=1, unique=True)
    )
    members = [
        _member(rid, {p: _addr(p) for p in accused} if rid == reporter else None) for rid in ids
    ]
    assert exclude_partitioned(members).excluded == [reporter]


@PROPERTY
@given(st.lists(st.sampled_from(IDS), min_size=3, max_size=len(IDS), unique=True), st.data())
def test_a_group_cut_from_all_its_peers_is_the_one_left_out(
    ids: list[str], data: st.DataObject
) -> None:
    cut = data.draw(st.sampled_from(ids))
    others = [i for i in ids if i != cut]
    # Whoever has probed reports: the cut group names everyone, any subset of
    # the others names it back (some may not have probed yet).
    reporting = set(data.draw(st.lists(st.sampled_from(others), unique=True)))
    members = [
        _member(cut, {p: _addr(p) for p in others})
        if rid == cut
        else _member(rid, {cut: _addr(cut)} if rid in reporting else None)
        for rid in ids
    ]
    assert exclude_partitioned(members).excluded == [cut]


def test_two_groups_cut_from_each_other_keep_the_one_further_ahead() -> None:
    a = _member("a", {"b": _addr("b")}, step=5)
    b = _member("b", {"a": _addr("a")}, step=7)
    assert exclude_partitioned([a, b]).excluded == ["a"]
    # At the same step, the id that sorts last goes.
    a = _member("a", {"b": _addr("b")}, step=7)
    assert exclude_partitioned([a, b]).excluded == ["b"]


def test_reports_that_are_not_reports_count_for_nothing() -> None:
    for data in ["", "not json", "[1, 2]", json.dumps({REPORT_KEY: ["b"]}), '{"fingerprint": 1}']:
        assert reported_unreachable(data) == {}
        members = [Member("a", _addr("a"), 0, data), _member("b")]
        assert exclude_partitioned(members).excluded == []


def _state(members: list[Member], prev: tuple[str, ...] | None) -> LighthouseState[Member]:
    return LighthouseState(
        participants={m.replica_id: Participant(0.0, m) for m in members},
        heartbeats={m.replica_id: 10.0 for m in members},
        prev_member_ids=prev,
        quorum_id=3,
    )


def test_the_quorum_rule_leaves_a_cut_group_out_on_both_paths() -> None:
    cfg = QuorumConfig(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=5.0)
    a = _member("a", {"b": _addr("b"), "c": _addr("c")})
    b, c = _member("b", {"a": _addr("a")}), _member("c", {"a": _addr("a")})
    for prev in [("a", "b", "c"), None]:  # the fast path, then the slow one
        decision = compute_quorum(10.0, _state([a, b, c], prev), cfg)
        assert decision.members is not None
        assert [m.replica_id for m in decision.members] == ["b", "c"], decision.reason
        assert "left out as unreachable from its peers: a" in decision.reason
    # The others train on and report nothing more (they probe only after a
    # failed step); the parked request of the cut group keeps it out ...
    b, c = _member("b"), _member("c")
    decision = compute_quorum(10.0, _state([a, b, c], ("b", "c")), cfg)
    assert decision.members is not None and len(decision.members) == 2
    # ... until its probe finds its peers again and its new request joins.
    decision = compute_quorum(10.0, _state([_member("a"), b, c], ("b", "c")), cfg)
    assert decision.members is not None and len(decision.members) == 3


def test_no_quorum_forms_when_leaving_out_falls_below_min_replicas() -> None:
    cfg = QuorumConfig(min_replicas=2, join_timeout_s=1.0, heartbeat_timeout_s=5.0)
    a, b = _member("a", {"b": _addr("b")}), _member("b", {"a": _addr("a")})
    decision = compute_quorum(10.0, _state([a, b], ("a", "b")), cfg)
    assert decision.members is None
    assert "need min_replicas 2" in decision.reason
