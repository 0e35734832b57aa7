"""
Failure injection: the plan and the rule
========================================

Pure functions, so the schedule can be tested without processes:

* :func:`plan_injections` turns ``(seed, duration, kill_every)`` into the
  planned injections: a SIGKILL roughly every ``kill_every`` seconds
  (jittered by up to 20 %), one of which (the second, or the only one) is a
  SIGSTOP that hangs a replica group past the failure-detection window.
  With ``leader_kills`` (``ftdist demo --replicated-lighthouse``) it adds
  one or two SIGKILLs of the leader lighthouse replica, each halfway between
  two of the others.
* :func:`decide` says, at time ``now`` and given each replica group's health,
  whether to inject the next planned failure now, and on whom, with the
  reason in words.

The rule only strikes when every replica group is healthy (it committed a
step with every group participating since its last disruption). Striking
while a group is still healing could kill the last up-to-date copy of the
state, which no fault-tolerance scheme survives; postponing keeps the demo
about recoverable failures and keeps every replica's history comparable.
Likewise nothing strikes while a lighthouse failover is under way (or its
killed replica is not back): each failure's cost is then measured alone.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

KILL = "kill"
STOP = "stop"
LEADER = "leader"
JITTER = 0.2
# What the plan line and the report call each kind.
LABELS = {KILL: "kill", STOP: "stop", LEADER: "leader-lighthouse kill"}
# Once or twice per run: each failover costs the whole job a lease's
# lifetime, and the group failures are the demo's subject.
MAX_LEADER_KILLS = 2


@dataclass(frozen=True)
class Injection:
    """One planned failure.

    Attributes:
        index: its position in the plan (0-based).
        at_s: seconds after the run started when it is due.
        kind: ``"kill"`` (SIGKILL, then restart) or ``"stop"`` (SIGSTOP for
            ``hold_s``, then SIGCONT) of a replica group, or ``"leader"``
            (SIGKILL of the leader lighthouse replica, then restart).
        hold_s: how long a SIGSTOP lasts; 0 for a kill.
    """

    index: int
    at_s: float
    kind: str
    hold_s: float = 0.0


@dataclass(frozen=True)
class ReplicaHealth:
    """What the rule needs to know about one replica group.

    Attributes:
        replica: its index.
        healthy: it committed a step with every group participating since
            its last disruption.
        why_not: a short description when not healthy ("restarting").
    """

    replica: int
    healthy: bool
    why_not: str = ""


@dataclass(frozen=True)
class Decision:
    """The rule's answer: strike ``victim`` with ``injection``, or wait.

    Attributes:
        injection: the injection to carry out now, or None to wait.
        victim: the replica group to strike (None when waiting).
        reason: why, for the log.
    """

    injection: Injection | None
    victim: int | None
    reason: str


def plan_injections(
    seed: int,
    duration_s: float,
    kill_every_s: float,
    stop_hold_s: float,
    leader_kills: bool = False,
) -> list[Injection]:
    """The planned injections of a run, reproducible from ``seed``.

    No injection is planned in the last ``kill_every_s / 2`` seconds (at
    most 5 s), so that the last failure heals before the run ends. The
    times and kinds of the replica groups' failures do not depend on
    ``leader_kills`` (their victims may: they follow the index); the leader
    kills fall halfway between two of them (see :func:`leader_times`).

    Args:
        seed: the run's seed.
        duration_s: the run's training time.
        kill_every_s: mean seconds between injections.
        stop_hold_s: how long the SIGSTOP hangs its victim.
        leader_kills: also kill the leader lighthouse replica once or twice.

    Returns:
        The injections in time order (possibly none for a short run).

    Raises:
        ValueError: a duration is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s ({duration_s}) must be positive")
    if kill_every_s <= 0:
        raise ValueError(f"kill_every_s ({kill_every_s}) must be positive")
    if stop_hold_s <= 0:
        raise ValueError(f"stop_hold_s ({stop_hold_s}) must be positive")
    rng = random.Random(f"ftdist-demo-plan/{seed}")
    last = duration_s - min(5.0, kill_every_s / 2)
    times: list[float] = []
    t = 0.0
    while True:
        t += kill_every_s * rng.uniform(1 - JITTER, 1 + JITTER)
        if t > last:
            break
        times.append(round(t, 2))
    stop_at = 1 if len(times) >= 2 else 0
    kinds = [(at, STOP if i == stop_at else KILL) for i, at in enumerate(times)]
    if leader_kills:
        kinds = sorted(kinds + [(at, LEADER) for at in leader_times(times, last)])
    return [
        Injection(i, at, kind, stop_hold_s if kind == STOP else 0.0)
        for i, (at, kind) in enumerate(kinds)
    ]


def leader_times(times: Sequence[float], last_s: float) -> list[float]:
    """When to kill the leader lighthouse, given the groups' failure times.

    Halfway between two consecutive group failures, so that each failover
    is as far from the others as the plan allows: the first and the last
    such gap when there are three or more, else the middle one. A plan with
    fewer than two group failures has no such gap; the widest stretch of
    the run (from its start, between failures, up to ``last_s``) is halved
    instead.

    Args:
        times: the group failures' times, ascending.
        last_s: the latest time an injection may be due.

    Returns:
        Zero (a run too short) to :data:`MAX_LEADER_KILLS` times, ascending.
    """
    bounds = [0.0, *times, last_s]
    gaps = list(itertools.pairwise(bounds))
    between = gaps[1:-1]
    if len(between) >= 3:
        chosen = [between[0], between[-1]][:MAX_LEADER_KILLS]
    elif between:
        chosen = [between[len(between) // 2]]
    else:
        chosen = [max(gaps, key=lambda gap: gap[1] - gap[0])]
    mids = [round((a + b) / 2, 2) for a, b in chosen]
    return [t for t in mids if 0 < t <= last_s]


def choose_victim(seed: int, injection: Injection, replicas: int) -> int:
    """The replica group that ``injection`` strikes: seeded, uniform.

    Raises:
        ValueError: ``replicas`` is not positive.
    """
    if replicas < 1:
        raise ValueError(f"replicas ({replicas}) must be positive")
    return random.Random(f"ftdist-demo-victim/{seed}/{injection.index}").randrange(replicas)


def decide(
    now_s: float,
    pending: Sequence[Injection],
    health: Sequence[ReplicaHealth],
    seed: int,
    lighthouse_busy: str = "",
) -> Decision:
    """Whether to inject the first pending injection now.

    Args:
        now_s: seconds since the run started.
        pending: injections not yet carried out, in plan order.
        health: every replica group's health.
        seed: the run's seed (picks the victim).
        lighthouse_busy: why the lighthouse is not ready for a strike (a
            failover under way, a replica not back), or "" when it is.

    Returns:
        The decision and its reason.

    Raises:
        ValueError: ``health`` is empty.
    """
    if not health:
        raise ValueError("health must describe at least one replica group")
    if not pending:
        return Decision(None, None, "no injection left in the plan")
    nxt = pending[0]
    if now_s < nxt.at_s:
        return Decision(None, None, f"next injection ({nxt.kind}) due at {nxt.at_s:.1f} s")
    label = LABELS.get(nxt.kind, nxt.kind)
    why = [f"replica{h.replica} {h.why_not or 'not healthy'}" for h in health if not h.healthy]
    if lighthouse_busy:
        why.append(lighthouse_busy)
    if why:
        return Decision(None, None, f"{label} postponed: {', '.join(why)}")
    if len(health) < 2:
        return Decision(None, None, f"{label} skipped: one replica group has no peer to heal from")
    late = now_s - nxt.at_s
    due = f"(due at {nxt.at_s:.1f} s" + (f", {late:.1f} s late)" if late >= 0.5 else ")")
    if nxt.kind == LEADER:
        return Decision(nxt, None, f"kill the leader lighthouse {due}")
    victim = choose_victim(seed, nxt, len(health))
    return Decision(nxt, victim, f"{nxt.kind} replica{victim} {due}")
