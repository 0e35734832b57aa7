"""
Striking the control plane
==========================

:class:`ControlFaults` carries out the control-plane kinds of
:mod:`ftdist.chaos.schedule` on a
:class:`~ftdist.chaos.controlplane.ControlPlane`, for
:class:`~ftdist.chaos.faults.Faults`: it strikes the leading lighthouse
replica (SIGKILL, SIGSTOP, a cut from etcd) or an etcd member (SIGKILL),
holds the fault for the injection's ``hold_s`` and then undoes it (the
killed process starts again, the stopped one gets SIGCONT, the cut is
lifted), and times the job's recovery.

The job must ride these faults out while they last, so the recovery counts
from the strike (the entry's ``end`` is its ``t``):

* A strike at the leader is over for the job once another term leads. The
  replicas are asked every ``POLL_S`` (the victim not while it is stopped)
  until one serves under a new fencing revision; its term began
  ``failover_s`` after the strike (it says how long it has led, so a late
  question does not make the figure late). ``recovered`` is when every
  trainer had committed a step with every group after that. No new term
  within ``FAILOVER_LIMIT_S`` is a control-plane error (the verdict fails),
  and the recovery is then timed as for an etcd member.
* An etcd member's death need not change anything the job sees:
  ``recovered`` is when every trainer had committed a step with every group
  that began after the strike. A step in flight at the strike had its
  quorum already; it is taken to be each trainer's first step to end after
  the strike, which is not counted (the figure may exceed the truth by up to
  a step, never fall short).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftdist.chaos import schedule

if TYPE_CHECKING:
    from ftdist.chaos.controlplane import ControlPlane
    from ftdist.chaos.supervisor import ChaosSupervisor
    from ftdist.demo.events import StepEvent

__all__ = ["FAILOVER_LIMIT_S", "ControlFaults"]

POLL_S = 0.25
FAILOVER_LIMIT_S = 20.0


@dataclass
class _Watch:
    """The trainers' way back after a strike.

    Attributes:
        entry: the injection's record entry.
        since: only commits after this count (None: not known yet, the new
            term not seen).
        skip_first: a commit must come after each trainer's first step to
            end after the strike (the one in flight at it).
        first: per trainer, when its first step after the strike ended.
        commits: per trainer, its commits with every group after the strike.
    """

    entry: dict[str, Any]
    since: float | None
    skip_first: bool
    first: dict[tuple[int, int], float] = field(default_factory=dict)
    commits: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def back(self, trainer: tuple[int, int]) -> float | None:
        """When ``trainer`` first committed a step that counts, or None."""
        if self.since is None:
            return None
        after = max(self.since, self.first.get(trainer, 0.0) if self.skip_first else 0.0)
        return next((t for t in self.commits.get(trainer, ()) if t > after), None)


@dataclass
class _Held:
    """The control-plane fault in force: until when, and what ends it."""

    until: float
    entry: dict[str, Any]
    end: Callable[[], None]
    message: str


@dataclass
class _Term:
    """A strike at the leader, waiting for a new term: the victim and its fencing revision."""

    entry: dict[str, Any]
    victim: int
    fencing: int
    next_poll: float = 0.0


class ControlFaults:
    """The control-plane faults of one run; see the module docstring.

    Args:
        sup: the supervisor (groups, record, log).
        control: the replicated lighthouse.
    """

    def __init__(self, sup: ChaosSupervisor, control: ControlPlane) -> None:
        self._sup = sup
        self.control = control
        self._held: _Held | None = None
        self._term: _Term | None = None
        self._watches: list[_Watch] = []

    def busy(self) -> bool:
        """Whether a fault is held, or a strike at the leader waits for a new term."""
        return self._held is not None or self._term is not None

    def strike(self, inj: schedule.Injection, entry: dict[str, Any]) -> None:
        """Strike; the fault is held for ``inj.hold_s``. Fills in ``entry``."""
        sup, control = self._sup, self.control
        fencing = 0
        if inj.kind == schedule.KILL_ETCD_MEMBER:
            victim = entry["member"] = inj.member
        else:
            found = control.leading()
            if found is None:
                entry["outcome"] = "skipped"
                entry["detail"] = "no lighthouse replica led at the strike"
                sup.say(f"SKIPPED {inj.kind}: no lighthouse replica leads")
                return
            victim, fencing, _ = found
            entry["replica"] = victim
        strike, end, what, after = {
            schedule.KILL_ETCD_MEMBER: (
                control.kill_member,
                control.restart_member,
                f"etcd member m{victim} SIGKILLed",
                f"etcd member m{victim} restarted",
            ),
            schedule.KILL_LEADER_LIGHTHOUSE: (
                control.kill_replica,
                control.restart_replica,
                f"leader replica {victim} SIGKILLed",
                f"lighthouse replica {victim} restarted",
            ),
            schedule.STOP_LEADER_LIGHTHOUSE: (
                control.stop_replica,
                control.continue_replica,
                f"leader replica {victim} SIGSTOPped",
                f"SIGCONT lighthouse replica {victim}",
            ),
            schedule.CUT_LIGHTHOUSE_ETCD: (
                control.cut_replica,
                control.lift_replica,
                f"leader replica {victim} cut off from etcd",
                f"lighthouse replica {victim} reaches etcd again",
            ),
        }[inj.kind]
        entry["t"] = entry["end"] = time.time()
        try:
            strike(victim)
        except (RuntimeError, TimeoutError, OSError) as exc:
            # The victim died under us (a race), or the proxy failed: the
            # latter is the harness's fault, and either must show.
            entry["outcome"] = "skipped"
            entry["detail"] = f"{what} FAILED: {exc}"
            sup.record.control_errors.append(f"{inj.kind} #{inj.index}: {entry['detail']}")
            sup.say(f"SKIPPED {inj.kind}: {entry['detail']}")
            return
        entry["detail"] = what
        self._held = _Held(time.time() + inj.hold_s, entry, functools.partial(end, victim), after)
        if inj.kind == schedule.KILL_ETCD_MEMBER:
            self._watches.append(_Watch(entry, entry["t"], skip_first=True))
        else:
            self._watches.append(_Watch(entry, None, skip_first=False))
            self._term = _Term(entry, victim, fencing, time.time() + POLL_S)
        for g in sup.groups:
            sup.disrupt(g)
        sup.say(f"{inj.kind}: {what} for {inj.hold_s:.1f} s")

    def maintain(self) -> None:
        """End the fault whose hold is over; look for the new term; record recoveries."""
        now = time.time()
        if self._held is not None and now >= self._held.until:
            self.end_held()
        if self._term is not None and now >= self._term.next_poll:
            self._poll_term()
        self._check_recovery()

    def end_held(self, early: bool = False) -> None:
        """End the held fault: restart, resume or reconnect (``early``: the run ends)."""
        held, self._held = self._held, None
        if held is None:
            return
        sup, entry = self._sup, held.entry
        if early:
            entry["detail"] += " (hold cut short: the run ended)"
        try:
            held.end()
        except (RuntimeError, TimeoutError, OSError) as exc:
            # The job may ride it out (two replicas, two members), but a
            # control plane that cannot be brought back is a finding.
            failure = f"{entry['kind']} #{entry['index']}: {held.message} FAILED: {exc}"
            sup.record.control_errors.append(failure)
            sup.say(failure.splitlines()[0])
            return
        entry["restored"] = time.time()
        sup.say(held.message)

    def _poll_term(self) -> None:
        term = self._term
        assert term is not None
        stopped = (
            self._held is not None
            and self._held.entry is term.entry
            and term.entry["kind"] == schedule.STOP_LEADER_LIGHTHOUSE
        )
        found = self.control.leading(skip=term.victim if stopped else None)
        now = time.time()
        entry = term.entry
        watch = next(w for w in self._watches if w.entry is entry)
        if found is not None and found[1] != term.fencing:
            self._term = None
            began = max(found[2], entry["t"])
            entry["new_leader"] = found[0]
            entry["failover_s"] = round(began - entry["t"], 3)
            watch.since = began
            self._sup.say(
                f"lighthouse replica {found[0]} leads (a new term) since "
                f"{entry['failover_s']:.1f} s after the {entry['kind']}"
            )
        elif now - entry["t"] > FAILOVER_LIMIT_S:
            self._term = None
            failure = (
                f"{entry['kind']} #{entry['index']}: no lighthouse replica led anew within "
                f"{FAILOVER_LIMIT_S:.0f} s"
            )
            self._sup.record.control_errors.append(failure)
            self._sup.say(failure)
            watch.since, watch.skip_first = entry["t"], True
        else:
            term.next_poll = now + POLL_S

    def on_step(self, group: int, rank: int, event: StepEvent) -> None:
        """A trainer's step: how far it is from recovering."""
        full = event.ok and event.participating and event.participants == len(self._sup.groups)
        for watch in self._watches:
            if event.t <= watch.entry["t"]:
                continue
            watch.first.setdefault((group, rank), event.t)
            if full:
                watch.commits.setdefault((group, rank), []).append(event.t)

    def _check_recovery(self) -> None:
        trainers = [(gs.group, rs.rank) for gs in self._sup.groups for rs in gs.ranks]
        for watch in list(self._watches):
            times = [watch.back(t) for t in trainers]
            if all(t is not None for t in times):
                watch.entry["recovered"] = max(t for t in times if t is not None)
                self._watches.remove(watch)

    def lift_all(self) -> None:
        """The run ends: end the held fault now; stop waiting for a new term."""
        self.end_held(early=True)
        if self._term is not None:
            # Its recovery is then timed from the strike, as for an etcd member.
            for watch in self._watches:
                if watch.entry is self._term.entry:
                    watch.since, watch.skip_first = watch.entry["t"], True
            self._term = None
