"""
The job's recent history
========================

What an operator asks during an incident: how many groups trained over the
last minutes, when each failure happened and how long the group took to come
back, whether the step rate dropped, which group is healing and how far its
transfer is. The lighthouse records it here as it happens, on its own
thread; the dashboard draws it, ``/status.json`` carries it and ``ftdist
status --watch`` prints it.

Bounded whatever the job's size or length: entries older than
:attr:`HistoryLimits.max_age_s` (an hour) are dropped, and so are the oldest
beyond each kind's count; a quorum change lists at most
:attr:`HistoryLimits.max_names` joined and left ids (the counts are exact),
and every id is cut to :data:`MAX_ID_CHARS`. With the defaults the history
stays under a few MB (``tests/unit/test_history.py`` checks the bound).

Times are wall-clock seconds (``time.time()``), as the browser and the
terminal show them. Every method takes ``now``: the record is a pure
function of its inputs.
"""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAILURE_CAUSES",
    "HEAL_PHASES",
    "Histogram",
    "HistoryLimits",
    "JobHistory",
    "failure_cause",
    "merge_failovers",
    "record_heal_report",
]

MAX_ID_CHARS = 128
# A heal's phases while it runs, then how it ended (HealReport.phase).
HEAL_PHASES = ("quorum", "reconfigure", "transfer", "load")
_HEAL_ENDS = ("done", "failed")
# What ended a member's part in the job, as the dashboard counts it.
FAILURE_CAUSES = ("connection closed", "heartbeat timeout", "left")


def failure_cause(reason: str) -> str:
    """The cause class of a failure reason the lighthouse reports."""
    if "connection" in reason:
        return "connection closed"
    if "heartbeat" in reason:
        return "heartbeat timeout"
    return "left"


class Histogram:
    """Counts per bucket, Prometheus style (cumulated when rendered)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in its bucket."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[list[Any]]:
        """``[[upper bound, count at or below it], ...]``, the last bound ``"+Inf"``."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            out.append(["+Inf" if math.isinf(bound) else bound, running])
        return out


# Heal durations, seconds: from a fast local heal to a cross-datacenter one.
HEAL_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _short(replica_id: str) -> str:
    return replica_id[:MAX_ID_CHARS]


@dataclass(frozen=True)
class HistoryLimits:
    """How much history is kept.

    Attributes:
        max_age_s: entries older than this are dropped.
        max_events: events kept (quorum changes, failures, heals, failovers).
        max_samples: committed-step samples kept (one a second at most).
        max_names: ids listed per quorum change (joined and left each).
        max_in_flight: heals in flight tracked at once.
        max_ids: member ids remembered (to recognise a past member's death,
            and to record each death once).
    """

    max_age_s: float = 3600.0
    max_events: int = 2000
    max_samples: int = 3600
    max_names: int = 16
    max_in_flight: int = 256
    max_ids: int = 8192


@dataclass
class JobHistory:
    """The lighthouse's bounded record of the job (see the module docstring)."""

    limits: HistoryLimits = field(default_factory=HistoryLimits)
    events: collections.deque[dict[str, Any]] = field(default_factory=collections.deque)
    # (time, members) at each quorum change: the participants strip.
    participants: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    # (time, max committed step) at most once a second: the step rate.
    steps: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    in_flight: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures_by_cause: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FAILURE_CAUSES, 0)
    )
    heals_total: int = 0
    heal_seconds: Histogram = field(default_factory=lambda: Histogram(HEAL_BUCKETS_S))
    heal_seconds_total: float = 0.0
    heal_bytes_total: int = 0
    quorum_changes_total: int = 0
    _members: frozenset[str] = frozenset()
    _max_step: int = -1
    # Ids that were quorum members, and those whose end is recorded (oldest first).
    _seen: dict[str, None] = field(default_factory=dict)
    _ended: dict[str, None] = field(default_factory=dict)

    # -- recording ------------------------------------------------------------

    def quorum_formed(
        self, now: float, quorum_id: int, member_ids: tuple[str, ...], reason: str
    ) -> None:
        """A quorum with another membership (or id) than the last one formed."""
        members = frozenset(member_ids)
        joined = sorted(members - self._members)
        left = sorted(self._members - members)
        self._members = members
        for rid in joined:
            _remember(self._seen, rid, self.limits.max_ids)
        self.quorum_changes_total += 1
        cap = self.limits.max_names
        self._event(
            now,
            "quorum",
            quorum_id=quorum_id,
            members=len(members),
            joined=[_short(r) for r in joined[:cap]],
            num_joined=len(joined),
            left=[_short(r) for r in left[:cap]],
            num_left=len(left),
            reason=reason[:200],
        )
        self.participants.append((now, len(members)))
        self._prune(now)

    def member_failed(self, now: float, replica_id: str, reason: str) -> None:
        """A member failed or left; ``reason`` is the lighthouse's own words.

        Each replica id ends once: later reports of the same one are ignored.
        """
        if replica_id in self._ended:
            return
        _remember(self._ended, replica_id, self.limits.max_ids)
        cause = failure_cause(reason)
        self.failures_by_cause[cause] += 1
        self.in_flight.pop(replica_id, None)
        self._event(now, "failure", replica_id=_short(replica_id), cause=cause, reason=reason[:200])
        self._prune(now)

    def lost(self, now: float, replica_id: str, reason: str) -> None:
        """A replica's stream closed or its heartbeats stopped, in or out of the quorum.

        Recorded as a failure when it was a member of a quorum: its peers may
        have formed the next quorum without it (their collective failed
        first) before the lighthouse saw it go.
        """
        if replica_id in self._seen:
            self.member_failed(now, replica_id, reason)

    def step_seen(self, now: float, step: int) -> None:
        """A member asked for a quorum at ``step`` (its committed steps)."""
        if step <= self._max_step:
            return
        self._max_step = step
        if self.steps and now - self.steps[-1][0] < 1.0:
            self.steps[-1] = (self.steps[-1][0], step)
        else:
            self.steps.append((now, step))
        self._prune(now)

    def heal_progress(self, now: float, replica_id: str, report: dict[str, Any]) -> None:
        """A healing group's progress (``phase``, ``bytes_done``, ``bytes_total``, ...)."""
        rid = _short(replica_id)
        if rid not in self.in_flight and len(self.in_flight) >= self.limits.max_in_flight:
            return
        entry = self.in_flight.setdefault(rid, {"replica_id": rid, "started": now})
        entry.update(report, updated=now)

    def heal_done(self, now: float, replica_id: str, timeline: dict[str, Any]) -> None:
        """A group finished a heal; ``timeline`` has its phases in seconds and its bytes."""
        rid = _short(replica_id)
        self.in_flight.pop(rid, None)
        total = sum(float(timeline.get(k, 0.0)) for k in _PHASES)
        self.heals_total += 1
        self.heal_seconds.observe(total)
        self.heal_seconds_total += total
        self.heal_bytes_total += int(timeline.get("transfer_bytes", 0))
        phases = {k: round(float(timeline.get(k, 0.0)), 4) for k in _PHASES}
        self._event(
            now,
            "heal",
            replica_id=rid,
            step=int(timeline.get("step", -1)),
            ok=bool(timeline.get("ok", True)),
            total_s=round(total, 4),
            transfer_bytes=int(timeline.get("transfer_bytes", 0)),
            **phases,
        )
        self._prune(now)

    def failover(self, now: float, leader: str, previous: str) -> None:
        """A replicated lighthouse elected a new leader."""
        self._event(now, "failover", leader=leader[:200], previous=previous[:200])
        self._prune(now)

    # -- reading --------------------------------------------------------------

    def document(self, now: float) -> dict[str, Any]:
        """The history as plain data (the ``history`` part of ``/status.json``)."""
        self._prune(now)
        return {
            "now": now,
            "max_age_s": self.limits.max_age_s,
            "events": list(self.events),
            "participants": [[round(t, 3), n] for t, n in self.participants],
            "steps": [[round(t, 3), s] for t, s in self.steps],
            "in_flight": sorted(self.in_flight.values(), key=lambda e: e["replica_id"]),
            "failures_by_cause": dict(self.failures_by_cause),
            "quorum_changes_total": self.quorum_changes_total,
            "heals_total": self.heals_total,
            "heal_seconds_total": round(self.heal_seconds_total, 4),
            "heal_seconds_buckets": self.heal_seconds.cumulative(),
            "heal_bytes_total": self.heal_bytes_total,
        }

    # -- bounds ---------------------------------------------------------------

    def _event(self, now: float, kind: str, **fields: Any) -> None:
        self.events.append({"t": round(now, 3), "kind": kind, **fields})

    def _prune(self, now: float) -> None:
        oldest = now - self.limits.max_age_s
        for series, cap in (
            (self.events, self.limits.max_events),
            (self.participants, self.limits.max_events),
            (self.steps, self.limits.max_samples),
        ):
            while series and (len(series) > cap or _time(series[0]) < oldest):
                series.popleft()
        stale = [rid for rid, e in self.in_flight.items() if e["updated"] < oldest]
        for rid in stale:
            del self.in_flight[rid]


_PHASES = ("quorum_s", "reconfigure_s", "transfer_s", "load_s")


def record_heal_report(history: JobHistory, now: float, report: Any) -> str | None:
    """Record a manager's ``HealReport`` (a protobuf message); why it is refused, or None."""
    replica_id = str(report.replica_id)
    if not replica_id or len(replica_id) > 4096:
        return "replica_id must be 1 to 4096 characters"
    phase = str(report.phase)
    if phase not in HEAL_PHASES and phase not in _HEAL_ENDS:
        return f"phase {phase[:40]!r} is none of {', '.join(HEAL_PHASES + _HEAL_ENDS)}"
    seconds = {k: float(getattr(report, k)) for k in _PHASES}
    if not all(0.0 <= v < 1e7 for v in seconds.values()):
        return "phase durations must be seconds between 0 and 1e7"
    fields: dict[str, Any] = {
        "step": int(report.step),
        "quorum_id": int(report.quorum_id),
        "transfer_bytes": max(0, int(report.transfer_bytes)),
        **seconds,
    }
    if phase == "transfer":
        fields["bytes_done"] = max(0, int(report.bytes_done))
    if phase in _HEAL_ENDS:
        history.heal_done(now, replica_id, {**fields, "ok": phase == "done"})
        if phase == "failed":
            history.events[-1]["error"] = str(report.error)[:200]
    else:
        history.heal_progress(now, replica_id, {**fields, "phase": phase})
    return None


def merge_failovers(document: dict[str, Any], failovers: list[dict[str, Any]]) -> None:
    """Add a replicated lighthouse's failover records (etcd's) to a history document.

    They are kept in etcd, not here, so that every replica shows the same
    ones; they join the events in time order, within the document's window.
    """
    oldest = document["now"] - document["max_age_s"]
    events = document["events"]
    for record in failovers:
        t = record.get("time")
        if not isinstance(t, (int, float)) or t < oldest:
            continue
        events.append(
            {
                "t": round(float(t), 3),
                "kind": "failover",
                "leader": str(record.get("leader", ""))[:200],
                "previous": str(record.get("previous") or "")[:200],
            }
        )
    events.sort(key=lambda e: e["t"])


def _remember(ids: dict[str, None], replica_id: str, cap: int) -> None:
    ids[replica_id] = None
    while len(ids) > cap:
        del ids[next(iter(ids))]


def _time(entry: Any) -> float:
    return float(entry["t"] if isinstance(entry, dict) else entry[0])
