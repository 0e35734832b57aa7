"""
What a supervisor knows of its trainers
=======================================

The demo's :class:`~ftdist.demo.supervisor.Supervisor` (one process per
replica group) and the chaos suite's
:class:`~ftdist.chaos.supervisor.ChaosSupervisor` (one process per rank of
each group) follow their trainers' events files (:mod:`ftdist.demo.events`)
and keep, per replica group and per trainer, what the events tell. This
module is that bookkeeping, once: :class:`GroupProgress` and
:class:`TrainerState` hold it (each supervisor extends them with what it
alone needs), and :class:`Tracker` reads the new events and applies them:

* a line of a process already replaced (an earlier attempt of its group)
  is history, and is skipped;
* the group's rank 0 counts the group's step attempts and commits, and the
  heals it received and served;
* a trainer is *back* once it took part in a step after its group's last
  disruption; a starting or healing group trains again once all its
  trainers are back;
* a trainer is *healthy* once it committed a step with every group after
  the last disruption while its group trains; a step without every group
  makes it unhealthy;
* a group whose every trainer reported its final state has finished.

What a step, a return to the quorum, a heal or an ``up`` means beyond that
(the records of the reports, the lines the supervisor prints) differs
between the two; the tracker hands those to its :class:`Listener`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ftdist.demo.events import (
    EventReader,
    FinalEvent,
    HealEvent,
    HealStartEvent,
    StepEvent,
    UpEvent,
)

# ``starting`` (processes up, not yet in a step with every group),
# ``training``, ``healing`` (restarted, resumed or reconnected, not yet back
# in a step), ``killed``, ``stopped`` (SIGSTOPped), ``cut`` (partitioned,
# chaos), ``finished`` (every trainer reported its final state), ``exited``
# (ended without one, or crashed too often).
State = Literal["starting", "training", "healing", "killed", "stopped", "cut", "finished", "exited"]


@dataclass(kw_only=True)
class TrainerState:
    """One trainer process (a rank of a replica group), as its events tell.

    Attributes:
        last_event: the wall time of its newest event.
        back: it took part in a step since its group's last disruption.
        healthy: it committed a step with every group since then, while
            its group trained.
        healthy_at: when it last became healthy.
        receiving: the heals it is receiving now: source address -> start time.
        final: its final report, once written.
    """

    last_event: float = 0.0
    back: bool = False
    healthy: bool = False
    healthy_at: float = 0.0
    receiving: dict[str, float] = field(default_factory=dict)
    final: FinalEvent | None = None


@dataclass(kw_only=True)
class GroupProgress:
    """One replica group, as its trainers' events tell.

    Attributes:
        attempt: its restart count (which events files are current).
        state: see :data:`State`.
        disrupted_at: the wall time of its last disruption (strike, restart,
            resume, ...): steps before it do not count as a return.
        steps_attempted: steps it finished, committed or not.
        steps_committed: steps it committed.
        heals: heals it received.
        served: heals it served.
    """

    attempt: int = 0
    state: State = "starting"
    disrupted_at: float = 0.0
    steps_attempted: int = 0
    steps_committed: int = 0
    heals: int = 0
    served: int = 0

    def trainers(self) -> Sequence[TrainerState]:
        """Its trainers, by group rank.

        Raises:
            NotImplementedError: always; the supervisors' group states say.
        """
        raise NotImplementedError

    def disrupt(self, now: float) -> None:
        """Mark the group disrupted at ``now``: it must step with every group again."""
        self.disrupted_at = now
        for trainer in self.trainers():
            trainer.healthy = False
            trainer.back = False


class Listener(Protocol):
    """What a supervisor does with the events beyond the shared bookkeeping.

    Each call comes after the tracker applied the event to the states.
    """

    def on_up(self, group: int, rank: int, event: UpEvent) -> None:
        """A trainer started."""

    def on_step(self, group: int, rank: int, event: StepEvent) -> None:
        """A trainer finished a step, committed or not."""

    def on_back(self, group: int, event: StepEvent) -> None:
        """A healing group trains again: ``event`` is the step that brought it back."""

    def on_heal(self, group: int, rank: int, event: HealEvent) -> None:
        """A trainer received or served a heal."""


class Tracker:
    """Applies a run's new events to its groups' states; see the module docstring.

    Args:
        events_dir: the run's events folder.
        groups: the groups' states, by index (all of one size).
        listener: told of what the supervisor handles itself.
    """

    def __init__(
        self, events_dir: str, groups: Sequence[GroupProgress], listener: Listener
    ) -> None:
        self._reader = EventReader(events_dir)
        self._groups = groups
        self._group_size = len(groups[0].trainers()) if groups else 1
        self._listener = listener

    def absorb(self) -> None:
        """Read the events written since the last call and apply them, in time order."""
        for process, attempt, event in self._reader.read():
            group, rank = divmod(process, self._group_size)
            gs = self._groups[group]
            if attempt < gs.attempt:
                # A late line of a process already replaced: its steps and
                # heals are history, and must not mark the new one healthy.
                continue
            trainer = gs.trainers()[rank]
            trainer.last_event = max(trainer.last_event, event.t)
            if isinstance(event, StepEvent):
                self._step(group, rank, gs, trainer, event)
            elif isinstance(event, HealStartEvent):
                trainer.receiving[event.source] = event.t
            elif isinstance(event, HealEvent):
                if rank == 0 and event.role == "receive":
                    gs.heals += 1
                elif rank == 0:
                    gs.served += 1
                self._listener.on_heal(group, rank, event)
            elif isinstance(event, UpEvent):
                self._listener.on_up(group, rank, event)
            elif isinstance(event, FinalEvent):
                trainer.final = event
                if all(t.final is not None for t in gs.trainers()):
                    gs.state = "finished"

    def _step(
        self, group: int, rank: int, gs: GroupProgress, trainer: TrainerState, ev: StepEvent
    ) -> None:
        trainer.receiving.clear()
        if rank == 0:
            gs.steps_attempted += 1
            if ev.ok:
                gs.steps_committed += 1
        if ev.ok:
            if ev.participating and ev.t > gs.disrupted_at:
                trainer.back = True
            if gs.state in ("starting", "healing") and all(t.back for t in gs.trainers()):
                was, gs.state = gs.state, "training"
                if was == "healing":
                    self._listener.on_back(group, ev)
            full = ev.participating and ev.participants == len(self._groups)
            if full and ev.t > gs.disrupted_at and gs.state == "training":
                if not trainer.healthy:
                    trainer.healthy, trainer.healthy_at = True, ev.t
            elif not full:
                trainer.healthy = False
        self._listener.on_step(group, rank, ev)


__all__ = ["GroupProgress", "Listener", "State", "Tracker", "TrainerState"]
