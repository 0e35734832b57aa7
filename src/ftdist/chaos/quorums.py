"""
The quorum of every commit
==========================

A quorum id names one membership: two managers that commit the same step
under the same quorum id must have been in the same quorum, or two
quorums of one id trained side by side (split brain). A replicated
lighthouse promises more: an id is never issued again with other members,
across failovers. The chaos suite checks both from the trainers' side.

Each trainer appends, for every step it commits, one JSON line to a file of
its own under ``quorums/`` (:class:`CommitLog`): the step committed, and the
id and members of the quorum its Manager received for that step's round.
After the run :func:`read_commits` reads every file and :func:`check` looks:

* **the same step under two quorums of one id**: the verdict fails, in
  every run;
* **one id, two memberships** at any steps: the verdict fails with a
  replicated lighthouse, whose ids are kept in etcd; a single lighthouse
  keeps them nowhere (a restarted one goes on above the ids its managers
  report), so there it is only counted.

The files are named as the events files (``replica<process>.attempt<n>.jsonl``),
so that a new run clears them the same way.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from ftdist.demo.events import EventLog, StepEvent

if TYPE_CHECKING:
    # The writer's own signature, which write() overrides.
    from ftdist.demo.events import _Event

__all__ = ["QUORUMS_DIR", "Commit", "CommitLog", "check", "read_commits"]

QUORUMS_DIR = "quorums"
_FILE = re.compile(r"replica(\d+)\.attempt(\d+)\.jsonl")
# Conflicts listed in the report (the counts cover them all).
_SHOWN = 10


class Commit(NamedTuple):
    """One committed step, as its trainer recorded it.

    Attributes:
        process: the trainer's global rank.
        attempt: its group's restart count.
        step: the step committed.
        quorum_id: the id of the quorum of that step's round.
        members: that quorum's replica ids, in rank order.
        t: when it was recorded (wall time).
    """

    process: int
    attempt: int
    step: int
    quorum_id: int
    members: tuple[str, ...]
    t: float


class CommitLog(EventLog):
    """An events file that also records the quorum of every committed step.

    Set :attr:`manager` once the Manager exists: each committed ``step``
    event written after that adds a line to ``quorums_path``.

    Args:
        path: the events file.
        quorums_path: the file of commits.

    Raises:
        OSError: a file cannot be opened.
    """

    def __init__(self, path: str, quorums_path: str) -> None:
        super().__init__(path)
        self._commits = open(quorums_path, "a", buffering=1)
        self.manager: Any = None

    def write(self, event: _Event) -> None:
        """Append ``event``; after a committed step, its quorum too.

        Raises:
            OSError: a file cannot be written.
        """
        super().write(event)
        if isinstance(event, StepEvent) and event.ok and self.manager is not None:
            self._commits.write(json.dumps(self._commit(event)) + "\n")

    def _commit(self, event: StepEvent) -> dict[str, Any]:
        manager = self.manager
        # The round's own quorum, as the lighthouse sent it for this step:
        # the process group's record of it changes only with the id, so it
        # would hide a second membership under the same id. The Manager
        # keeps the round until the next step starts (there is no public
        # accessor: this is a test harness reading its own trainer).
        outcome = getattr(manager, "_outcome", None)
        quorum = getattr(outcome, "quorum", None)
        if quorum is not None:
            quorum_id, members = int(quorum.quorum_id), list(quorum.replica_ids)
        else:
            quorum_id, members = event.quorum_id, list(manager._membership.members)
        # A heal applied at the vote moved the counter to the source's step
        # first: the step committed is the one before the counter now.
        return {
            "t": event.t,
            "step": manager.current_step() - 1,
            "quorum_id": quorum_id,
            "members": members,
        }

    def close(self) -> None:
        """Close both files."""
        super().close()
        self._commits.close()


def read_commits(folder: str) -> list[Commit]:
    """Every commit recorded under ``folder``; lines cut short by a kill are skipped."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "replica*.jsonl"))):
        name = _FILE.fullmatch(os.path.basename(path))
        if name is None:
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    obj = json.loads(line)
                    out.append(
                        Commit(
                            int(name.group(1)),
                            int(name.group(2)),
                            int(obj["step"]),
                            int(obj["quorum_id"]),
                            tuple(str(m) for m in obj["members"]),
                            float(obj["t"]),
                        )
                    )
                except (ValueError, KeyError, TypeError):
                    continue
    return out


def check(commits: Iterable[Commit], group_size: int, ids_unique: bool) -> dict[str, Any]:
    """Whether the commits obey the quorum-id rules (see the module docstring).

    Args:
        commits: every trainer's commits.
        group_size: ranks per group (names trainers ``group<g>/rank<r>``).
        ids_unique: an id naming two memberships fails too (replicated lighthouse).

    Returns:
        ``ok``, ``reason``, ``commits``, ``quorum_ids``, and the first few
        ``conflicts`` (one step under two quorums of one id) and ``reused``
        ids (two memberships), each with the trainers involved.
    """
    per_step: dict[tuple[int, int], dict[tuple[str, ...], set[str]]] = {}
    per_id: dict[int, dict[tuple[str, ...], int]] = {}
    count = 0
    for c in commits:
        count += 1
        group, rank = divmod(c.process, group_size)
        who = f"group{group}/rank{rank}"
        per_step.setdefault((c.step, c.quorum_id), {}).setdefault(c.members, set()).add(who)
        per_id.setdefault(c.quorum_id, {}).setdefault(c.members, c.step)
    conflicts = [
        {
            "step": step,
            "quorum_id": qid,
            "memberships": [{"members": list(m), "by": sorted(w)} for m, w in seen.items()],
        }
        for (step, qid), seen in sorted(per_step.items())
        if len(seen) > 1
    ]
    reused = [
        {
            "quorum_id": qid,
            "memberships": [{"members": list(m), "first_step": s} for m, s in seen.items()],
        }
        for qid, seen in sorted(per_id.items())
        if len(seen) > 1
    ]
    out: dict[str, Any] = {
        "commits": count,
        "quorum_ids": len(per_id),
        "ids_unique_required": ids_unique,
        "conflicts": conflicts[:_SHOWN],
        "conflict_count": len(conflicts),
        "reused": reused[:_SHOWN],
        "reused_count": len(reused),
    }
    if not count:
        out["ok"], out["reason"] = False, "no trainer recorded a commit"
    elif conflicts:
        first = conflicts[0]
        out["ok"] = False
        out["reason"] = (
            f"{len(conflicts)} step(s) committed under two quorums of one id, first step "
            f"{first['step']} under quorum {first['quorum_id']}"
        )
    elif reused and ids_unique:
        out["ok"] = False
        out["reason"] = (
            f"{len(reused)} quorum id(s) named two memberships, first {reused[0]['quorum_id']}"
        )
    else:
        out["ok"] = True
        out["reason"] = (
            f"{count} commits under {len(per_id)} quorum ids: no step under two quorums of "
            "one id, "
            + (
                f"{len(reused)} id(s) named again with other members (counted, not required, "
                "with a single lighthouse)"
                if reused
                else "no id with two memberships"
            )
        )
    return out
