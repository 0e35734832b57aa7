"""The shared bookkeeping of the supervisors' events, and what each supervisor adds (no processes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ftdist.demo.events import (
    EventLog,
    FinalEvent,
    HealEvent,
    HealStartEvent,
    StepEvent,
    UpEvent,
    events_path,
)
from ftdist.demo.tracking import GroupProgress, State, Tracker, TrainerState

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Group(GroupProgress):
    ranks: list[TrainerState]

    def trainers(self) -> Sequence[TrainerState]:
        return self.ranks


def _state(group: GroupProgress) -> State:
    """``group.state`` as the tracker left it.

    mypy keeps an attribute narrowed by a test's assignment (``g.state =
    "healing"``) across the ``absorb()`` that changes it; read it through here.
    """
    return group.state


class _Listener:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_up(self, group: int, rank: int, event: UpEvent) -> None:
        self.calls.append(("up", group, rank))

    def on_step(self, group: int, rank: int, event: StepEvent) -> None:
        self.calls.append(("step", group, rank, event.step))

    def on_back(self, group: int, event: StepEvent) -> None:
        self.calls.append(("back", group, event.step))

    def on_heal(self, group: int, rank: int, event: HealEvent) -> None:
        self.calls.append(("heal", group, rank, event.role))


class _Run:
    """Two groups of two ranks, their events files and a tracker over them."""

    def __init__(self, tmp: Path) -> None:
        self.dir = str(tmp)
        self.groups = [_Group(ranks=[TrainerState(), TrainerState()]) for _ in range(2)]
        self.listener = _Listener()
        self.tracker = Tracker(self.dir, self.groups, self.listener)

    def write(self, group: int, rank: int, event: Any, attempt: int | None = None) -> None:
        attempt = self.groups[group].attempt if attempt is None else attempt
        log = EventLog(events_path(self.dir, group * 2 + rank, attempt))
        log.write(event)
        log.close()

    def step(
        self, group: int, rank: int, t: float, step: int, attempt: int | None = None, **kw: Any
    ) -> None:
        fields: dict[str, Any] = {
            "ok": True,
            "loss": 1.0,
            "quorum_id": 1,
            "participants": 2,
            "participating": True,
        }
        fields.update(kw)
        self.write(group, rank, StepEvent(t=t, step=step, **fields), attempt)


def _heal(t: float, role: str) -> HealEvent:
    return HealEvent(
        t=t, step=5, quorum_id=2, role=role, peers=[0], quorum_s=0.1, reconfigure_s=0.0,
        transfer_bytes=100, transfer_s=0.2, load_s=0.01, total_s=0.31,
    )  # fmt: skip


def test_groups_train_once_every_rank_took_part_and_are_healthy_in_full_steps(
    tmp_path: Path,
) -> None:
    run = _Run(tmp_path)
    for g in range(2):
        run.step(g, 0, 1.0, 0)
    run.tracker.absorb()
    g0, g1 = run.groups
    assert g0.state == "starting", "rank 1 has not stepped yet"
    for g in range(2):
        run.step(g, 1, 1.1, 0)
    run.tracker.absorb()
    assert (g0.state, g1.state) == ("training", "training")
    # Rank 0's step came before its group trained: healthy from its next one.
    assert (g0.ranks[0].healthy, g0.ranks[1].healthy, g0.ranks[1].healthy_at) == (False, True, 1.1)
    run.step(0, 0, 1.5, 1)
    run.tracker.absorb()
    assert g0.ranks[0].healthy and g0.ranks[0].healthy_at == 1.5
    # Rank 0 counts the group's steps.
    assert (g0.steps_attempted, g0.steps_committed) == (2, 2)
    assert ("back", 0, 0) not in run.listener.calls, "a start is not a return"
    # A failed step counts as attempted; a step without every group ends health.
    run.step(0, 0, 2.0, 2, ok=False)
    run.step(0, 1, 2.1, 2, participants=1)
    run.tracker.absorb()
    assert (g0.steps_attempted, g0.steps_committed) == (3, 2)
    assert g0.ranks[0].healthy and not g0.ranks[1].healthy
    assert ("step", 0, 0, 2) in run.listener.calls


def test_a_disrupted_group_returns_with_steps_after_the_disruption_only(tmp_path: Path) -> None:
    run = _Run(tmp_path)
    for g in range(2):
        for r in range(2):
            run.step(g, r, 1.0, 0)
    run.tracker.absorb()
    g1 = run.groups[1]
    g1.disrupt(5.0)
    g1.attempt, g1.state = 1, "healing"
    assert not any(r.healthy or r.back for r in g1.ranks)
    run.step(1, 0, 6.0, 3, attempt=0)  # a late line of the replaced processes
    run.step(1, 0, 4.0, 3)  # stamped before the disruption
    run.write(1, 0, HealStartEvent(t=6.5, step=4, src_rank=0, source="http://a"))
    run.tracker.absorb()
    assert g1.state == "healing" and g1.steps_attempted == 2
    assert g1.ranks[0].receiving == {"http://a": 6.5}
    run.step(1, 0, 7.0, 4, participating=False, participants=1)  # healing: not taking part
    run.step(1, 1, 7.0, 4)
    run.tracker.absorb()
    assert g1.state == "healing" and g1.ranks[0].receiving == {}
    run.step(1, 0, 8.0, 5)
    run.tracker.absorb()
    assert _state(g1) == "training" and g1.ranks[0].healthy and g1.ranks[1].healthy is False
    assert [c for c in run.listener.calls if c[0] == "back"] == [("back", 1, 5)]


def test_heals_count_on_rank_0_and_a_group_finishes_with_its_last_final(
    tmp_path: Path,
) -> None:
    run = _Run(tmp_path)
    run.write(0, 0, UpEvent(t=0.5, pid=1, attempt=0, replica_id="g0"))
    run.write(0, 0, _heal(1.0, "receive"))
    run.write(0, 1, _heal(1.0, "receive"))
    run.write(0, 0, _heal(2.0, "send"))
    run.write(0, 0, FinalEvent(t=3.0, step=9, hash="h", eval_loss=0.1, accuracy=0.9))
    run.tracker.absorb()
    g0 = run.groups[0]
    assert (g0.heals, g0.served) == (1, 1)
    assert run.listener.calls[0] == ("up", 0, 0)
    assert [c for c in run.listener.calls if c[0] == "heal"] == [
        ("heal", 0, 0, "receive"),
        ("heal", 0, 1, "receive"),
        ("heal", 0, 0, "send"),
    ]
    assert _state(g0) != "finished" and g0.ranks[0].final is not None
    assert g0.ranks[0].last_event == 3.0
    run.write(0, 1, FinalEvent(t=3.1, step=9, hash="h", eval_loss=0.1, accuracy=0.9))
    run.tracker.absorb()
    assert g0.state == "finished"


def test_the_demo_supervisor_records_steps_returns_and_heals(tmp_path: Path) -> None:
    from ftdist.demo.supervisor import Interrupt, Supervisor
    from ftdist.demo.worker import WorkerConfig

    said: list[str] = []
    cfg = WorkerConfig("127.0.0.1:1", str(tmp_path), seed=0, replicas=2, run="r")
    sup = Supervisor(cfg, "failures", [], 10.0, None, said.append, lambda s: None, Interrupt())
    tracker = Tracker(str(tmp_path), sup.replicas, sup)
    r0, r1 = sup.replicas
    assert r0.trainers() == (r0,)

    def step(replica: int, t: float, step: int, **kw: Any) -> None:
        fields: dict[str, Any] = {"ok": True, "loss": 0.5, "quorum_id": 3, "participants": 2}
        fields.update(kw)
        log = EventLog(events_path(str(tmp_path), replica, sup.replicas[replica].attempt))
        log.write(StepEvent(t=t, step=step, participating=True, **fields))
        log.close()

    step(0, 1.0, 0)
    step(1, 1.0, 0)
    tracker.absorb()
    assert (r0.state, r0.healthy, r0.step, r0.loss, r0.quorum_id) == ("training", True, 1, 0.5, 3)
    assert sup.record.steps[0] == {"t_s": 1.0, "losses": {0: 0.5, 1: 0.5}, "participants": 2}
    # replica1 is killed at 2 s, restarted at 3 s; the survivor steps on alone.
    sup.record.injections.append({"replica": 1, "t_s": 2.0, "survivors_s": None, "back_s": None})
    r1.disrupt(2.0)
    r1.disrupt(3.0)
    r1.attempt, r1.state = 1, "healing"
    step(0, 2.5, 1, ok=False, error="peer gone")
    step(0, 2.8, 1, participants=1)
    tracker.absorb()
    assert sup.record.failed_steps == [{"replica": 0, "step": 1, "t_s": 2.5, "error": "peer gone"}]
    assert sup.record.injections[0]["survivors_s"] == pytest.approx(0.8)
    assert not r0.healthy and r0.participants == 1
    step(1, 4.0, 2)
    tracker.absorb()
    assert _state(r1) == "training" and sup.record.injections[0]["back_s"] == pytest.approx(2.0)
    assert any("replica1 back in the quorum at step 3 (1.00 s" in line for line in said)
    heal = _heal(3.5, "receive")
    sup.on_heal(1, 0, heal)
    entry = sup.record.heals[-1]
    assert "t" not in entry and "kind" not in entry
    assert (entry["replica"], entry["attempt"], entry["t_s"], entry["transfer_bytes"]) == (
        1,
        1,
        3.5,
        100,
    )
    assert "replica1 healed to step 5" in said[-1]


def test_the_chaos_supervisor_records_commits_failed_steps_and_addresses(tmp_path: Path) -> None:
    from ftdist.chaos.supervisor import ChaosSupervisor
    from ftdist.chaos.worker import ChaosWorkerConfig
    from ftdist.demo.supervisor import Interrupt

    cfg = ChaosWorkerConfig("127.0.0.1:1", str(tmp_path), seed=0, groups=2, group_size=2, run="r")
    sup = ChaosSupervisor(cfg, [], 10.0, None, None, lambda line: None, Interrupt())
    fields: dict[str, Any] = {"loss": 0.5, "quorum_id": 1, "participants": 2, "participating": True}
    sup.on_step(1, 0, StepEvent(t=5.0, step=3, ok=False, **fields))
    sup.on_step(1, 1, StepEvent(t=5.1, step=3, ok=False, **fields))
    sup.on_step(0, 1, StepEvent(t=5.2, step=3, ok=True, **fields))
    sup.on_step(0, 0, StepEvent(t=5.3, step=3, ok=True, **fields))
    assert sup.record.failed_steps == [(5.0, 1)], "rank 0's failed attempts, per group"
    assert sup.record.commits == {3: 5.2}
    sup.on_up(1, 1, UpEvent(t=1.0, pid=9, attempt=0, replica_id="x", checkpoint="http://b"))
    sup.on_heal(1, 1, _heal(6.0, "receive"))
    entry = sup.record.heals[-1]
    assert (entry["t"], entry["group"], entry["rank"], entry["attempt"]) == (6.0, 1, 1, 0)
    sup.groups[0].ranks[0].receiving["http://b"] = 6.0  # its heal_start names that address
    assert [h.receiving_from for h in sup.health()] == [((1, 1),), ()]
