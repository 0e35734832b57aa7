"""The lighthouse's job history: what it records, and its bounds whatever happens."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftdist.lighthouse.history import (
    FAILURE_CAUSES,
    HistoryLimits,
    JobHistory,
    failure_cause,
    merge_failovers,
)

pytestmark = pytest.mark.timeout(120)

ids = st.text(alphabet="abcdefgh0123456789:-", min_size=1, max_size=300)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("quorum"), st.floats(0, 30), st.lists(ids, max_size=40)),
        st.tuples(st.just("fail"), st.floats(0, 30), ids),
        st.tuples(st.just("step"), st.floats(0, 30), st.integers(0, 10_000)),
        st.tuples(st.just("heal"), st.floats(0, 30), ids),
        st.tuples(st.just("progress"), st.floats(0, 30), ids),
    ),
    max_size=120,
)


def _apply(history: JobHistory, ops: list[tuple[Any, ...]]) -> float:
    now = 1_000_000.0
    quorum_id = 0
    for kind, dt, arg in ops:
        now += dt
        if kind == "quorum":
            quorum_id += 1
            history.quorum_formed(now, quorum_id, tuple(arg), "because")
        elif kind == "fail":
            history.member_failed(now, arg, "no heartbeat for 5.0 s")
        elif kind == "step":
            history.step_seen(now, arg)
        elif kind == "heal":
            history.heal_done(now, arg, {"quorum_s": 0.1, "transfer_s": 0.2, "transfer_bytes": 7})
        else:
            history.heal_progress(now, arg, {"phase": "transfer"})
    return now


@settings(max_examples=150, deadline=None)
@given(ops=operations)
def test_the_history_stays_within_its_bounds_whatever_happens(ops: list[tuple[Any, ...]]) -> None:
    limits = HistoryLimits(max_age_s=60, max_events=25, max_samples=10, max_names=3)
    history = JobHistory(limits)
    now = _apply(history, ops)
    doc = history.document(now)
    assert len(doc["events"]) <= 25 and len(doc["participants"]) <= 25
    assert len(doc["steps"]) <= 10
    assert all(now - e["t"] <= 60 for e in doc["events"])
    assert all(len(e.get("joined", ())) <= 3 and len(e.get("left", ())) <= 3 for e in doc["events"])
    # The committed step only grows, sampled at most once a second.
    steps = doc["steps"]
    assert all(a[1] < b[1] and b[0] - a[0] >= 1.0 for a, b in itertools.pairwise(steps))
    # Each replica id ends once, however often its end is reported.
    assert sum(doc["failures_by_cause"].values()) == len({a for k, _, a in ops if k == "fail"})
    json.dumps(doc)  # plain data


def test_a_large_job_for_an_hour_stays_a_few_megabytes() -> None:
    history = JobHistory()
    members = tuple(f"replica-group-{i:05d}:{'x' * 100}" for i in range(1024))
    now = 0.0
    for i in range(20_000):  # a membership change every 0.2 s, for over an hour
        now += 0.2
        history.quorum_formed(now, i + 1, members[i % 2 :], "changed")
        history.member_failed(now, members[i % 1024], "no heartbeat for 5.0 s")
        history.heal_done(now, members[i % 1024], {"transfer_s": 1.0, "transfer_bytes": 10**9})
        history.step_seen(now, i)
    size = len(json.dumps(history.document(now)))
    assert size < 4_000_000, size


def test_quorum_changes_name_who_joined_and_left() -> None:
    history = JobHistory()
    history.quorum_formed(10.0, 1, ("a", "b"), "first")
    history.quorum_formed(12.0, 2, ("b", "c"), "a died")
    doc = history.document(13.0)
    second = doc["events"][-1]
    assert (second["joined"], second["left"], second["members"]) == (["c"], ["a"], 2)
    assert doc["participants"] == [[10.0, 2], [12.0, 2]]


def test_failures_are_classified_by_cause() -> None:
    assert failure_cause("its connection to the lighthouse closed 0.6 s ago") == FAILURE_CAUSES[0]
    assert failure_cause("no heartbeat for 5.2 s (heartbeat timeout 5 s)") == FAILURE_CAUSES[1]
    assert failure_cause("it left the job") == FAILURE_CAUSES[2]


def test_a_heal_in_flight_ends_with_its_timeline_and_counts() -> None:
    history = JobHistory()
    history.heal_progress(1.0, "g1", {"phase": "transfer", "bytes_done": 5, "bytes_total": 10})
    assert history.document(1.5)["in_flight"][0]["phase"] == "transfer"
    history.heal_done(
        2.0,
        "g1",
        {"quorum_s": 0.1, "reconfigure_s": 0.2, "transfer_s": 0.3, "load_s": 0.4, "step": 7},
    )
    doc = history.document(2.5)
    assert doc["in_flight"] == []
    heal = doc["events"][-1]
    parts = heal["quorum_s"] + heal["reconfigure_s"] + heal["transfer_s"] + heal["load_s"]
    assert heal["total_s"] == pytest.approx(parts) and heal["step"] == 7
    assert doc["heals_total"] == 1 and doc["heal_seconds_total"] == pytest.approx(1.0)


def test_failovers_join_the_events_in_time_order() -> None:
    history = JobHistory()
    history.quorum_formed(100.0, 1, ("a",), "first")
    history.quorum_formed(300.0, 2, ("a", "b"), "b joined")
    doc = history.document(400.0)
    merge_failovers(
        doc,
        [
            {"time": 200.0, "leader": "r2", "previous": "r1"},
            {"time": -5000.0, "leader": "r1", "previous": None},  # outside the window
        ],
    )
    assert [e["kind"] for e in doc["events"]] == ["quorum", "failover", "quorum"]


def test_a_past_member_that_dies_is_a_failure_once_and_a_stranger_is_none() -> None:
    history = JobHistory()
    history.quorum_formed(1.0, 1, ("a", "b"), "first")
    history.quorum_formed(2.0, 2, ("a",), "b's peers moved on first")
    history.lost(2.5, "b", "its connection to the lighthouse closed 0.2 s ago")
    history.lost(2.6, "b", "no heartbeat for 5 s or more")  # the same death, seen again
    history.lost(2.7, "stranger", "its connection to the lighthouse closed 0.2 s ago")
    history.member_failed(3.0, "a", "it left the job")
    history.lost(3.5, "a", "its connection to the lighthouse closed 0.2 s ago")  # after leaving
    doc = history.document(4.0)
    ends = [(e["replica_id"], e["cause"]) for e in doc["events"] if e["kind"] == "failure"]
    assert ends == [("b", "connection closed"), ("a", "left")]
