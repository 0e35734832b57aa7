"""
Carrying out injections
=======================

:class:`Faults` does what :func:`ftdist.chaos.schedule.decide` decided:
signals trainers, restarts the lighthouse, cuts and heals network paths;
it ends each timed fault when its hold is over, and records every
injection with the times the report needs:

* ``t``: when it struck; ``end``: when the fault ended (the kill itself, the
  SIGCONT, the lighthouse's restart, the partition's lifting);
* ``recovered``: when every group had committed a step with every group
  again after ``end`` (the time to recover is ``recovered - end``).

The control-plane kinds (a replicated lighthouse's leader killed, stopped
or cut off from etcd; an etcd member killed) go to
:class:`~ftdist.chaos.failover.ControlFaults`, which times their recovery
from the strike.
"""

from __future__ import annotations

import functools
import signal
import time
from typing import TYPE_CHECKING, Any

from ftdist.chaos import schedule
from ftdist.chaos.failover import ControlFaults

if TYPE_CHECKING:
    from ftdist.chaos.controlplane import ControlPlane
    from ftdist.chaos.lighthouse import RestartableLighthouse
    from ftdist.chaos.netns import ChaosNetwork
    from ftdist.chaos.supervisor import ChaosSupervisor
    from ftdist.demo.events import StepEvent
    from ftdist.demo.tracking import State


class Faults:
    """The injections of one run and the faults in progress.

    Args:
        sup: the supervisor (processes, groups, record).
        lighthouse: the run's single lighthouse (None with a replicated one).
        network: the namespaces, or None (partitions are then skipped).
        control: the replicated lighthouse, or None (its kinds are then skipped).
    """

    def __init__(
        self,
        sup: ChaosSupervisor,
        lighthouse: RestartableLighthouse | None,
        network: ChaosNetwork | None,
        control: ControlPlane | None = None,
    ) -> None:
        self._sup = sup
        self.lighthouse = lighthouse
        self.network = network
        self._stopped: dict[tuple[int, int], tuple[float, dict[str, Any]]] = {}
        self._cuts: dict[int, tuple[float, dict[str, Any]]] = {}
        self._lighthouse_down: tuple[float, dict[str, Any]] | None = None
        self._open: list[dict[str, Any]] = []
        self._control = None if control is None else ControlFaults(sup, control)

    # -- state ------------------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether a timed fault (stop, lighthouse down, cut, control plane) is in progress."""
        held = self._control is not None and self._control.busy()
        return bool(self._stopped or self._cuts or self._lighthouse_down or held)

    def is_stopped(self, group: int, rank: int) -> bool:
        """Whether that trainer is SIGSTOPped now."""
        return (group, rank) in self._stopped

    # -- striking ---------------------------------------------------------------------------
    def _entry(self, inj: schedule.Injection, now: float, **extra: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "index": inj.index,
            "kind": inj.kind,
            "group": inj.group,
            "rank": inj.rank,
            "hold_s": inj.hold_s,
            "clock_s": round(now, 3),
            "t": time.time(),
            "end": None,
            "recovered": None,
            "outcome": "done",
            "detail": "",
            **extra,
        }
        self._sup.record.injections.append(entry)
        return entry

    def strike(
        self, inj: schedule.Injection, decision: schedule.Decision, now: float
    ) -> dict[str, Any]:
        """Carry out ``inj`` (the provocation of a mid-heal kind).

        Returns:
            The injection's record entry.

        Raises:
            NetworkError: a partition could not be made.
            OSError: the lighthouse could not be stopped cleanly.
        """
        sup = self._sup
        assert sup.ranks is not None and decision.group is not None
        gs = sup.groups[decision.group]
        entry = self._entry(inj, now, group=decision.group)
        if inj.kind in schedule.CONTROL_PLANE:
            self._strike_control(inj, entry)
            return entry
        if inj.kind == schedule.LIGHTHOUSE and self.lighthouse is None:
            entry["outcome"] = "skipped"
            entry["detail"] = "the lighthouse is replicated: no single one to restart"
            sup.say("SKIPPED lighthouse: the lighthouse is replicated")
        elif inj.kind == schedule.KILL:
            rank = decision.rank or 0
            sup.kill_group(gs, only=rank)
            entry["end"] = entry["t"]
            sup.say(f"SIGKILL group {gs.group} rank {rank}: the group restarts")
        elif inj.kind == schedule.STOP:
            rank = decision.rank or 0
            sup.ranks.signal(sup.global_rank(gs.group, rank), signal.SIGSTOP)
            self._stopped[(gs.group, rank)] = (time.time() + inj.hold_s, entry)
            gs.state = "stopped"
            sup.disrupt(gs)
            sup.say(f"SIGSTOP group {gs.group} rank {rank} for {inj.hold_s:.1f} s")
        elif inj.kind in schedule.MID_HEAL:
            sup.kill_group(gs)
            entry["detail"] = f"provoked: group {gs.group} killed, waiting for its heal"
            sup.say(f"{inj.kind}: SIGKILL group {gs.group}; striking again once it heals")
        elif inj.kind == schedule.LIGHTHOUSE:
            assert self.lighthouse is not None
            entry["group"] = None
            self.lighthouse.stop()
            self._lighthouse_down = (time.time() + inj.hold_s, entry)
            for g in sup.groups:
                sup.disrupt(g)
            sup.say(f"lighthouse stopped for {inj.hold_s:.1f} s")
        elif self.network is None:
            entry["outcome"] = "skipped"
            entry["detail"] = "no network namespaces on this machine"
            sup.say(f"SKIPPED {inj.kind}: no network namespaces (needs root and iproute2)")
        else:
            if inj.kind == schedule.CUT_LIGHTHOUSE:
                hosts = [self.network.lighthouse_host]
                what = "the lighthouse"
            else:
                hosts = [
                    self.network.group_host(g) for g in range(len(sup.groups)) if g != gs.group
                ]
                what = "its peers (not the lighthouse)"
            self.network.cut(gs.group, hosts)
            self._cuts[gs.group] = (time.time() + inj.hold_s, entry)
            gs.state = "cut"
            sup.disrupt(gs)
            sup.say(f"partition: group {gs.group} cut off from {what} for {inj.hold_s:.1f} s")
        if entry["outcome"] == "done":
            self._open.append(entry)
        return entry

    def _strike_control(self, inj: schedule.Injection, entry: dict[str, Any]) -> None:
        entry["group"] = None
        if self._control is None:
            entry["outcome"] = "skipped"
            entry["detail"] = "no replicated lighthouse (--replicated-lighthouse, etcd)"
            self._sup.say(f"SKIPPED {inj.kind}: no replicated lighthouse")
        else:
            self._control.strike(inj, entry)

    def follow_up(self, inj: schedule.Injection, decision: schedule.Decision, now: float) -> None:
        """The second half of a mid-heal injection: kill the source, or the healing group."""
        sup = self._sup
        assert sup.ranks is not None and decision.group is not None
        entry = next(e for e in reversed(sup.record.injections) if e["index"] == inj.index)
        provoked = sup.groups[inj.group]
        started = [t for rs in provoked.ranks for t in rs.receiving.values()]
        entry["heal_started"] = min(started) if started else None
        entry["healing_attempt"] = provoked.attempt
        target = sup.groups[decision.group]
        if inj.kind == schedule.KILL_SOURCE:
            rank = decision.rank or 0
            sup.kill_group(target, only=rank)
            entry["detail"] = f"source group {target.group} rank {rank} killed mid-heal"
            entry["source"] = [target.group, rank]
        else:
            sup.kill_group(target)
            entry["detail"] = f"group {target.group} killed while healing"
        entry["t2"] = time.time()
        entry["end"] = entry["t2"]
        sup.say(decision.reason)

    def abandon(self, inj: schedule.Injection, reason: str) -> None:
        """Record that the armed injection's second half never came."""
        entry = next(e for e in reversed(self._sup.record.injections) if e["index"] == inj.index)
        entry["outcome"] = "abandoned"
        entry["detail"] = reason
        if entry["end"] is None:
            entry["end"] = entry["t"]
        self._sup.say(f"{inj.kind} abandoned: {reason}")

    # -- ending faults ----------------------------------------------------------------------
    def maintain(self) -> None:
        """End the timed faults whose hold is over; record recoveries.

        Raises:
            NetworkError: a partition could not be lifted.
            OSError: the lighthouse could not be restarted on its port.
        """
        now = time.time()
        for (group, rank), (until, entry) in list(self._stopped.items()):
            if now >= until:
                self._resume(group, rank, entry)
        for group, (until, entry) in list(self._cuts.items()):
            if now >= until:
                self._lift(group, entry)
        if self._lighthouse_down is not None and now >= self._lighthouse_down[0]:
            self._restart_lighthouse()
        if self._control is not None:
            self._control.maintain()
        self._check_recovery()

    def _resume(self, group: int, rank: int, entry: dict[str, Any]) -> None:
        sup = self._sup
        assert sup.ranks is not None
        del self._stopped[(group, rank)]
        sup.ranks.signal(sup.global_rank(group, rank), signal.SIGCONT)
        self._ended(group, "stopped", entry, f"SIGCONT group {group} rank {rank}")

    def _lift(self, group: int, entry: dict[str, Any]) -> None:
        assert self.network is not None
        del self._cuts[group]
        self.network.heal(group)
        self._ended(group, "cut", entry, f"partition of group {group} lifted")

    def _ended(self, group: int, state: State, entry: dict[str, Any], message: str) -> None:
        """A fault on ``group`` is over: a group still in ``state`` now heals."""
        sup = self._sup
        gs = sup.groups[group]
        if gs.state == state:
            gs.state = "healing"
        sup.disrupt(gs)
        entry["end"] = time.time()
        sup.say(message)

    def on_step(self, group: int, rank: int, event: StepEvent) -> None:
        """A trainer's step: how far it is from recovering from a control-plane strike."""
        if self._control is not None:
            self._control.on_step(group, rank, event)

    def _restart_lighthouse(self) -> None:
        sup = self._sup
        assert self._lighthouse_down is not None and self.lighthouse is not None
        entry = self._lighthouse_down[1]
        self._lighthouse_down = None
        try:
            self.lighthouse.start()
        except OSError as exc:
            sup.record.notes.append(f"the lighthouse could not be restarted: {exc}")
            sup.say(f"lighthouse restart FAILED: {exc}")
            raise
        for gs in sup.groups:
            sup.disrupt(gs)
        entry["end"] = time.time()
        sup.say(f"lighthouse restarted on {self.lighthouse.address}")

    def _check_recovery(self) -> None:
        sup = self._sup
        if not self._open or not all(gs.healthy for gs in sup.groups):
            return
        back = max(rs.healthy_at for gs in sup.groups for rs in gs.ranks)
        for entry in list(self._open):
            if entry["end"] is not None and back >= entry["end"]:
                entry["recovered"] = back
                self._open.remove(entry)

    def lift_all(self) -> None:
        """End every fault now (the run is ending): resume, heal, restart.

        A step that fails is noted and the others still run, so that nothing
        stays stopped or cut off because of another's failure.
        """
        steps: list[Any] = [
            functools.partial(self._resume, group, rank, entry)
            for (group, rank), (_, entry) in list(self._stopped.items())
        ]
        steps += [functools.partial(self._lift, g, e) for g, (_, e) in list(self._cuts.items())]
        if self._lighthouse_down is not None:
            steps.append(self._restart_lighthouse)
        if self._control is not None:
            steps.append(self._control.lift_all)
        for step in steps:
            try:
                step()
            except Exception as exc:  # noted; the teardown goes on
                self._sup.record.notes.append(f"ending a fault failed: {exc!r}")


__all__ = ["Faults"]
