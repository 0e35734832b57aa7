"""
Failure injection: the plan and the rule
========================================

Pure functions, so the schedule can be tested without processes:

* :func:`plan_injections` turns ``(seed, duration, kill_every)`` into the
  planned injections: a SIGKILL roughly every ``kill_every`` seconds
  (jittered by up to 20 %), one of which (the second, or the only one) is a
  SIGSTOP that hangs a replica group past the failure-detection window.
* :func:`decide` says, at time ``now`` and given each replica group's health,
  whether to inject the next planned failure now, and on whom, with the
  reason in words.

The rule only strikes when every replica group is healthy (it committed a
step with every group participating since its last disruption). Striking
while a group is still healing could kill the last up-to-date copy of the
state, which no fault-tolerance scheme survives; postponing keeps the demo
about recoverable failures and keeps every replica's history comparable.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

KILL = "kill"
STOP = "stop"
JITTER = 0.2


@dataclass(frozen=True)
class Injection:
    """One planned failure.

    Attributes:
        index: its position in the plan (0-based).
        at_s: seconds after the run started when it is due.
        kind: ``"kill"`` (SIGKILL, then restart) or ``"stop"`` (SIGSTOP for
            ``hold_s``, then SIGCONT).
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
    seed: int, duration_s: float, kill_every_s: float, stop_hold_s: float
) -> list[Injection]:
    """The planned injections of a run, reproducible from ``seed``.

    No injection is planned in the last ``kill_every_s / 2`` seconds (at
    most 5 s), so that the last failure heals before the run ends.

    Args:
        seed: the run's seed.
        duration_s: the run's training time.
        kill_every_s: mean seconds between injections.
        stop_hold_s: how long the SIGSTOP hangs its victim.

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
    return [
        Injection(i, at, STOP if i == stop_at else KILL, stop_hold_s if i == stop_at else 0.0)
        for i, at in enumerate(times)
    ]


def choose_victim(seed: int, injection: Injection, replicas: int) -> int:
    """The replica group that ``injection`` strikes: seeded, uniform.

    Raises:
        ValueError: ``replicas`` is not positive.
    """
    if replicas < 1:
        raise ValueError(f"replicas ({replicas}) must be positive")
    return random.Random(f"ftdist-demo-victim/{seed}/{injection.index}").randrange(replicas)


def decide(
    now_s: float, pending: Sequence[Injection], health: Sequence[ReplicaHealth], seed: int
) -> Decision:
    """Whether to inject the first pending injection now.

    Args:
        now_s: seconds since the run started.
        pending: injections not yet carried out, in plan order.
        health: every replica group's health.
        seed: the run's seed (picks the victim).

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
    sick = [h for h in health if not h.healthy]
    if sick:
        names = ", ".join(f"replica{h.replica} {h.why_not or 'not healthy'}" for h in sick)
        return Decision(None, None, f"{nxt.kind} postponed: {names}")
    if len(health) < 2:
        return Decision(
            None, None, f"{nxt.kind} skipped: one replica group has no peer to heal from"
        )
    victim = choose_victim(seed, nxt, len(health))
    late = now_s - nxt.at_s
    return Decision(
        nxt,
        victim,
        f"{nxt.kind} replica{victim} (due at {nxt.at_s:.1f} s"
        + (f", {late:.1f} s late)" if late >= 0.5 else ")"),
    )
