"""
``ftdist status``'s text
========================

The status document (:func:`ftdist.lighthouse.status.build_status`, with a
replicated lighthouse's ``replication`` section) rendered for a terminal:
the quorum and its members, the waiting requests and why the next quorum is
or is not ready, the heartbeats, and a replica set's roles, etcd health,
lease and failovers. Plain text only; every value from the document is
cleaned of control characters, since a lighthouse is not trusted to send
printable ones.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from ftdist.cli._terminal import clean as _clean
from ftdist.cli.history_text import render_history

__all__ = ["render"]

_PROG = "ftdist status"
_FAILOVERS_SHOWN = 5


def _duration(seconds: object) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    s = float(seconds)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d {int(s % 86400 // 3600):02d}h"


def _ago(seconds: object) -> str:
    text = _duration(seconds)
    return text if text == "-" else f"{text} ago"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()
) -> list[str]:
    """Columns padded to their widest cell; columns in ``right`` right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return ("  " + "  ".join(padded)).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _number(value: object) -> str:
    return "-" if value is None else _clean(value)


def _member_state(member: Mapping[str, Any]) -> str:
    flags = []
    if member.get("recovering"):
        flags.append("recovering")
    if member.get("shrink_only"):
        flags.append("shrink-only")
    failures = member.get("commit_failures") or 0
    if failures:
        flags.append(_plural(int(failures), "commit failure"))
    return ", ".join(flags) or "ok"


def _settings_line(settings: Mapping[str, Any]) -> str:
    parts = []
    if "min_replicas" in settings:
        parts.append(f"min_replicas {_clean(settings['min_replicas'])}")
    for key, label in (
        ("join_timeout_ms", "join timeout"),
        ("heartbeat_timeout_ms", "heartbeat timeout"),
    ):
        value = settings.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {_duration(value / 1000)}")
    return ", ".join(parts)


def render(document: Mapping[str, Any], address: str) -> str:
    """Render a status document as the text ``ftdist status`` prints.

    Keys the document lacks are skipped, so documents from older or newer
    lighthouses render too. A replica of a replicated lighthouse adds a
    "replicas" section; a follower's, which holds no quorum, says which
    replica does.

    Args:
        document: a document from :meth:`LighthouseClient.status`
            (:func:`ftdist.lighthouse.status.build_status`).
        address: the lighthouse address, for the heading.

    Returns:
        The text, ending in a newline.
    """
    lines: list[str] = []
    heading = f"Lighthouse {_clean(address)}"
    facts = []
    replication = document.get("replication")
    if not isinstance(replication, Mapping):
        replication = None
    if replication is not None:
        facts.append(
            f"{_clean(replication.get('role') or 'replica')} of job {_clean(replication.get('job'))}"
        )
    if "uptime_s" in document:
        facts.append(f"up {_duration(document['uptime_s'])}")
    if "quorums_total" in document:
        facts.append(f"{_plural(int(document['quorums_total']), 'quorum')} formed")
    if document.get("member_failures_total"):
        facts.append(_plural(int(document["member_failures_total"]), "member failure"))
    settings = _settings_line(document.get("settings") or {})
    if settings:
        facts.append(settings)
    lines.append(heading + (f" ({'; '.join(facts)})" if facts else ""))

    quorum = document.get("quorum")
    if not quorum and replication is not None and replication.get("role") != "leader":
        lines.append(_kept_by_leader(replication))
    elif not quorum:
        lines.append("Quorum: none formed yet")
    else:
        members = list(quorum.get("members") or [])
        created = quorum.get("created")
        when = ""
        if isinstance(created, str):
            with contextlib.suppress(ValueError):
                when = (
                    " ("
                    + dt.datetime.fromisoformat(created).strftime("%Y-%m-%d %H:%M:%S UTC")
                    + ")"
                )
        title = f"Quorum {_clean(quorum.get('quorum_id'))}"
        if "age_s" in quorum:
            title += f", formed {_ago(quorum['age_s'])}{when}"
        title += f"; {_plural(len(members), 'member')}"
        if "max_step" in quorum:
            title += f", max step {_clean(quorum['max_step'])}"
        lines.append(title)
        if members:
            lines.append("")
            rows = [
                [
                    _clean(m.get("replica_id")),
                    _number(m.get("step")),
                    _number(m.get("world_size")),
                    _member_state(m),
                    _ago(m.get("heartbeat_age_s")),
                    _clean(m.get("address")) or "-",
                ]
                for m in members
            ]
            lines.extend(
                _table(
                    ["REPLICA", "STEP", "WORLD", "STATE", "HEARTBEAT", "MANAGER"],
                    rows,
                    right=frozenset({1, 2}),
                )
            )
    lines.append("")
    next_quorum = document.get("next_quorum") or {}
    if next_quorum:
        state = "ready" if next_quorum.get("ready") else "not ready"
        reason = _clean(next_quorum.get("reason"))
        lines.append(f"Next quorum: {state}" + (f": {reason}" if reason else ""))
    waiting = list(document.get("waiting") or [])
    if waiting:
        lines.append(f"Waiting for the next quorum: {_plural(len(waiting), 'request')}")
        lines.extend(
            _table(
                ["REPLICA", "STEP", "WAITED"],
                [
                    [
                        _clean(w.get("replica_id")),
                        _number(w.get("step")),
                        _duration(w.get("waited_s")),
                    ]
                    for w in waiting
                ],
                right=frozenset({1}),
            )
        )
    elif next_quorum:
        lines.append("Waiting for the next quorum: none")

    heartbeats = list(document.get("heartbeats") or [])
    lines.append("")
    if not heartbeats:
        lines.append("Heartbeats: none")
    else:
        healthy = sum(1 for h in heartbeats if h.get("healthy"))
        lines.append(
            f"Heartbeats: {_plural(len(heartbeats), 'replica group')}, {healthy} within the "
            "heartbeat timeout"
        )
        lines.extend(
            _table(
                ["REPLICA", "LAST HEARTBEAT", ""],
                [
                    [
                        _clean(h.get("replica_id")),
                        _ago(h.get("age_s")),
                        "" if h.get("healthy") else "expired",
                    ]
                    for h in heartbeats
                ],
            )
        )
    if replication is not None:
        lines.append("")
        lines.extend(_replicas_section(replication))
    history = document.get("history")
    if isinstance(history, Mapping):
        lines.append("")
        lines.extend(render_history(history))
    return "\n".join(lines) + "\n"


def _kept_by_leader(replication: Mapping[str, Any]) -> str:
    """Where a follower's (or candidate's) missing quorum view is."""
    leader = replication.get("leader")
    if not isinstance(leader, Mapping):
        return "Quorum: kept by the leader; none is elected right now"
    return (
        f"Quorum: kept by the leader, {_clean(leader.get('name'))}; ask it with "
        f"'{_PROG} {_clean(leader.get('address'))}'"
    )


def _utc(unix_s: object) -> str:
    if not isinstance(unix_s, (int, float)) or isinstance(unix_s, bool):
        return "-"
    try:
        when = dt.datetime.fromtimestamp(unix_s, dt.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return "-"
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _replicas_section(replication: Mapping[str, Any]) -> list[str]:
    """The "replicas" section: the replica set of a replicated lighthouse."""
    lines: list[str] = []
    name = replication.get("name")
    leader = replication.get("leader")
    if isinstance(leader, Mapping):
        who = f"leader {_clean(leader.get('name'))} ({_clean(leader.get('address'))})"
    else:
        who = "no leader (an election is under way)"
    lines.append(f"Replicas of job {_clean(replication.get('job'))}: {who}")
    replicas = [r for r in replication.get("replicas") or [] if isinstance(r, Mapping)]
    if replicas:
        lines.extend(
            _table(
                ["REPLICA", "ROLE", "ADDRESS", "DASHBOARD", ""],
                [
                    [
                        _clean(r.get("name")),
                        _clean(r.get("role")) or "-",
                        _clean(r.get("address")) or "-",
                        _clean(r.get("dashboard")) or "-",
                        "this replica" if r.get("name") == name else "",
                    ]
                    for r in replicas
                ],
            )
        )
    lease = replication.get("lease")
    if isinstance(lease, Mapping):
        lease_text = f"TTL {_duration(lease.get('ttl_s'))}, {_duration(lease.get('left_s'))} left"
    else:
        lease_text = "none"
    serving = "serving" if replication.get("serving") else "not serving"
    reason = _clean(replication.get("serving_reason"))
    lines.append(
        f"This replica {_clean(name)}: {_clean(replication.get('role'))}, lease {lease_text}; "
        + serving
        + (f": {reason}" if reason else "")
    )
    if replication.get("last_error"):
        lines.append(f"Last etcd error: {_clean(replication['last_error'])}")

    members = [m for m in replication.get("etcd") or [] if isinstance(m, Mapping)]
    lines.append("")
    if not members:
        endpoints = ", ".join(_clean(e) for e in replication.get("etcd_endpoints") or [])
        lines.append(f"etcd: {endpoints or '-'} (not probed yet)")
    else:
        healthy = sum(1 for m in members if m.get("ok"))
        lines.append(f"etcd: {_plural(len(members), 'endpoint')}, {healthy} ok")

        def latency(member: Mapping[str, Any]) -> str:
            value = member.get("latency_ms")
            if not member.get("ok") or not isinstance(value, (int, float)):
                return "-"
            return f"{value:.1f} ms"

        lines.extend(
            _table(
                ["ENDPOINT", "STATE", "VERSION", "RAFT", "LATENCY"],
                [
                    [
                        _clean(m.get("endpoint")),
                        "ok" if m.get("ok") else f"error: {_clean(m.get('error'))}",
                        _clean(m.get("version")) or "-",
                        "leader" if m.get("is_raft_leader") else "",
                        latency(m),
                    ]
                    for m in members
                ],
                right=frozenset({4}),
            )
        )

    failovers = [f for f in replication.get("failovers") or [] if isinstance(f, Mapping)]
    lines.append("")
    if not failovers:
        lines.append("Failovers: none recorded")
    else:
        shown = failovers[:_FAILOVERS_SHOWN]
        more = f", the newest {len(shown)} shown" if len(shown) < len(failovers) else ""
        lines.append(f"Failovers: {len(failovers)} recorded{more}, newest first")
        lines.extend(
            _table(
                ["TIME", "NEW LEADER", "PREVIOUS"],
                [
                    [_utc(f.get("time")), _clean(f.get("leader")), _clean(f.get("previous")) or "-"]
                    for f in shown
                ],
            )
        )
    return lines
