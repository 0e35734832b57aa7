"""The quorum-id check of the chaos suite: each trainer's record of the quorum of
every commit, and the rule that no step is committed under two quorums of one id."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ftdist.chaos import quorums
from ftdist.chaos.quorums import Commit, CommitLog
from ftdist.demo.events import StepEvent, UpEvent

pytestmark = pytest.mark.timeout(30)

ABC = ("a", "b", "c")


def _commit(process: int, step: int, qid: int, members: tuple[str, ...] = ABC) -> Commit:
    return Commit(process, 0, step, qid, members, 1000.0 + step)


def test_commits_of_one_membership_per_id_pass() -> None:
    commits = [_commit(p, s, 1 if s < 10 else 2) for p in range(6) for s in range(20)]
    out = quorums.check(commits, 2, ids_unique=True)
    assert out["ok"], out
    assert (out["commits"], out["quorum_ids"], out["conflict_count"]) == (120, 2, 0)
    assert "no id with two memberships" in out["reason"]


@pytest.mark.parametrize("ids_unique", [True, False])
def test_one_step_under_two_quorums_of_one_id_fails_always(ids_unique: bool) -> None:
    commits = [_commit(p, s, 4) for p in range(4) for s in range(5)]
    commits.append(_commit(5, 3, 4, ("a", "b")))  # group 2 rank 1: same step, same id
    out = quorums.check(commits, 2, ids_unique=ids_unique)
    assert not out["ok"]
    assert out["conflict_count"] == 1 and "step 3 under quorum 4" in out["reason"]
    (conflict,) = out["conflicts"]
    by = sorted(w for m in conflict["memberships"] for w in m["by"])
    assert "group2/rank1" in by and len(conflict["memberships"]) == 2


def test_an_id_reused_with_other_members_fails_only_with_a_replicated_lighthouse() -> None:
    # Quorum 1 again, at later steps, with other members.
    commits = [_commit(p, s, 1) for p in range(2) for s in range(5)]
    commits += [_commit(p, s, 1, ("a", "c")) for p in range(2) for s in range(5, 9)]
    single = quorums.check(commits, 2, ids_unique=False)
    assert single["ok"] and single["reused_count"] == 1, single
    assert "named again with other members (counted" in single["reason"]
    replicated = quorums.check(commits, 2, ids_unique=True)
    assert not replicated["ok"] and "named two memberships" in replicated["reason"]
    assert replicated["reused"][0]["quorum_id"] == 1


def test_no_commit_at_all_fails() -> None:
    out = quorums.check([], 2, ids_unique=False)
    assert not out["ok"] and out["reason"] == "no trainer recorded a commit"


def test_read_commits_skips_torn_and_foreign_lines(tmp_path: Path) -> None:
    good = {"t": 5.0, "step": 7, "quorum_id": 3, "members": ["a", "b"]}
    (tmp_path / "replica4.attempt2.jsonl").write_text(
        json.dumps(good) + "\nnot json\n" + '{"step": 8}\n' + '{"t": 6.0, "step": 9, "quo'
    )
    (tmp_path / "other.jsonl").write_text(json.dumps(good) + "\n")
    assert quorums.read_commits(str(tmp_path)) == [Commit(4, 2, 7, 3, ("a", "b"), 5.0)]


class _Manager:
    """What CommitLog reads of a Manager."""

    def __init__(self) -> None:
        self.step = 0
        self._outcome: Any = None
        self._membership = SimpleNamespace(members=["x", "y"])

    def current_step(self) -> int:
        return self.step


def _step(step: int, ok: bool, qid: int = 9) -> StepEvent:
    return StepEvent(
        t=1.0, step=step, ok=ok, loss=0.1, quorum_id=qid, participants=2, participating=True
    )


def test_the_commit_log_records_each_committed_step_under_its_rounds_quorum(
    tmp_path: Path,
) -> None:
    events, commits = tmp_path / "events.jsonl", tmp_path / "replica3.attempt1.jsonl"
    log = CommitLog(str(events), str(commits))
    manager = _Manager()
    log.write(_step(0, True))  # before the Manager is known: not recorded
    log.manager = manager
    manager.step = 5  # a heal moved the counter: step 4 committed
    manager._outcome = SimpleNamespace(quorum=SimpleNamespace(quorum_id=7, replica_ids=["p", "q"]))
    log.write(_step(0, True))
    log.write(_step(5, False))  # not committed: not recorded
    log.write(UpEvent(pid=1, attempt=0, replica_id="r"))
    manager._outcome = None  # no round kept: the process group's membership
    manager.step = 6
    log.write(_step(5, True, qid=8))
    log.close()
    assert len(events.read_text().splitlines()) == 5
    assert [(c.step, c.quorum_id, c.members) for c in quorums.read_commits(str(tmp_path))] == [
        (4, 7, ("p", "q")),
        (5, 8, ("x", "y")),
    ]
