"""
The chaos supervisor
====================

:class:`ChaosSupervisor` runs the trainers of a chaos run
(:func:`ftdist.chaos.worker.rank_main`, one process per rank of each
replica group, from the warm fork server), follows their events files,
asks :func:`ftdist.chaos.schedule.decide` what to inject and carries it out
(:mod:`ftdist.chaos.faults`), restarts what died as torchrun would (a whole
replica group when any of its ranks dies), watches for hangs, and ends the
run: every trainer stops at the same committed step and reports the hash
of its state there.

The events are read and applied by :class:`~ftdist.demo.tracking.Tracker`,
as in the demo; :class:`GroupState` and :class:`RankState` extend its
states with what only this supervisor needs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftdist._procfs import start_time as proc_start_time
from ftdist.chaos import schedule
from ftdist.chaos.faults import Faults
from ftdist.chaos.lighthouse import RestartableLighthouse
from ftdist.chaos.netns import ChaosNetwork
from ftdist.chaos.worker import STOP_KEY, ChaosWorkerConfig, rank_main
from ftdist.demo.events import HealEvent, StepEvent, UpEvent
from ftdist.demo.supervisor import Interrupt
from ftdist.demo.tracking import GroupProgress, Tracker, TrainerState
from ftdist.launch.ranks import Ranks

if TYPE_CHECKING:
    from ftdist.chaos.controlplane import ControlPlane

POLL_S = 0.05
# A trainer that is neither stopped nor finished and logs nothing for this
# long hangs: every wait of a step is bounded well below it (quorum 15 s,
# collectives and transfers 5 s each).
HANG_S = 60.0
# Steps ahead of the newest one when the stop step is picked.
STOP_AHEAD_STEPS = 25
FINISH_HEALTHY_S = 90.0
FINISH_FINAL_S = 90.0
EXIT_AFTER_FINAL_S = 45.0
START_LIMIT_S = 120.0
MAX_CRASHES = 3
# torchrun notices a dead worker and stops the rest of its group about this late.
NOTICE_S = 0.3


@dataclass
class RankState(TrainerState):
    """One trainer (one rank of one group) as the supervisor sees it.

    Beyond what its events tell: its process (``pid``, and ``started``, the
    kernel's start time that tells the pid from its reuse), and whether it
    was found hung.
    """

    rank: int
    pid: int | None = None
    started: str = ""
    hung: bool = False


@dataclass
class GroupState(GroupProgress):
    """One replica group.

    ``state`` (:data:`~ftdist.demo.tracking.State`) is ``starting``,
    ``training``, ``healing`` (restarted, resumed or reconnected, not yet
    back in a full step), ``killed``, ``stopped``, ``cut``, ``finished`` or
    ``exited`` (crashed too often). Beyond what the events tell: when a
    killed group's other ranks die and it restarts, and its crashes.
    """

    group: int
    ranks: list[RankState]
    restart_at: float | None = None
    kill_rest_at: float = 0.0
    crashes: int = 0

    def trainers(self) -> Sequence[RankState]:
        """Its ranks."""
        return self.ranks

    @property
    def healthy(self) -> bool:
        """Every rank committed a step with every group since the last disruption."""
        return self.state == "training" and all(r.healthy for r in self.ranks)


@dataclass
class ChaosRecord:
    """Everything a chaos run produced, for the report."""

    groups: list[GroupState]
    started: float = 0.0
    ended: float = 0.0
    clock_started_s: float | None = None
    stop_step: int | None = None
    interrupted: bool = False
    injections: list[dict[str, Any]] = field(default_factory=list)
    commits: dict[int, float] = field(default_factory=dict)
    # (time, group) of every step a group attempted and did not commit.
    failed_steps: list[tuple[float, int]] = field(default_factory=list)
    heals: list[dict[str, Any]] = field(default_factory=list)
    unexpected_exits: list[dict[str, Any]] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    processes: list[tuple[int, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # A control-plane process that could not be struck or brought back.
    control_errors: list[str] = field(default_factory=list)


class ChaosSupervisor:
    """Runs one chaos run; see the module docstring.

    Args:
        cfg: what the trainers share.
        plan: the injections.
        duration_s: training time, from the first step every group took together.
        lighthouse: the run's single lighthouse (None with a replicated one).
        network: the namespaces (None: no partitions).
        on_event: called with each human-readable line.
        interrupt: the Ctrl-C counter.
        restart_delay_s: between a group's death and its restart.
        control: the replicated lighthouse (None: a single one).
    """

    def __init__(
        self,
        cfg: ChaosWorkerConfig,
        plan: list[schedule.Injection],
        duration_s: float,
        lighthouse: RestartableLighthouse | None,
        network: ChaosNetwork | None,
        on_event: Callable[[str], None],
        interrupt: Interrupt,
        restart_delay_s: float = 0.5,
        control: ControlPlane | None = None,
    ) -> None:
        self.cfg = cfg
        self.duration_s = duration_s
        self.pending = list(plan)
        self.record = ChaosRecord(
            [
                GroupState(g, [RankState(r) for r in range(cfg.group_size)])
                for g in range(cfg.groups)
            ]
        )
        self._say_fn = on_event
        self._interrupt = interrupt
        self.restart_delay_s = restart_delay_s
        self._tracker = Tracker(cfg.events_dir, self.record.groups, self)
        self._t0 = 0.0
        self._clock: float | None = None
        self._last_strike = 0.0
        self._armed: schedule.Armed | None = None
        self._last_reason = ""
        self._addresses: dict[str, tuple[int, int]] = {}
        self.ranks: Ranks | None = None
        self.faults = Faults(self, lighthouse, network, control)
        self.finishing = False

    @property
    def groups(self) -> list[GroupState]:
        """The groups' states."""
        return self.record.groups

    def now(self) -> float:
        """Seconds since the run started."""
        return time.time() - self._t0

    def clock(self) -> float:
        """Seconds of the run's clock (training time; 0 before it starts)."""
        return time.time() - self._clock if self._clock is not None else 0.0

    def say(self, text: str) -> None:
        """Report one line, stamped with the run's time."""
        self._say_fn(f"[{self.now():6.1f}s] {text}")

    def global_rank(self, group: int, rank: int) -> int:
        """The process index of ``rank`` of ``group``."""
        return group * self.cfg.group_size + rank

    # -- the run --------------------------------------------------------------------------
    def run(self) -> ChaosRecord:
        """Run until the duration is reached (or Ctrl-C) and every trainer reported.

        Returns:
            The run's record.
        """
        os.makedirs(self.cfg.events_dir, exist_ok=True)
        self._t0 = self.record.started = time.time()
        self.ranks = Ranks(rank_main, self.cfg.world_size, args=(self.cfg, 0))
        try:
            self.ranks.start()
            for gs in self.groups:
                self._note_pids(gs)
            self.say(
                f"{self.cfg.groups} replica groups of {self.cfg.group_size} ranks started "
                f"(pids {', '.join(str(p) for p in self.ranks.pids)})"
            )
            self._train()
            self._finish()
        finally:
            self.faults.lift_all()
            self.ranks.terminate()
            self._tracker.absorb()
            self.record.ended = time.time()
        return self.record

    def _note_pids(self, gs: GroupState) -> None:
        assert self.ranks is not None
        for rs in gs.ranks:
            pid = self.ranks.pids[self.global_rank(gs.group, rs.rank)]
            rs.pid, rs.started, rs.last_event = pid, proc_start_time(pid), time.time()
            self.record.processes.append((pid, rs.started))

    def _train(self) -> None:
        while True:
            if self._interrupt.count:
                self.record.interrupted = True
                self.say("Ctrl-C: ending the run")
                return
            self._tick()
            self._start_clock()
            if self._clock is not None and self.clock() >= self.duration_s:
                return
            if any(gs.state == "exited" for gs in self.groups):
                self.record.notes.append("a replica group kept dying on its own; run ended early")
                return
            if self._clock is not None:
                self._inject()
            time.sleep(POLL_S)

    def _tick(self) -> None:
        self._tracker.absorb()
        self.faults.maintain()
        self._maintain()
        self._watch_hangs()

    def _start_clock(self) -> None:
        if self._clock is not None:
            return
        if all(gs.healthy for gs in self.groups) or self.now() > START_LIMIT_S:
            if self.now() > START_LIMIT_S:
                self.record.notes.append(
                    f"not every group was training after {START_LIMIT_S:.0f} s; clock started"
                )
            self._clock = time.time()
            self.record.clock_started_s = round(self.now(), 3)
            self.say(f"every group is training (after {self.now():.1f} s); the clock starts")

    # -- injections -------------------------------------------------------------------------
    def health(self) -> list[schedule.GroupHealth]:
        """Each group's health, as the rule reads it."""
        out = []
        for gs in self.groups:
            sources = sorted(
                {
                    self._addresses[a]
                    for rs in gs.ranks
                    for a in rs.receiving
                    if a in self._addresses
                }
            )
            why = gs.state if gs.state != "training" else "not yet in a step with every group"
            out.append(
                schedule.GroupHealth(
                    gs.group, gs.healthy, gs.state == "training", why, tuple(sources)
                )
            )
        return out

    def _inject(self) -> None:
        if self.faults.busy():
            return
        now = self.clock()
        decision = schedule.decide(now, self.pending, self.health(), self._last_strike, self._armed)
        if decision.action == "wait":
            if "postponed" in decision.reason and decision.reason != self._last_reason:
                self.say(decision.reason)
            self._last_reason = decision.reason
            return
        self._last_reason = ""
        inj = decision.injection
        assert inj is not None
        if decision.action == "strike":
            self.pending.pop(0)
            self._last_strike = now
            entry = self.faults.strike(inj, decision, now)
            if inj.kind in schedule.MID_HEAL:
                self._armed = schedule.Armed(inj, now)
                entry["armed"] = True
        elif decision.action == "follow-up":
            self._armed = None
            self.faults.follow_up(inj, decision, now)
        else:
            self._armed = None
            self.faults.abandon(inj, decision.reason)

    # -- processes --------------------------------------------------------------------------
    def kill_group(self, gs: GroupState, only: int | None = None) -> None:
        """SIGKILL the ranks of ``gs`` (rank ``only`` first); it restarts after ``restart_delay_s``.

        With ``only``, the other ranks follow ``NOTICE_S`` later, as torchrun
        takes a moment to notice a dead worker before it stops its group.
        """
        for rs in gs.ranks:
            if only is None or rs.rank == only:
                self._kill(gs, rs)
            rs.receiving.clear()
        gs.state = "killed"
        gs.kill_rest_at = self.now() + (NOTICE_S if only is not None else 0.0)
        gs.restart_at = max(gs.kill_rest_at, self.now() + self.restart_delay_s)
        self.disrupt(gs)

    def _kill(self, gs: GroupState, rs: RankState) -> None:
        assert self.ranks is not None
        index = self.global_rank(gs.group, rs.rank)
        # Only a running process: a reaped one's pid may belong to another by now.
        if self.ranks.exitcode(index) is None:
            self.ranks.kill(index)

    def disrupt(self, gs: GroupState) -> None:
        """Mark ``gs`` as disrupted now: it must step with every group again to be healthy."""
        gs.disrupt(time.time())

    def _maintain(self) -> None:
        assert self.ranks is not None
        for gs in self.groups:
            codes = [self.ranks.exitcode(self.global_rank(gs.group, r.rank)) for r in gs.ranks]
            if gs.state == "killed":
                if self.now() >= gs.kill_rest_at:
                    for rs in gs.ranks:
                        self._kill(gs, rs)
                if all(c is not None for c in codes) and (gs.restart_at or 0) <= self.now():
                    self._restart(gs)
                continue
            if gs.state in ("finished", "exited"):
                continue
            dead = [
                r for r, c in zip(gs.ranks, codes, strict=True) if c is not None and r.final is None
            ]
            if dead:
                self._tracker.absorb()
                dead = [r for r in dead if r.final is None]
            if dead:
                self._crashed(gs, dead[0], codes[dead[0].rank])

    def _crashed(self, gs: GroupState, rs: RankState, code: int | None) -> None:
        assert self.ranks is not None
        outcome = self.ranks.outcome(self.global_rank(gs.group, rs.rank))
        error = outcome.error if outcome is not None else None
        self.record.unexpected_exits.append(
            {
                "group": gs.group,
                "rank": rs.rank,
                "attempt": gs.attempt,
                "exitcode": code,
                "t_s": round(self.now(), 3),
                "error": error,
            }
        )
        last = (error or "").strip().splitlines()[-1:] or [f"exit code {code}"]
        self.say(f"group {gs.group} rank {rs.rank} died on its own: {last[0]}")
        gs.crashes += 1
        if gs.crashes >= MAX_CRASHES or self.finishing:
            for r in gs.ranks:
                self._kill(gs, r)
            gs.state = "exited"
            return
        self.kill_group(gs)

    def _restart(self, gs: GroupState) -> None:
        assert self.ranks is not None
        gs.attempt += 1
        for rs in gs.ranks:
            self.ranks.restart(self.global_rank(gs.group, rs.rank), self.cfg, gs.attempt)
            rs.final = None
            rs.hung = False
            rs.receiving.clear()
        self._note_pids(gs)
        gs.state = "healing"
        gs.restart_at = None
        self.disrupt(gs)
        self.say(f"restarted group {gs.group} (attempt {gs.attempt})")

    def _watch_hangs(self) -> None:
        now = time.time()
        for gs in self.groups:
            if gs.state in ("killed", "finished", "exited"):
                continue
            for rs in gs.ranks:
                if rs.hung or rs.final is not None or self.faults.is_stopped(gs.group, rs.rank):
                    continue
                if now - rs.last_event > HANG_S:
                    rs.hung = True
                    self._hang(gs, rs, f"no event for {HANG_S:.0f} s while running")
                    self.say(f"HANG: group {gs.group} rank {rs.rank} silent for {HANG_S:.0f} s")

    # -- the end ----------------------------------------------------------------------------
    def _finish(self) -> None:
        assert self.ranks is not None
        self.finishing = True
        self.pending.clear()
        if self._armed is not None:
            self.faults.abandon(self._armed.injection, "the run ended first")
            self._armed = None
        self.faults.lift_all()
        for gs in self.groups:
            if gs.state == "killed":
                gs.restart_at = 0.0
        deadline = time.monotonic() + FINISH_HEALTHY_S
        while not all(gs.healthy for gs in self.groups):
            if time.monotonic() > deadline or self._interrupt.count > 1 or self._gave_up():
                self.record.notes.append("not every group was back in a full quorum at the end")
                break
            self._tick()
            time.sleep(POLL_S)
        stop = max(self.record.commits, default=-1) + 1 + STOP_AHEAD_STEPS
        self.record.stop_step = stop
        self.ranks.parent_store().set(STOP_KEY, str(stop))
        self.say(f"every trainer stops at step {stop}")
        deadline = time.monotonic() + FINISH_FINAL_S
        while not self._all_final():
            if time.monotonic() > deadline or self._interrupt.count > 1 or self._gave_up():
                missing = [
                    f"group {gs.group} rank {rs.rank}"
                    for gs in self.groups
                    for rs in gs.ranks
                    if rs.final is None
                ]
                self.record.notes.append(f"no final report from {', '.join(missing)}")
                break
            self._tick()
            time.sleep(POLL_S)
        self._await_exits()

    def _gave_up(self) -> bool:
        return any(gs.state == "exited" for gs in self.groups)

    def _all_final(self) -> bool:
        return all(rs.final is not None for gs in self.groups for rs in gs.ranks)

    def _await_exits(self) -> None:
        """Every trainer that reported must exit by itself, within a bound."""
        assert self.ranks is not None
        deadline = time.monotonic() + EXIT_AFTER_FINAL_S
        running = self._running()
        while running and time.monotonic() < deadline:
            time.sleep(POLL_S)
            running = self._running()
        for gs, rs in running:
            if rs.final is not None:
                self._hang(
                    gs, rs, f"still running {EXIT_AFTER_FINAL_S:.0f} s after its final report"
                )

    def _hang(self, gs: GroupState, rs: RankState, what: str) -> None:
        self.record.hangs.append(
            {
                "group": gs.group,
                "rank": rs.rank,
                "attempt": gs.attempt,
                "t_s": round(self.now(), 3),
                "what": what,
            }
        )

    def _running(self) -> list[tuple[GroupState, RankState]]:
        assert self.ranks is not None
        return [
            (gs, rs)
            for gs in self.groups
            for rs in gs.ranks
            if self.ranks.exitcode(self.global_rank(gs.group, rs.rank)) is None
        ]

    # -- events (the tracker's listener) ----------------------------------------------------
    def on_up(self, group: int, rank: int, event: UpEvent) -> None:
        """A trainer is up: where its checkpoint transport serves (heals name it)."""
        if event.checkpoint is not None:
            self._addresses[event.checkpoint] = (group, rank)

    def on_step(self, group: int, rank: int, event: StepEvent) -> None:
        """A step: the job's commits, the group's failed attempts, recoveries."""
        self.faults.on_step(group, rank, event)
        if event.ok:
            self.record.commits.setdefault(event.step, event.t)
        elif rank == 0:
            self.record.failed_steps.append((event.t, group))

    def on_back(self, group: int, event: StepEvent) -> None:
        """A healing group is back in the quorum."""
        self.say(f"group {group} back in the quorum at step {event.step + 1}")

    def on_heal(self, group: int, rank: int, event: HealEvent) -> None:
        """A heal received or served, for the record."""
        entry = {k: v for k, v in event.as_dict().items() if k != "kind"}
        entry.update(
            group=group,
            rank=rank,
            attempt=self.groups[group].attempt,
            t_s=round(event.t - self._t0, 3),
        )
        self.record.heals.append(entry)


__all__ = ["ChaosRecord", "ChaosSupervisor", "GroupState", "RankState", "proc_start_time"]
