"""The chaos report's figures and verdict, from hand-made records."""

from __future__ import annotations

from typing import Any

import pytest

from ftdist.chaos import report, schedule
from ftdist.chaos.supervisor import ChaosRecord, GroupState, RankState
from ftdist.demo.events import FinalEvent

pytestmark = pytest.mark.timeout(30)


def _final(digest: str, step: int) -> FinalEvent:
    return FinalEvent(t=1.0, step=step, hash=digest, eval_loss=0.5, accuracy=0.8)


def _record(hashes: list[list[str]], step: int = 100) -> ChaosRecord:
    groups = []
    for g, ranks in enumerate(hashes):
        gs = GroupState(g, [RankState(r) for r in range(len(ranks))])
        for rs, h in zip(gs.ranks, ranks, strict=True):
            rs.final = _final(h, step)
        gs.steps_attempted, gs.steps_committed = 110, 100
        groups.append(gs)
    rec = ChaosRecord(groups, started=1000.0, ended=1700.0, clock_started_s=5.0, stop_step=step)
    rec.commits = {s: 1000.0 + s for s in range(step)}
    return rec


def _injection(
    kind: str, t: float, end: float, recovered: float | None, **kw: Any
) -> dict[str, Any]:
    entry = {
        "index": kw.pop("index", 0),
        "kind": kind,
        "group": 1,
        "rank": 0,
        "hold_s": 0.0,
        "clock_s": t - 1005.0,
        "t": t,
        "end": end,
        "recovered": recovered,
        "outcome": "done",
        "detail": "",
    }
    entry.update(kw)
    return entry


SAME = [["a", "b"], ["a", "b"], ["a", "b"]]


def test_longest_stall() -> None:
    assert report.longest_stall([1.0, 2.0, 2.5, 6.0], 1.5, 7.0) == pytest.approx(3.5)
    assert report.longest_stall([], 3.0, 5.0) == pytest.approx(2.0)
    assert report.longest_stall([1.0], 5.0, 5.0) == 0.0


def test_identical_groups_pass() -> None:
    rep = report.build_report(_record(SAME), [], {})
    assert rep["verdict"] == {"ok": True, "problems": []}
    assert rep["divergence"]["ok"]
    assert rep["steps"]["job_committed"] == 100
    assert (rep["steps"]["group_attempted"], rep["steps"]["group_committed"]) == (330, 300)


@pytest.mark.parametrize(
    ("hashes", "why"),
    [
        ([["a", "b"], ["a", "c"], ["a", "b"]], "rank1 differs"),
        ([["a", "b"], ["x", "b"], ["a", "b"]], "rank0 differs"),
    ],
)
def test_any_differing_hash_is_divergence(hashes: list[list[str]], why: str) -> None:
    rep = report.build_report(_record(hashes), [], {})
    assert not rep["verdict"]["ok"]
    assert why.split()[0] in rep["divergence"]["reason"]


def test_missing_final_or_different_steps_is_divergence() -> None:
    rec = _record(SAME)
    rec.groups[2].ranks[1].final = None
    assert "group2/rank1" in report.divergence(rec)["reason"]
    rec = _record(SAME)
    rec.groups[0].ranks[0].final = _final("a", 99)
    assert "different steps" in report.divergence(rec)["reason"]


def test_hangs_leaks_exits_and_unrecovered_injections_fail_the_verdict() -> None:
    rec = _record(SAME)
    rec.hangs.append({"group": 0, "rank": 1, "attempt": 0, "t_s": 3.0, "what": "silent"})
    rec.unexpected_exits.append(
        {"group": 1, "rank": 0, "attempt": 0, "exitcode": 1, "t_s": 4.0, "error": "boom"}
    )
    rec.injections.append(_injection(schedule.KILL, 1010.0, 1010.0, None))
    rep = report.build_report(rec, ["trainer pid 7"], {})
    problems = " | ".join(rep["verdict"]["problems"])
    for part in ("hang", "leaked: trainer pid 7", "died on their own", "never recovered"):
        assert part in problems
    assert not rep["verdict"]["ok"]


def test_skipped_and_abandoned_injections_do_not_count_as_unrecovered() -> None:
    rec = _record(SAME)
    rec.injections.append(_injection(schedule.CUT_PEERS, 1010.0, 1010.0, None, outcome="skipped"))
    rec.injections.append(
        _injection(schedule.KILL_SOURCE, 1020.0, 1020.0, 1023.0, outcome="abandoned", index=1)
    )
    rep = report.build_report(rec, [], {})
    assert rep["verdict"]["ok"], rep["verdict"]
    assert rep["by_kind"][schedule.CUT_PEERS]["skipped"] == 1
    assert rep["by_kind"][schedule.KILL_SOURCE]["abandoned"] == 1


def test_recovery_figures_per_kind() -> None:
    rec = _record(SAME)
    rec.commits = {0: 1000.0, 1: 1001.0, 2: 1009.0, 3: 1010.0}
    rec.injections += [
        _injection(schedule.STOP, 1002.0, 1004.0, 1005.0, index=0),
        _injection(schedule.STOP, 1006.0, 1007.0, 1010.0, index=1),
        _injection(schedule.STOP, 1006.0, 1007.0, 1011.0, index=2),
    ]
    rows = report.injection_rows(rec)
    assert [r["recover_s"] for r in rows] == [1.0, 3.0, 4.0]
    # Between 1002 and 1005 no step committed; from 1006, none until 1009.
    assert [r["stall_s"] for r in rows] == [3.0, 3.0, 3.0]
    stop = report.by_kind(rows)[schedule.STOP]
    assert (stop["struck"], stop["recover_worst_s"], stop["recover_median_s"]) == (3, 4.0, 3.0)


def test_mid_heal_rows_say_whether_the_transfer_was_cut() -> None:
    rec = _record(SAME)
    entry = _injection(
        schedule.KILL_SOURCE, 1000.0, 1012.0, 1015.0, heal_started=1011.0, t2=1012.0,
        healing_attempt=1,
    )  # fmt: skip
    rec.injections.append(entry)
    heal = {"role": "receive", "group": 1, "attempt": 1, "t": 1013.0, "transfer_s": 0.5}
    rec.heals.append(heal)
    row = report.injection_rows(rec)[0]
    assert row["into_heal_s"] == 1.0 and row["transfer_cut"] is False
    heal["transfer_s"] = 2.0  # the transfer would have ended after the kill
    assert report.injection_rows(rec)[0]["transfer_cut"] is True


def test_text_and_table_carry_the_figures() -> None:
    rec = _record(SAME)
    rec.injections.append(_injection(schedule.KILL, 1010.0, 1010.0, 1012.5))
    meta = {"groups": 3, "group_size": 2, "seed": 0, "clock_s": 600.0}
    rep = report.build_report(rec, [], meta)
    table = report.figures_table(rep)
    assert "| kill: 1 struck | recover worst 2.5 s, median 2.5 s" in table
    assert "| worst time to recover | 2.5 s |" in table
    assert "| hangs | none |" in table
    text = report.render_text(rep)
    assert "VERDICT: PASS" in text and "group2/rank1: b" in text


def test_control_plane_rows_name_their_victim_and_who_led_after() -> None:
    rec = _record(SAME)
    rec.injections += [
        _injection(
            schedule.KILL_LEADER_LIGHTHOUSE, 1010.0, 1010.0, 1012.5, group=None, replica=2,
            new_leader=0, failover_s=2.2, detail="leader replica 2 SIGKILLed",
        ),
        _injection(
            schedule.KILL_ETCD_MEMBER, 1020.0, 1020.0, 1020.3, group=None, member=1, index=1,
        ),
    ]  # fmt: skip
    meta = {"groups": 3, "group_size": 2, "seed": 0, "clock_s": 600.0}
    rep = report.build_report(rec, [], meta)
    assert rep["verdict"]["ok"], rep["verdict"]
    kill = rep["by_kind"][schedule.KILL_LEADER_LIGHTHOUSE]
    assert (kill["struck"], kill["recover_worst_s"]) == (1, 2.5)
    table = report.figures_table(rep)
    assert "| kill-leader-lighthouse: 1 struck | recover worst 2.5 s" in table
    assert "| kill-etcd-member: 1 struck | recover worst 0.3 s" in table
    text = report.render_text(rep)
    assert "lh2" in text and "etcd m1" in text and "replica 0 leads anew 2.2 s later" in text


def test_a_quorum_id_conflict_or_a_control_plane_error_fails_the_verdict() -> None:
    meta = {"groups": 3, "group_size": 2, "seed": 0, "clock_s": 600.0}
    good = {"ok": True, "reason": "120 commits under 2 quorum ids", "conflicts": []}
    rep = report.build_report(_record(SAME), [], meta, good)
    assert rep["verdict"]["ok"] and rep["quorums"] == good
    assert "| quorum ids | consistent: 120 commits" in report.figures_table(rep)
    conflict = {"step": 3, "quorum_id": 4, "memberships": []}
    bad = {"ok": False, "reason": "1 step(s) committed under two quorums", "conflicts": [conflict]}
    rep = report.build_report(_record(SAME), [], meta, bad)
    assert not rep["verdict"]["ok"]
    assert "quorum ids: 1 step(s)" in " | ".join(rep["verdict"]["problems"])
    assert "| quorum ids | VIOLATED" in report.figures_table(rep)
    assert "QUORUM CONFLICT" in report.render_text(rep)
    rec = _record(SAME)
    rec.control_errors.append("kill-etcd-member #3: etcd member m1 restarted FAILED: boom")
    rep = report.build_report(rec, [], meta)
    assert not rep["verdict"]["ok"] and "control plane" in rep["verdict"]["problems"][0]
    assert "CONTROL PLANE: kill-etcd-member #3" in report.render_text(rep)
