"""
Partition rule
==============

A replica group cut off from its peers but not from the lighthouse keeps
heartbeating, so the quorum rule alone keeps putting it in every quorum, and
every step of the job fails on the cut until it is lifted. This module
decides, from what the members themselves report, which of them to leave out
so that the rest can train. It is pure: no clock, no I/O, no logging.

What members report (an ftdist extension carried in torchft's own
``QuorumMember.data`` JSON, so torchft's messages are unchanged and torchft's
managers, which report nothing, are never left out by it)::

    {"unreachable": {"<replica_id>": "<its manager address>", ...}}

A manager lists the peers of its last quorum that it could not reach (a
connect that timed out: packets vanish). A refused connect proves the path
works, so a dead process is never reported; and a report names the address
it probed, so a report about an earlier incarnation of a restarted replica
(same id, new address) counts for nothing.

The rule, on the members a quorum would otherwise have:

* Two members are **cut** from each other when either reports the other
  (a partition is symmetric; one side may have reported first).
* While any cut remains, leave out one member: the one with the most cuts;
  on a tie, the one that reported the most peers; then the one at the lower
  step (the other has more to lose); then the one whose ``replica_id`` sorts
  last. Members left are never cut from each other.
* A member that reports peers which nobody else reports is the member with
  the most cuts (every cut touches it) and the most reports, so it is the
  one left out: **a single member can only ever exclude itself**, never a
  healthy majority, whatever it reports.

The excluded member's request stays parked at the lighthouse with its report;
it is left out again at every round until it sends a new request whose report
no longer names its peers (its manager probes again while it waits).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["REPORT_KEY", "PartitionDecision", "exclude_partitioned", "reported_unreachable"]

# The key of a member's ``data`` JSON object that lists the peers it cannot reach.
REPORT_KEY = "unreachable"

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class PartitionDecision(Generic[M]):
    """The outcome of :func:`exclude_partitioned`.

    Attributes:
        kept: the members that stay, in their given order.
        excluded: the replica ids left out, in the order they were chosen.
        reason: why, in words (None when nobody is left out).
    """

    kept: list[M]
    excluded: list[str]
    reason: str | None


def reported_unreachable(data: str) -> dict[str, str]:
    """The peers a member's ``data`` JSON reports unreachable: replica id to address.

    Anything that is not such a report (torchft's managers' data, malformed
    JSON, other keys) reports nothing.
    """
    if not data or REPORT_KEY not in data:  # cheap: most members report nothing
        return {}
    try:
        document = json.loads(data)
    except ValueError:
        return {}
    report = document.get(REPORT_KEY) if isinstance(document, dict) else None
    if not isinstance(report, Mapping):
        return {}
    return {str(k): str(v) for k, v in report.items() if isinstance(k, str)}


def _attr(member: Any, name: str, default: Any) -> Any:
    return getattr(member, name, default)


def exclude_partitioned(members: Sequence[M]) -> PartitionDecision[M]:
    """Leave out members until no two that stay report each other unreachable.

    Args:
        members: candidates with ``replica_id``, and optionally ``address``,
            ``step`` and ``data`` (missing ones report nothing).

    Returns:
        The members kept (never empty when ``members`` is not), the ones left
        out, and the reason.
    """
    by_id = {_attr(m, "replica_id", ""): m for m in members}
    cuts: dict[str, set[str]] = {rid: set() for rid in by_id}
    reports_made: dict[str, int] = dict.fromkeys(by_id, 0)
    for rid, member in by_id.items():
        for peer, address in reported_unreachable(_attr(member, "data", "")).items():
            target = by_id.get(peer)
            if peer == rid or target is None or _attr(target, "address", "") != address:
                continue  # not a member, itself, or an earlier incarnation
            reports_made[rid] += 1
            cuts[rid].add(peer)
            cuts[peer].add(rid)
    if not any(cuts.values()):
        return PartitionDecision(list(members), [], None)

    excluded: list[str] = []
    details: list[str] = []
    while True:
        cut_ids = [rid for rid, peers in cuts.items() if peers]
        if not cut_ids:
            break
        worst = max(
            cut_ids,
            key=lambda rid: (
                len(cuts[rid]),
                reports_made[rid],
                -int(_attr(by_id[rid], "step", 0)),
                rid,
            ),
        )
        details.append(f"{worst} (cut from {len(cuts[worst])}: {', '.join(sorted(cuts[worst]))})")
        excluded.append(worst)
        for peer in cuts.pop(worst):
            cuts[peer].discard(worst)
        reports_made.pop(worst)
    gone = set(excluded)
    kept = [m for m in members if _attr(m, "replica_id", "") not in gone]
    reason = "left out as unreachable from its peers: " + "; ".join(details)
    return PartitionDecision(kept, excluded, reason)
