"""
The job's history in a terminal
===============================

``ftdist status`` (and ``--watch``) prints the lighthouse's recent history
(:mod:`ftdist.lighthouse.history`) under the current quorum: a strip of the
participating groups over time, with a mark under each failure (``x``), heal
(``h``) and failover (``^``), the committed step rate, the heals in flight,
and one line per recent event, newest last. Pure: a document in, text out.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from ftdist.cli._terminal import clean

__all__ = ["render_history"]

# Columns of the strip, and the events listed.
STRIP_WIDTH = 60
MAX_EVENT_LINES = 12
_LEVELS = " ▁▂▃▄▅▆▇█"
_MARKS = {"failure": "x", "heal": "h", "failover": "^"}


def _clock(t: object) -> str:
    if not isinstance(t, (int, float)):
        return "--:--:--"
    return dt.datetime.fromtimestamp(float(t)).strftime("%H:%M:%S")


def _names(names: Sequence[Any], count: object) -> str:
    shown = ", ".join(clean(str(n)[:40]) for n in names)
    more = int(count) - len(names) if isinstance(count, int) else 0
    return shown + (f" and {more} more" if more > 0 else "")


def _event_line(event: Mapping[str, Any]) -> str:
    kind = event.get("kind")
    when = _clock(event.get("t"))
    if kind == "quorum":
        changes = []
        if event.get("num_joined"):
            changes.append("+" + _names(event.get("joined", []), event.get("num_joined")))
        if event.get("num_left"):
            changes.append("-" + _names(event.get("left", []), event.get("num_left")))
        what = f"; {'; '.join(changes)}" if changes else ""
        return f"{when}  quorum {event.get('quorum_id')}: {event.get('members')} groups{what}"
    if kind == "failure":
        return f"{when}  {clean(event.get('cause'))}: {clean(str(event.get('replica_id'))[:60])}"
    if kind == "heal":
        phases = ", ".join(
            f"{name} {float(event.get(name + '_s', 0.0)):.2f}"
            for name in ("quorum", "reconfigure", "transfer", "load")
        )
        outcome = "healed" if event.get("ok", True) else "heal FAILED"
        size = int(event.get("transfer_bytes", 0))
        seconds = float(event.get("transfer_s", 0.0))
        rate = f" at {size / seconds / 1e9:.2f} GB/s" if seconds > 0 else ""
        return (
            f"{when}  {outcome}: {clean(str(event.get('replica_id'))[:60])} to step "
            f"{clean(event.get('step'))} "
            f"in {float(event.get('total_s', 0.0)):.2f} s ({phases}; {size / 1e6:.1f} MB{rate})"
        )
    if kind == "failover":
        was = clean(event.get("previous") or "none")
        return f"{when}  lighthouse failover: {clean(event.get('leader'))} leads (was {was})"
    return f"{when}  {clean(kind)}"


def _strip(history: Mapping[str, Any], start: float, end: float) -> tuple[str, str]:
    width = end - start
    points = history.get("participants") or []
    cells = [0] * STRIP_WIDTH
    level, i = 0, 0
    for col in range(STRIP_WIDTH):
        col_end = start + width * (col + 1) / STRIP_WIDTH
        # The last membership reached by the end of the column.
        while i < len(points) and points[i][0] <= col_end:
            level = int(points[i][1])
            i += 1
        cells[col] = level
    top = max(cells) or 1
    bar = "".join(_LEVELS[round(c / top * (len(_LEVELS) - 1))] if c else "." for c in cells)
    marks = [" "] * STRIP_WIDTH
    for event in history.get("events") or []:
        mark = _MARKS.get(str(event.get("kind")))
        if event.get("cause") == "left":
            continue  # a group that left did not fail
        t = event.get("t")
        if mark and isinstance(t, (int, float)) and start <= t <= end:
            col = min(STRIP_WIDTH - 1, int((t - start) / width * STRIP_WIDTH))
            marks[col] = mark if marks[col] in (" ", mark) else "*"
    return bar, "".join(marks)


def _step_rate(history: Mapping[str, Any], now: float, over_s: float = 30.0) -> str:
    steps = [s for s in history.get("steps") or [] if now - s[0] <= over_s]
    if len(steps) < 2 or steps[-1][0] <= steps[0][0]:
        return "no steps committed lately"
    rate = (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0])
    return f"{rate:.1f} committed steps/s over the last {steps[-1][0] - steps[0][0]:.0f} s"


def render_history(history: Mapping[str, Any], window_s: float = 600.0) -> list[str]:
    """The history section's lines for a status document's ``history``."""
    now = float(history.get("now", 0.0))
    start = now - min(window_s, float(history.get("max_age_s", window_s)))
    bar, marks = _strip(history, start, now)
    minutes = (now - start) / 60
    top = max((int(p[1]) for p in history.get("participants") or []), default=0)
    lines = [
        f"History (last {minutes:.0f} min; {_step_rate(history, now)}):",
        f"  groups  |{bar}| max {top}",
        f"          |{marks}| x failure  h heal  ^ failover",
    ]
    causes = history.get("failures_by_cause") or {}
    counted = ", ".join(f"{n} {clean(cause)}" for cause, n in causes.items() if n)
    lines.append(
        f"  failures: {counted or 'none'}; heals: {history.get('heals_total', 0)}; "
        f"quorum changes: {history.get('quorum_changes_total', 0)}"
    )
    for heal in history.get("in_flight") or []:
        since = now - float(heal.get("started", now))
        total = int(heal.get("transfer_bytes") or 0)
        done = int(heal.get("bytes_done") or 0)
        far = (
            f" {done / 1e6:.1f} of {total / 1e6:.1f} MB"
            if heal.get("phase") == "transfer" and total
            else ""
        )
        lines.append(
            f"  healing now: {clean(str(heal.get('replica_id'))[:60])} ({clean(heal.get('phase'))}"
            f"{far}, {since:.1f} s, to step {clean(heal.get('step'))})"
        )
    events = list(history.get("events") or [])[-MAX_EVENT_LINES:]
    lines.extend("  " + _event_line(e) for e in events)
    return lines
