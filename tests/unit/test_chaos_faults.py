"""Carrying out the control-plane kinds, with a stand-in control plane and
supervisor: who is struck, what ends the fault, when a new term leads, and
when the job recovered (from the strike; after the new term, or for an etcd
member not counting the step in flight at the strike)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ftdist.chaos import failover, schedule
from ftdist.chaos.faults import Faults
from ftdist.chaos.supervisor import ChaosRecord, GroupState, RankState
from ftdist.demo.events import StepEvent

pytestmark = pytest.mark.timeout(30)


class _Control:
    """Replica ``leader`` leads under fencing revision 5; after a strike at it,
    ``successor`` leads under 6 (None: nobody), since ``began`` (default: now)."""

    def __init__(self, leader: int | None = 1, fail: str = "", successor: int | None = 2) -> None:
        self.calls: list[tuple[str, int]] = []
        self.asked: list[int | None] = []
        self.began: float | None = None
        self._leader = leader
        self._successor = successor
        self._fail = fail

    def leading(self, skip: int | None = None) -> tuple[int, int, float] | None:
        self.asked.append(skip)
        if self._leader is None:
            return None
        if not self.calls:
            return self._leader, 5, 0.0
        if self._successor is None:
            return None
        return self._successor, 6, self.began if self.began is not None else time.time()

    def __getattr__(self, name: str) -> Any:
        def act(i: int) -> None:
            if name == self._fail:
                raise RuntimeError(f"{name} failed")
            self.calls.append((name, i))

        return act


class _Sup:
    def __init__(self, groups: int = 3, size: int = 2) -> None:
        self.ranks = object()
        self.record = ChaosRecord(
            [GroupState(g, [RankState(r) for r in range(size)]) for g in range(groups)]
        )
        self.lines: list[str] = []
        self.disrupted: list[int] = []

    @property
    def groups(self) -> list[GroupState]:
        return self.record.groups

    def say(self, text: str) -> None:
        self.lines.append(text)

    def disrupt(self, gs: GroupState) -> None:
        self.disrupted.append(gs.group)


def _strike(faults: Faults, kind: str, hold_s: float = 60.0, member: int = 2) -> dict[str, Any]:
    inj = schedule.Injection(0, 1.0, kind, hold_s=hold_s, member=member)
    return faults.strike(inj, schedule.Decision("strike", inj, group=0), now=5.0)


def _step(t: float, ok: bool = True, participants: int = 2) -> StepEvent:
    return StepEvent(
        t=t, step=1, ok=ok, loss=0.1, quorum_id=1, participants=participants, participating=True
    )


@pytest.mark.parametrize(
    ("kind", "strike", "end", "victim"),
    [
        (schedule.KILL_LEADER_LIGHTHOUSE, "kill_replica", "restart_replica", 1),
        (schedule.STOP_LEADER_LIGHTHOUSE, "stop_replica", "continue_replica", 1),
        (schedule.CUT_LIGHTHOUSE_ETCD, "cut_replica", "lift_replica", 1),
        (schedule.KILL_ETCD_MEMBER, "kill_member", "restart_member", 2),
    ],
)
def test_each_kind_strikes_its_victim_and_ends_after_the_hold(
    kind: str, strike: str, end: str, victim: int
) -> None:
    sup, control = _Sup(), _Control(leader=1)
    faults = Faults(sup, None, None, control)  # type: ignore[arg-type]
    entry = _strike(faults, kind, hold_s=0.0)
    assert control.calls == [(strike, victim)]
    assert entry["end"] == entry["t"] and entry["group"] is None
    assert faults.busy() and sorted(sup.disrupted) == [0, 1, 2]
    time.sleep(failover.POLL_S)
    faults.maintain()
    assert control.calls == [(strike, victim), (end, victim)]
    assert not faults.busy()
    if kind == schedule.KILL_ETCD_MEMBER:
        assert "failover_s" not in entry
    else:
        assert entry["new_leader"] == 2 and entry["failover_s"] >= 0


def test_a_stopped_leader_is_not_asked_while_stopped() -> None:
    sup, control = _Sup(), _Control(successor=None)
    faults = Faults(sup, None, None, control)  # type: ignore[arg-type]
    _strike(faults, schedule.STOP_LEADER_LIGHTHOUSE, hold_s=60.0)
    time.sleep(failover.POLL_S)
    faults.maintain()
    assert control.asked == [None, 1] and faults.busy()


def test_after_a_strike_at_the_leader_recovery_counts_commits_under_the_new_term() -> None:
    sup, control = _Sup(groups=2, size=1), _Control()
    faults = Faults(sup, None, None, control)  # type: ignore[arg-type]
    entry = _strike(faults, schedule.CUT_LIGHTHOUSE_ETCD, hold_s=60.0)
    t = entry["t"]
    control.began = t + 2.0  # the new term began before the question
    faults.on_step(0, 0, _step(t + 0.1))  # the old leader still answered: no recovery
    faults.on_step(1, 0, _step(t + 0.1))
    faults.maintain()
    assert entry["recovered"] is None
    faults.on_step(0, 0, _step(t + 2.3))  # under the new term, seen before it is known
    time.sleep(failover.POLL_S)
    faults.maintain()  # the new term is known now
    assert entry["failover_s"] == pytest.approx(2.0) and entry["new_leader"] == 2
    assert entry["recovered"] is None
    faults.on_step(1, 0, _step(t + 2.6))
    faults.maintain()
    assert entry["recovered"] == pytest.approx(t + 2.6)


def test_after_an_etcd_member_dies_recovery_skips_the_step_in_flight() -> None:
    sup = _Sup(groups=2, size=1)
    faults = Faults(sup, None, None, _Control())  # type: ignore[arg-type]
    entry = _strike(faults, schedule.KILL_ETCD_MEMBER)
    t = entry["t"]
    faults.on_step(0, 0, _step(t - 0.1))  # before the strike: nothing
    faults.on_step(0, 0, _step(t + 0.1))  # group 0's step in flight
    faults.on_step(1, 0, _step(t + 0.1))  # group 1's
    faults.on_step(0, 0, _step(t + 2.0, participants=1))  # not with every group
    faults.on_step(0, 0, _step(t + 2.5, ok=False))
    faults.on_step(0, 0, _step(t + 3.0))
    faults.maintain()
    assert entry["recovered"] is None, "group 1 has not committed a step begun after the strike"
    faults.on_step(1, 0, _step(t + 3.2))
    faults.on_step(0, 0, _step(t + 3.4))  # later commits do not move it
    faults.maintain()
    assert entry["recovered"] == pytest.approx(t + 3.2)


def test_no_new_term_in_time_is_a_control_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "FAILOVER_LIMIT_S", 0.0)
    sup = _Sup()
    faults = Faults(sup, None, None, _Control(successor=None))  # type: ignore[arg-type]
    _strike(faults, schedule.KILL_LEADER_LIGHTHOUSE, hold_s=0.0)
    time.sleep(failover.POLL_S)
    faults.maintain()
    assert not faults.busy()
    assert "no lighthouse replica led anew" in sup.record.control_errors[0]


def test_no_leader_skips_and_a_failed_strike_or_end_is_a_control_error() -> None:
    sup = _Sup()
    faults = Faults(sup, None, None, _Control(leader=None))  # type: ignore[arg-type]
    entry = _strike(faults, schedule.KILL_LEADER_LIGHTHOUSE)
    assert entry["outcome"] == "skipped" and not faults.busy()
    assert sup.record.control_errors == []

    faults = Faults(sup, None, None, _Control(fail="cut_replica"))  # type: ignore[arg-type]
    entry = _strike(faults, schedule.CUT_LIGHTHOUSE_ETCD)
    assert entry["outcome"] == "skipped" and "FAILED" in entry["detail"]
    assert len(sup.record.control_errors) == 1

    faults = Faults(sup, None, None, _Control(fail="restart_member"))  # type: ignore[arg-type]
    _strike(faults, schedule.KILL_ETCD_MEMBER, hold_s=0.0)
    faults.maintain()
    assert "restart" in sup.record.control_errors[-1] and not faults.busy()


def test_without_a_control_plane_its_kinds_are_skipped_and_the_run_ends_a_hold_early() -> None:
    sup = _Sup()
    faults = Faults(sup, None, None, None)  # type: ignore[arg-type]
    entry = _strike(faults, schedule.KILL_ETCD_MEMBER)
    assert entry["outcome"] == "skipped" and "no replicated lighthouse" in entry["detail"]

    control = _Control()
    faults = Faults(sup, None, None, control)  # type: ignore[arg-type]
    entry = _strike(faults, schedule.STOP_LEADER_LIGHTHOUSE, hold_s=600.0)
    began = time.monotonic()
    faults.lift_all()
    assert time.monotonic() - began < 5 and not faults.busy()
    assert control.calls[-1] == ("continue_replica", 1)
    assert "cut short" in entry["detail"]
