"""
The demo's supervisor
=====================

:class:`Supervisor` runs one training run of the demo: it starts the replica
group processes (:func:`ftdist.demo.worker.replica_main`), follows their
events files, carries out the failure plan (:mod:`ftdist.demo.schedule`
decides, this module acts), restarts what it killed as torchrun or a
cluster scheduler would, and ends the run: every replica stops at the same
committed step and reports the hash of its state there.

A kill is restarted after ``restart_delay_s``; a SIGSTOP is held for its
``hold_s``, then continued, and the hung replica finds itself dropped from
the quorum and heals like a restarted one. With a replicated lighthouse
(:mod:`ftdist.demo.lighthouses`), "kill the leader lighthouse" runs in a
thread of its own; the supervisor prints its lines, feeds it the step events
(to see every group commit again) and strikes nothing else meanwhile.

The events are read and applied by :class:`~ftdist.demo.tracking.Tracker`
(shared with the chaos suite); a replica group of the demo is one trainer,
so :class:`ReplicaState` is both the group and its trainer.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftdist.demo import schedule
from ftdist.demo.events import HealEvent, StepEvent, UpEvent
from ftdist.demo.lighthouses import LeaderStrike, ReplicatedLighthouse
from ftdist.demo.tracking import GroupProgress, Tracker, TrainerState
from ftdist.demo.worker import STOP_KEY, WorkerConfig, replica_main
from ftdist.launch.ranks import Ranks

POLL_S = 0.1
# Stop this many seconds of steps past the newest step seen: replicas run
# ahead of their events, and all of them must still be below the stop step
# when they read it, or they would stop at different steps.
STOP_AHEAD_S = 2.0
MIN_STOP_AHEAD_STEPS = 10
REPLAY_BASE_S = 120.0
REPLAY_PER_STEP_S = 0.2
# A replica group that dies on its own this often ends the run.
MAX_CRASHES = 3
# The training clock starts at the latest this long after the processes.
START_LIMIT_S = 60.0


@dataclass
class ReplicaState(GroupProgress, TrainerState):
    """What the supervisor knows about one replica group (and its one trainer).

    ``state`` (:data:`~ftdist.demo.tracking.State`) is one of ``starting``
    (process up, no step yet), ``training``, ``healing`` (restarted or
    resumed, not yet back in a quorum step), ``killed``, ``stopped``
    (SIGSTOPped), ``finished``, ``exited`` (ended without a final report).
    ``healthy``: it committed a step with every group since its last
    disruption. What the events tell beyond the shared bookkeeping (the
    table's step, quorum, participants and loss) is kept here.
    """

    replica: int
    pid: int | None = None
    step: int = 0
    quorum_id: int = -1
    participants: int = 0
    loss: float | None = None
    failures: int = 0
    restart_at: float | None = None
    resume_at: float | None = None

    def trainers(self) -> Sequence[TrainerState]:
        """Its one trainer: itself."""
        return (self,)


@dataclass
class RunRecord:
    """Everything one run produced, for the report.

    ``steps`` maps a committed step to its wall time (first commit seen), the
    losses of the replicas that committed it, and how many participated;
    ``ledger`` is what the run read (:func:`ftdist.demo.ledger.build_ledger`),
    counted after it, or None (DiLoCo).
    """

    name: str
    replicas: list[ReplicaState]
    started: float = 0.0
    ended: float = 0.0
    stop_step: int | None = None
    training_started_s: float | None = None
    interrupted: bool = False
    injections: list[dict[str, Any]] = field(default_factory=list)
    heals: list[dict[str, Any]] = field(default_factory=list)
    failovers: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed_steps: list[dict[str, Any]] = field(default_factory=list)
    unexpected_exits: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ledger: dict[str, Any] | None = None


def _why_not(rs: ReplicaState) -> str:
    if rs.state in ("training", "starting"):
        return "not yet in a step with every group"
    return rs.state


class Interrupt:
    """Counts Ctrl-C presses: the first ends the run gracefully, the second at once."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1


class Supervisor:
    """Runs one training run of the demo; see the module docstring.

    Args:
        cfg: what the replica processes share.
        name: ``"failures"`` or ``"baseline"`` (labels the record).
        plan: the failure plan (empty for none).
        duration_s: training time before the run ends; None to run until
            ``stop_step``.
        stop_step: a stop step known in advance (the baseline replays the
            failure run's step count).
        on_event: called with each human-readable event line.
        on_tick: called with the supervisor about four times a second.
        interrupt: the Ctrl-C counter.
        restart_delay_s: between a SIGKILL and the restart.
        lighthouse: the replicated lighthouse whose leader the plan's
            ``"leader"`` injections kill (None: the plan has none).

    Raises:
        ValueError: neither ``duration_s`` nor ``stop_step`` is given.
    """

    def __init__(
        self,
        cfg: WorkerConfig,
        name: str,
        plan: list[schedule.Injection],
        duration_s: float | None,
        stop_step: int | None,
        on_event: Callable[[str], None],
        on_tick: Callable[[Supervisor], None],
        interrupt: Interrupt,
        restart_delay_s: float = 1.0,
        lighthouse: ReplicatedLighthouse | None = None,
    ) -> None:
        if duration_s is None and stop_step is None:
            raise ValueError("give duration_s or stop_step")
        self.cfg = cfg
        self.duration_s = duration_s
        self.pending = list(plan)
        self.record = RunRecord(name, [ReplicaState(r) for r in range(cfg.replicas)])
        self.record.stop_step = stop_step
        self._on_event = on_event
        self._on_tick = on_tick
        self._interrupt = interrupt
        self._restart_delay_s = restart_delay_s
        self._lighthouse = lighthouse
        self._strikes: list[LeaderStrike] = []
        self._tracker = Tracker(cfg.events_dir, self.record.replicas, self)
        self._t0 = 0.0
        self._last_tick = 0.0
        self._last_reason = ""
        self._rate: list[tuple[float, int]] = []
        self._ranks: Ranks | None = None
        self._control: Any = None
        self.phase = "starting"
        self._crash_loop = False
        self._train_t0: float | None = None

    # -- helpers for views ------------------------------------------------------------------
    @property
    def replicas(self) -> list[ReplicaState]:
        """The replica groups' states, by index."""
        return self.record.replicas

    def train_elapsed(self) -> float:
        """Seconds of training: since every replica group first stepped together."""
        return time.time() - self._train_t0 if self._train_t0 is not None else 0.0

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.time() - self._t0 if self._t0 else 0.0

    def max_step(self) -> int:
        """The number of steps committed so far (the newest committed step + 1)."""
        return max(self.record.steps, default=-1) + 1

    def _say(self, text: str) -> None:
        self._on_event(f"[{self.elapsed():6.1f}s] {text}")

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> RunRecord:
        """Run until the duration (or stop step) is reached, or Ctrl-C.

        Returns:
            The run's record; ``interrupted`` tells whether Ctrl-C ended it.

        For a failing replica: that goes into the record.
        """
        os.makedirs(self.cfg.events_dir, exist_ok=True)
        self._t0 = self.record.started = time.time()
        ranks = Ranks(replica_main, self.cfg.replicas, args=(self.cfg, 0))
        self._ranks = ranks
        try:
            ranks.start()
            for r, pid in enumerate(ranks.pids):
                self.replicas[r].pid = pid
            self._control = ranks.parent_store()
            if self.record.stop_step is not None:
                self._control.set(STOP_KEY, str(self.record.stop_step))
            self.phase = "training"
            self._say(
                f"{self.record.name} run: {self.cfg.replicas} replica groups started "
                f"(pids {', '.join(str(p) for p in ranks.pids)})"
            )
            self._train()
            self._finish()
        finally:
            for strike in self._strikes:
                strike.cancel()
            self._follow_strikes()
            ranks.terminate()
            self._tracker.absorb()
            self.record.ended = time.time()
            self.phase = "done"
            self._tick(force=True)
        return self.record

    def _train(self) -> None:
        while True:
            if self._interrupt.count:
                self.record.interrupted = True
                self._say("Ctrl-C: ending the run (press again to stop at once)")
                return
            self._tracker.absorb()
            self._follow_strikes()
            now = self.elapsed()
            self._start_clock(now)
            if self.duration_s is not None and self.train_elapsed() >= self.duration_s:
                return
            if self.duration_s is None and self._all_final():
                return
            if self.duration_s is None and now > self._replay_limit_s():
                self.record.notes.append(
                    f"the run did not reach step {self.record.stop_step} "
                    f"within {self._replay_limit_s():.0f} s"
                )
                return
            if self._crash_loop:
                self.record.notes.append("a replica group kept dying on its own; run ended early")
                return
            self._maintain(now)
            if self.duration_s is not None and self._train_t0 is not None:
                self._maybe_inject(self.train_elapsed(), now)
            self._tick()
            time.sleep(POLL_S)

    def _finish(self) -> None:
        """Bring every replica back, pick the common stop step, collect the finals."""
        assert self._ranks is not None
        self.phase = "finishing"
        self.pending.clear()
        for rs in self.replicas:
            if rs.state == "stopped":
                self._resume(rs)
            if rs.state == "killed":
                rs.restart_at = 0.0
        if self.record.interrupted and self.duration_s is None:
            # A run to a known step (the baseline) is only a comparison:
            # Ctrl-C ends it at once.
            return
        grace = 20.0 if self.record.interrupted else 45.0
        deadline = time.monotonic() + grace
        if self.record.stop_step is None:
            # A failover under way ends first: its row needs every group's return.
            while not all(rs.healthy for rs in self.replicas) or not all(
                s.settled() for s in self._strikes
            ):
                if time.monotonic() > deadline or self._interrupt.count > 1 or self._crash_loop:
                    self.record.notes.append(
                        "a lighthouse failover was not over when the run ended"
                        if all(rs.healthy for rs in self.replicas)
                        else "not every replica group was back in the quorum when the run ended"
                    )
                    break
                self._finishing_tick()
            stop = self.max_step() + self._steps_ahead()
            self.record.stop_step = stop
            self._control.set(STOP_KEY, str(stop))
            self._say(f"all replica groups stop at step {stop}")
        deadline = time.monotonic() + grace
        while not self._all_final():
            if (
                time.monotonic() > deadline
                or self._interrupt.count > 1
                or any(rs.state == "exited" for rs in self.replicas)
            ):
                missing = [f"replica{rs.replica}" for rs in self.replicas if rs.final is None]
                self.record.notes.append(f"no final report from {', '.join(missing)}")
                break
            self._finishing_tick()
        # The replicas left together (done barrier); give them a moment to exit.
        self._ranks.join(timeout=5.0 if self._all_final() else 0.5)

    def _finishing_tick(self) -> None:
        if self._interrupt.count and not self.record.interrupted:
            self.record.interrupted = True
            self._say("Ctrl-C: the run is already ending (press again to stop at once)")
        self._tracker.absorb()
        self._follow_strikes()
        self._maintain(self.elapsed())
        self._tick()
        time.sleep(POLL_S)

    def _replay_limit_s(self) -> float:
        # A run to a known stop step (the baseline) has no duration; this
        # bounds it generously (it steps at tens of steps per second).
        return REPLAY_BASE_S + REPLAY_PER_STEP_S * (self.record.stop_step or 0)

    def _all_final(self) -> bool:
        return all(rs.final is not None for rs in self.replicas)

    def _steps_ahead(self) -> int:
        if len(self._rate) >= 2:
            (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
            if t1 > t0:
                return max(MIN_STOP_AHEAD_STEPS, int((s1 - s0) / (t1 - t0) * STOP_AHEAD_S) + 1)
        return 4 * MIN_STOP_AHEAD_STEPS

    # -- acting on the plan -----------------------------------------------------------------
    def _start_clock(self, now: float) -> None:
        # The duration and the failure plan count training time, from the
        # first step every replica group took together: starting processes
        # takes seconds on a busy machine, and a plan that struck during
        # start-up would only be postponed.
        if self._train_t0 is not None or self.duration_s is None:
            return
        if all(rs.healthy for rs in self.replicas) or now > START_LIMIT_S:
            if now > START_LIMIT_S:
                self.record.notes.append(
                    f"the replica groups were not all training after "
                    f"{START_LIMIT_S:.0f} s; the clock started anyway"
                )
            self._train_t0 = time.time()
            self.record.training_started_s = round(now, 3)
            self._say(
                f"every replica group is training (after {now:.1f} s of start-up); the clock starts"
            )

    def _maybe_inject(self, train_now: float, now: float) -> None:
        health = [
            schedule.ReplicaHealth(rs.replica, rs.healthy, _why_not(rs)) for rs in self.replicas
        ]
        busy = self._lighthouse.busy() if self._lighthouse is not None else ""
        decision = schedule.decide(train_now, self.pending, health, self.cfg.seed, busy)
        if decision.injection is None:
            if "postponed" in decision.reason and decision.reason != self._last_reason:
                self._say(decision.reason)
            self._last_reason = decision.reason
            return
        self._last_reason = ""
        injection = self.pending.pop(0)
        if injection.kind == schedule.LEADER:
            self._strike_leader(injection)
            return
        assert decision.victim is not None
        self._strike(injection, self.replicas[decision.victim], now)

    def _strike(self, injection: schedule.Injection, rs: ReplicaState, now: float) -> None:
        assert self._ranks is not None
        entry: dict[str, Any] = {
            "index": injection.index,
            "kind": injection.kind,
            "replica": rs.replica,
            "due_s": injection.at_s,
            "t_s": round(now, 3),
            "pid": rs.pid,
            "step": rs.step,
            "attempt": rs.attempt,
            "hold_s": injection.hold_s,
            "survivors_s": None,
            "back_s": None,
        }
        self.record.injections.append(entry)
        rs.failures += 1
        rs.disrupt(time.time())
        if injection.kind == schedule.STOP:
            self._ranks.signal(rs.replica, signal.SIGSTOP)
            rs.state = "stopped"
            rs.resume_at = now + injection.hold_s
            self._say(
                f"SIGSTOP replica{rs.replica} (pid {rs.pid}) at step {rs.step}: hung "
                f"for {injection.hold_s:.1f} s, past the failure-detection window"
            )
        else:
            self._ranks.kill(rs.replica)
            rs.state = "killed"
            rs.restart_at = now + self._restart_delay_s
            self._say(f"SIGKILL replica{rs.replica} (pid {rs.pid}) at step {rs.step}")

    def _strike_leader(self, injection: schedule.Injection) -> None:
        if self._lighthouse is None:
            self.record.notes.append(
                f"injection {injection.index} (kill the leader lighthouse) skipped: "
                "the lighthouse is not replicated"
            )
            return
        strike = self._lighthouse.strike(
            injection.index, injection.at_s, self._t0, self.cfg.replicas, self.max_step()
        )
        self._strikes.append(strike)
        self.record.failovers.append(strike.entry)

    def _follow_strikes(self) -> None:
        """Print what the leader strikes did since the last call."""
        for strike in self._strikes:
            for line in strike.lines():
                self._say(line)

    def _resume(self, rs: ReplicaState) -> None:
        assert self._ranks is not None
        self._ranks.signal(rs.replica, signal.SIGCONT)
        rs.state = "healing"
        rs.resume_at = None
        rs.disrupt(time.time())
        self._say(
            f"SIGCONT replica{rs.replica} (pid {rs.pid}): it must notice it was dropped and heal"
        )

    def _maintain(self, now: float) -> None:
        """Restart killed replicas, resume stopped ones, notice unexpected exits."""
        assert self._ranks is not None
        for rs in self.replicas:
            code = self._ranks.exitcode(rs.replica)
            if rs.state == "stopped" and rs.resume_at is not None and now >= rs.resume_at:
                self._resume(rs)
            elif (
                rs.state == "killed"
                and code is not None
                and rs.restart_at is not None
                and now >= rs.restart_at
            ):
                self._restart(rs)
            elif code is not None and rs.state not in ("killed", "finished", "exited"):
                # It may have written its final report and left since the
                # last read of the events.
                self._tracker.absorb()
                if rs.final is not None:
                    rs.state = "finished"
                    continue
                self._crashed(rs, code, now)

    def _crashed(self, rs: ReplicaState, code: int, now: float) -> None:
        """A replica group ended without being struck: an ftdist bug, or the machine."""
        assert self._ranks is not None
        outcome = self._ranks.outcome(rs.replica)
        error = outcome.error if outcome is not None else None
        self.record.unexpected_exits.append(
            {
                "replica": rs.replica,
                "attempt": rs.attempt,
                "exitcode": code,
                "t_s": round(now, 3),
                "error": error,
            }
        )
        last = (error or "").strip().splitlines()[-1:] or [f"exit code {code}"]
        self._say(f"replica{rs.replica} died on its own: {last[0]}")
        rs.disrupt(time.time())
        crashes = sum(1 for e in self.record.unexpected_exits if e["replica"] == rs.replica)
        if crashes >= MAX_CRASHES or (
            self.phase == "finishing" and self.record.stop_step is not None
        ):
            # A crash loop would only bury the first error under restarts.
            rs.state = "exited"
            self._crash_loop = True
        else:
            self._restart(rs)

    def _restart(self, rs: ReplicaState) -> None:
        assert self._ranks is not None
        rs.attempt += 1
        self._ranks.restart(rs.replica, self.cfg, rs.attempt)
        rs.pid = self._ranks.pids[rs.replica]
        rs.state = "healing"
        rs.restart_at = None
        rs.disrupt(time.time())
        self._say(f"restarted replica{rs.replica} (pid {rs.pid}, attempt {rs.attempt})")

    # -- events (the tracker's listener) ----------------------------------------------------
    def on_up(self, group: int, rank: int, event: UpEvent) -> None:
        """A replica's process is up: its pid, as it tells it."""
        rs = self.replicas[group]
        if rs.state == "starting":
            rs.pid = event.pid

    def on_step(self, group: int, rank: int, event: StepEvent) -> None:
        """A step of a replica: its row in the table, the step's record, the injections'."""
        rs = self.replicas[group]
        rs.quorum_id, rs.participants = event.quorum_id, event.participants
        t_s = round(event.t - self._t0, 3)
        for strike in self._strikes:
            # Steps not committed count too: the next one began after them.
            line = strike.observe(rs.replica, event)
            if line is not None:
                self._say(line)
        if not event.ok:
            self.record.failed_steps.append(
                {"replica": rs.replica, "step": event.step, "t_s": t_s, "error": event.error}
            )
            return
        rs.step = event.step + 1
        if not math.isnan(event.loss):  # a group that read nothing (healing) has no loss
            rs.loss = event.loss
        if rs.participants < self.cfg.replicas:
            for inj in reversed(self.record.injections):
                if (
                    inj["replica"] != rs.replica
                    and inj["survivors_s"] is None
                    and event.t - self._t0 > inj["t_s"]
                ):
                    # The first step the others commit without the victim:
                    # detection, reconfigure and one step.
                    inj["survivors_s"] = round(event.t - self._t0 - inj["t_s"], 3)
                break
        step = self.record.steps.setdefault(
            event.step, {"t_s": t_s, "losses": {}, "participants": 0}
        )
        if event.participating and not math.isnan(event.loss):
            step["losses"][rs.replica] = event.loss
        step["participants"] = max(step["participants"], rs.participants)
        self._rate.append((event.t, rs.step))
        if len(self._rate) > 50:
            del self._rate[0]

    def on_back(self, group: int, event: StepEvent) -> None:
        """A restarted or resumed replica is back in the quorum: how long it took."""
        rs = self.replicas[group]
        for inj in reversed(self.record.injections):
            if inj["replica"] == rs.replica and inj["back_s"] is None:
                inj["back_s"] = round(event.t - self._t0 - inj["t_s"], 3)
                break
        self._say(
            f"replica{rs.replica} back in the quorum at step {event.step + 1} "
            f"({event.t - rs.disrupted_at:.2f} s after its restart or resume)"
        )

    def on_heal(self, group: int, rank: int, event: HealEvent) -> None:
        """A heal received or served: the record, and a line for a received one."""
        rs = self.replicas[group]
        entry = {k: v for k, v in event.as_dict().items() if k not in ("kind", "t")}
        entry.update(replica=rs.replica, attempt=rs.attempt, t_s=round(event.t - self._t0, 3))
        self.record.heals.append(entry)
        if event.role == "receive":
            self._say(
                f"replica{rs.replica} healed to step {event.step} from replica rank(s) "
                f"{event.peers}: quorum {event.quorum_s * 1e3:.0f} ms, reconfigure "
                f"{event.reconfigure_s * 1e3:.0f} ms, {event.transfer_bytes / 1e6:.2f} MB "
                f"in {event.transfer_s * 1e3:.0f} ms, load {event.load_s * 1e3:.0f} ms"
            )

    def _tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_tick >= 0.25:
            self._last_tick = now
            self._on_tick(self)
