"""The replicated lighthouse's pure rules: when a leader may answer
(ftdist.lighthouse.leadership), what its election loop does next, the
takeover's learning wait in the quorum rule, and etcd endpoint parsing.
Hypothesis drives the safety properties over random clocks and leases."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftdist.etcd.client import parse_endpoints, prefix_end
from ftdist.lighthouse.config import ReplicationConfig, resolve_lighthouse_config
from ftdist.lighthouse.leadership import (
    Action,
    ElectionView,
    LeaseView,
    next_step,
    renewal_due,
    serving_verdict,
)
from ftdist.lighthouse.quorum import LighthouseState, Participant, QuorumConfig, compute_quorum

pytestmark = pytest.mark.timeout(60)

PROPERTY = settings(
    max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
times = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
ttls = st.floats(min_value=1, max_value=60, allow_nan=False)
margins = st.floats(min_value=0, max_value=1, allow_nan=False)


@PROPERTY
@given(renewed=times, ttl=ttls, margin=margins, elapsed=st.floats(0, 100, allow_nan=False))
def test_a_leader_never_serves_past_its_lease_counted_from_the_send_time(
    renewed: float, ttl: float, margin: float, elapsed: float
) -> None:
    now = renewed + elapsed
    verdict = serving_verdict(now, LeaseView(ttl, renewed), True, margin)
    # etcd's TTL starts when it receives the renewal, after it was sent: a
    # leader serving only before send time + TTL - margin never outlives it.
    assert verdict.ok == (now < renewed + ttl - margin)
    if verdict.ok:
        assert 0 < verdict.left_s <= ttl - margin + 1e-9
        assert now + verdict.left_s <= renewed + ttl - margin + 1e-6
    else:
        assert verdict.left_s == 0
        assert "stops forming quorums" in verdict.reason


@PROPERTY
@given(now=times, ttl=ttls, renewed=times)
def test_only_a_leader_with_a_lease_serves(now: float, ttl: float, renewed: float) -> None:
    assert not serving_verdict(now, LeaseView(ttl, renewed), False, 0.1).ok
    assert not serving_verdict(now, None, True, 0.1).ok


@st.composite
def views(draw: st.DrawFn) -> tuple[float, ElectionView]:
    now = draw(times)
    lease = draw(
        st.none() | st.builds(LeaseView, ttls, st.floats(max(0.0, now - 100), now, allow_nan=False))
    )
    read_at = draw(st.none() | st.floats(max(0.0, now - 10), now, allow_nan=False))
    view = ElectionView(
        lease=lease,
        is_leader=draw(st.booleans()) and lease is not None,
        leader_seen=draw(st.booleans()),
        read_at=read_at,
        poll_s=draw(st.floats(0.01, 1, allow_nan=False)),
        margin_s=draw(margins),
    )
    return now, view


@PROPERTY
@given(case=views())
def test_the_election_loop_is_safe(case: tuple[float, ElectionView]) -> None:
    now, view = case
    step = next_step(now, view)
    assert step.at >= now - 1e-9
    lease = view.lease
    may_serve = serving_verdict(now, lease, view.is_leader, view.margin_s).ok
    if view.is_leader and not may_serve:
        # A leader that may have lost its lease resigns before anything else.
        assert step.action is Action.RESIGN
    if step.action is Action.CAMPAIGN:
        # Never without a live lease, never as leader, only after a read
        # found no leader key.
        assert lease is not None and now < lease.renewed_at + lease.ttl_s
        assert not view.is_leader and view.read_at is not None and not view.leader_seen
    if step.action is Action.RENEW:
        assert lease is not None and now >= renewal_due(lease)
    if step.action is Action.WAIT:
        assert step.at > now
        if lease is not None:
            # Sleeping never skips a renewal.
            assert step.at <= renewal_due(lease) + 1e-9


def test_the_loop_from_nothing_to_leading() -> None:
    view = ElectionView(None, False, False, None, 0.1, 0.2)
    assert next_step(0, view).action is Action.GRANT
    leased = ElectionView(LeaseView(2, 0), False, False, None, 0.1, 0.2)
    assert next_step(0.01, leased).action is Action.WATCH
    free = ElectionView(LeaseView(2, 0), False, False, 0.01, 0.1, 0.2)
    assert next_step(0.02, free).action is Action.CAMPAIGN
    taken = ElectionView(LeaseView(2, 0), False, True, 0.01, 0.1, 0.2)
    step = next_step(0.02, taken)
    assert step.action is Action.WAIT and step.at == pytest.approx(0.11)
    leading = ElectionView(LeaseView(2, 0), True, True, 0.01, 0.1, 0.2)
    assert next_step(0.6, leading).action is Action.RENEW
    # A stopped leader wakes long after its lease: it resigns first.
    assert next_step(10, leading).action is Action.RESIGN


# -- the takeover's learning wait in the quorum rule ----------------------------------


@dataclass(frozen=True)
class Member:
    replica_id: str
    shrink_only: bool = False
    commit_failures: int = 0


SETTINGS = QuorumConfig(min_replicas=1, join_timeout_s=0.1, heartbeat_timeout_s=5)


def _state(
    asking: list[str], prev: tuple[str, ...] | None, until: float | None
) -> LighthouseState[Member]:
    state: LighthouseState[Member] = LighthouseState(
        prev_member_ids=prev, quorum_id=7, learning_until=until
    )
    for rid in asking:
        state.participants[rid] = Participant(joined=0.0, member=Member(rid))
        state.heartbeats[rid] = 0.5
    return state


def test_a_new_leader_reissues_the_previous_quorum_at_once() -> None:
    decision = compute_quorum(1.0, _state(["a", "b"], ("a", "b"), until=2.0), SETTINGS)
    assert [m.replica_id for m in decision.members or []] == ["a", "b"]
    assert decision.reason.startswith("Fast quorum")


def test_a_new_leader_waits_to_learn_before_any_other_quorum() -> None:
    # Only "a" of the previous ["a", "b"] has found the new leader so far: with
    # an empty heartbeat table the split-brain guard would let "a" alone form.
    decision = compute_quorum(1.0, _state(["a"], ("a", "b"), until=2.0), SETTINGS)
    assert decision.members is None
    assert "took over as leader" in decision.reason
    later = compute_quorum(2.0, _state(["a"], ("a", "b"), until=2.0), SETTINGS)
    assert [m.replica_id for m in later.members or []] == ["a"]


@PROPERTY
@given(
    asking=st.lists(st.sampled_from("abcde"), unique=True, min_size=1),
    prev=st.none() | st.lists(st.sampled_from("abcde"), unique=True, min_size=1).map(tuple),
    now=st.floats(0.5, 3, allow_nan=False),
)
def test_during_learning_only_the_fast_quorum_forms(
    asking: list[str], prev: tuple[str, ...] | None, now: float
) -> None:
    decision = compute_quorum(now, _state(asking, prev, until=2.0), SETTINGS)
    fast = prev is not None and set(prev) <= set(asking)
    if now < 2.0 and not fast:
        assert decision.members is None
    if fast:
        assert decision.members is not None


@PROPERTY
@given(
    asking=st.lists(st.sampled_from("abcde"), unique=True, min_size=1),
    prev=st.lists(st.sampled_from("abcde"), unique=True, min_size=1).map(tuple),
    silent=st.sets(st.sampled_from("abcde")),
    now=st.floats(0.5, 8, allow_nan=False),
)
def test_until_the_takeover_ends_no_quorum_leaves_out_a_healthy_previous_member(
    asking: list[str], prev: tuple[str, ...], silent: set[str], now: float
) -> None:
    state = _state(asking, prev, until=None)
    state.takeover_until = 5.0
    for rid in prev:
        if rid not in silent:
            state.heartbeats.setdefault(rid, 0.5)  # seeded at the takeover
    decision = compute_quorum(now, state, SETTINGS)
    if decision.members is None:
        return
    chosen = {m.replica_id for m in decision.members}
    healthy = {rid for rid, seen in state.heartbeats.items() if now - seen < 5}
    if now < 5.0:
        assert chosen >= set(prev) & healthy, decision.reason


# -- settings ---------------------------------------------------------------------


def test_etcd_endpoints_are_parsed_and_bad_ones_named() -> None:
    assert parse_endpoints("http://h1:2379, http://h2:2379/") == (
        "http://h1:2379",
        "http://h2:2379",
    )
    assert parse_endpoints(["https://[::1]:2379"]) == ("https://[::1]:2379",)
    for bad, words in [
        ("h1:2379", "'h1:2379' is not an http(s)://host:port"),
        ("http://h1", "is not an http(s)://host:port"),
        ("http://h1:99999", "is not an http(s)://host:port"),
        ("ftp://h1:1", "is not an http(s)://host:port"),
        ("", "no etcd endpoint"),
        ("http://a:1,http://a:1", "given twice"),
        ("http://a:1,https://b:1", "mix http:// and https://"),
    ]:
        with pytest.raises(ValueError, match="etcd"):
            parse_endpoints(bad)
        with pytest.raises(ValueError) as info:
            parse_endpoints(bad)
        assert words in str(info.value)
    with pytest.raises(TypeError):
        parse_endpoints(5)  # type: ignore[arg-type]


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert prefix_end(b"/ftdist/j/") == b"/ftdist/j0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_replication_settings_come_from_arguments_then_environment() -> None:
    config = resolve_lighthouse_config(
        min_replicas=1,
        environ={
            "FTDIST_LIGHTHOUSE_ETCD": "http://e1:2379,http://e2:2379",
            "FTDIST_LIGHTHOUSE_JOB": "env-job",
            "FTDIST_LIGHTHOUSE_LEASE_TTL_MS": "3000",
        },
        job="arg-job",
    )
    assert config.replication is not None
    assert config.replication == ReplicationConfig(
        etcd=("http://e1:2379", "http://e2:2379"),
        job="arg-job",
        lease_ttl=timedelta(seconds=3),
    )
    assert resolve_lighthouse_config(min_replicas=1, environ={}).replication is None
    with pytest.raises(ValueError, match="--job NAME"):
        resolve_lighthouse_config(min_replicas=1, environ={}, etcd="http://e:1")
    with pytest.raises(ValueError, match=r"job .* must be 1 to 128"):
        resolve_lighthouse_config(min_replicas=1, environ={}, etcd="http://e:1", job="a/b")
    with pytest.raises(ValueError, match="is not an http"):
        resolve_lighthouse_config(min_replicas=1, environ={}, etcd="e:1", job="j")
    with pytest.raises(ValueError, match="lease_ttl"):
        resolve_lighthouse_config(
            min_replicas=1, environ={}, etcd="http://e:1", job="j", lease_ttl_ms=100
        )
