"""
Lighthouse status
=================

The lighthouse described as plain data: the current quorum and its members,
why the next quorum is or is not ready, heartbeats, counters and the quorum
latency histogram. The dashboard serves it as ``/status.json`` and, rendered
by :func:`render_metrics`, as Prometheus ``/metrics``; ``ftdist status``
fetches it over gRPC (``ftdist.LighthouseEvents/Status``).
"""

from __future__ import annotations

import datetime as dt
import functools
import time
from typing import Any

from ftdist.lighthouse.config import LighthouseConfig
from ftdist.lighthouse.engine import LighthouseEngine

__all__ = ["build_status", "render_metrics"]


def _round3(value: float) -> float:
    return round(value, 3)


def build_status(engine: LighthouseEngine, config: LighthouseConfig) -> dict[str, Any]:
    """Describe the lighthouse as plain JSON-ready data.

    Must run on the engine's event loop.

    Args:
        engine: the lighthouse's engine.
        config: the lighthouse's config.

    Returns:
        The status document served at ``/status.json``.
    """
    now = engine.now()
    state = engine.state
    heartbeat_timeout = engine.settings.heartbeat_timeout_s
    decision = engine.decide()
    heartbeats = [
        {
            "replica_id": rid,
            "age_s": _round3(now - seen),
            "healthy": now - seen < heartbeat_timeout,
        }
        for rid, seen in sorted(state.heartbeats.items())
    ]
    quorum: dict[str, Any] | None = None
    current = engine.current
    if current is not None:
        members = current.quorum.participants
        max_step = max((m.step for m in members), default=-1)
        created = current.quorum.created.ToDatetime(tzinfo=dt.timezone.utc)
        quorum = {
            "quorum_id": current.quorum.quorum_id,
            "created": created.isoformat(),
            "age_s": _round3(now - current.formed_at),
            "num_members": len(members),
            "max_step": max_step,
            "members": [
                {
                    "replica_id": m.replica_id,
                    "step": m.step,
                    "address": m.address,
                    "store_address": m.store_address,
                    "world_size": m.world_size,
                    "shrink_only": m.shrink_only,
                    "commit_failures": m.commit_failures,
                    "recovering": m.step != max_step,
                    "heartbeat_age_s": (
                        _round3(now - state.heartbeats[m.replica_id])
                        if m.replica_id in state.heartbeats
                        else None
                    ),
                }
                for m in members
            ],
        }
    latency = engine.latency
    buckets = latency.cumulative()
    return {
        "quorum_id": state.quorum_id,
        "next_quorum": {"ready": decision.ready, "reason": decision.reason},
        "quorum": quorum,
        "waiting": [
            {"replica_id": rid, "step": p.member.step, "waited_s": _round3(now - p.joined)}
            for rid, p in sorted(state.participants.items())
        ],
        "heartbeats": heartbeats,
        "num_heartbeating": sum(1 for h in heartbeats if h["healthy"]),
        "num_subscribers": engine.num_subscribers,
        "quorums_total": engine.num_quorums,
        "member_failures_total": engine.num_member_failures,
        "quorum_latency_seconds": {
            "buckets": buckets,
            "sum": latency.total,
            "count": buckets[-1][1],
        },
        "settings": {
            "min_replicas": config.min_replicas,
            "join_timeout_ms": config.join_timeout / dt.timedelta(milliseconds=1),
            "quorum_tick_ms": config.quorum_tick / dt.timedelta(milliseconds=1),
            "heartbeat_timeout_ms": config.heartbeat_timeout / dt.timedelta(milliseconds=1),
            "kill_enabled": config.kill_token is not None or config.token is not None,
            "token_required": config.token is not None,
            "tls": config.tls_cert is not None,
        },
        "uptime_s": _round3(now - engine.started_at),
        "history": engine.history.document(time.time()),
    }


def _metric(lines: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    lines.append(f"{name} {value:g}")


def _histogram(
    lines: list[str], name: str, help_text: str, buckets: list[Any], total: float, count: int
) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    for bound, in_bucket in buckets:
        le = bound if isinstance(bound, str) else f"{bound:g}"
        lines.append(f'{name}_bucket{{le="{le}"}} {in_bucket}')
    lines.append(f"{name}_sum {total:.6f}")
    lines.append(f"{name}_count {count}")


def render_metrics(status: dict[str, Any]) -> str:
    """Render a status document in the Prometheus text exposition format.

    Args:
        status: a document from :func:`build_status`.

    Returns:
        The ``/metrics`` body.

    Raises:
        KeyError: if ``status`` lacks a field :func:`build_status` produces.
    """
    quorum = status["quorum"]
    lines: list[str] = []

    metric = functools.partial(_metric, lines)

    prefix = "ftdist_lighthouse"
    metric(
        f"{prefix}_quorum_id",
        "gauge",
        "Id of the current quorum (0 before the first).",
        status["quorum_id"],
    )
    metric(
        f"{prefix}_quorum_members",
        "gauge",
        "Members of the current quorum.",
        quorum["num_members"] if quorum else 0,
    )
    metric(
        f"{prefix}_heartbeating_replicas",
        "gauge",
        "Replica groups whose last heartbeat is within the heartbeat timeout.",
        status["num_heartbeating"],
    )
    metric(
        f"{prefix}_waiting_requests",
        "gauge",
        "Quorum requests waiting for the next quorum.",
        len(status["waiting"]),
    )
    metric(
        f"{prefix}_next_quorum_ready",
        "gauge",
        "1 if a quorum could form now, else 0.",
        1 if status["next_quorum"]["ready"] else 0,
    )
    metric(
        f"{prefix}_event_subscribers",
        "gauge",
        "Open failure-news streams.",
        status["num_subscribers"],
    )
    metric(
        f"{prefix}_quorums_total", "counter", "Quorums formed since start.", status["quorums_total"]
    )
    metric(
        f"{prefix}_member_failures_total",
        "counter",
        "Quorum members declared dead after missing heartbeats.",
        status["member_failures_total"],
    )
    history = status.get("history")
    if history is not None:
        lines.extend(_history_metrics(prefix, history))
    hist = status["quorum_latency_seconds"]
    _histogram(
        lines,
        f"{prefix}_quorum_latency_seconds",
        "Time from a round's first quorum request to its quorum.",
        hist["buckets"],
        hist["sum"],
        hist["count"],
    )
    replication = status.get("replication")
    if replication is not None:
        # A replicated lighthouse: every replica serves these, so a
        # scrape of all of them shows which one leads.
        metric(
            f"{prefix}_is_leader",
            "gauge",
            "1 if this replica is the elected leader of its job's lighthouse, else 0.",
            1 if replication["role"] == "leader" else 0,
        )
        metric(
            f"{prefix}_serving",
            "gauge",
            "1 if this replica answers quorum calls itself (leader, lease valid), else 0.",
            1 if replication["serving"] else 0,
        )
        metric(
            f"{prefix}_replicas",
            "gauge",
            "Live replicas of this job's lighthouse registered in etcd.",
            len(replication["replicas"]),
        )
        # A gauge, not a counter: the records etcd keeps, as many as the
        # status shows; it neither starts at 0 with this process nor only grows.
        metric(
            f"{prefix}_failovers",
            "gauge",
            "Leader elections recorded in etcd (the newest 20 at most).",
            len(replication["failovers"]),
        )
        lease = replication["lease"]
        metric(
            f"{prefix}_lease_left_seconds",
            "gauge",
            "Time left on this replica's etcd lease (0 without one).",
            lease["left_s"] if lease else 0,
        )
        name = f"{prefix}_etcd_up"
        lines.append(
            f"# HELP {name} 1 if this replica's last probe of the etcd endpoint succeeded."
        )
        lines.append(f"# TYPE {name} gauge")
        for member in replication["etcd"]:
            # Label values escape backslash, quote and newline (exposition format).
            endpoint = (
                str(member["endpoint"])
                .replace("\\", "\\\\")
                .replace('"', '\\"')
                .replace("\n", "\\n")
            )
            lines.append(f'{name}{{endpoint="{endpoint}"}} {1 if member["ok"] else 0}')
    return "\n".join(lines) + "\n"


def _history_metrics(prefix: str, history: dict[str, Any]) -> list[str]:
    """The history's counters and heal histogram, in the exposition format."""
    lines: list[str] = []

    metric = functools.partial(_metric, lines)

    metric(
        f"{prefix}_quorum_changes_total",
        "counter",
        "Quorums formed with another id than the last one (membership changes, forced ones).",
        history["quorum_changes_total"],
    )
    name = f"{prefix}_failures_total"
    lines.append(f"# HELP {name} Members that left the job or were declared dead, by cause.")
    lines.append(f"# TYPE {name} counter")
    for cause, count in sorted(history["failures_by_cause"].items()):
        lines.append(f'{name}{{cause="{cause}"}} {count}')
    metric(
        f"{prefix}_heals_total",
        "counter",
        "Heals that replica groups reported as finished.",
        history["heals_total"],
    )
    _histogram(
        lines,
        f"{prefix}_heal_seconds",
        "Reported heals' durations (quorum, reconfigure, transfer, load).",
        history["heal_seconds_buckets"],
        history["heal_seconds_total"],
        history["heals_total"],
    )
    metric(
        f"{prefix}_heal_bytes_total",
        "counter",
        "Bytes the reported heals transferred.",
        history["heal_bytes_total"],
    )
    metric(
        f"{prefix}_heals_in_flight",
        "gauge",
        "Replica groups healing now (as they last reported).",
        len(history["in_flight"]),
    )
    return lines
