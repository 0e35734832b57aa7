"""
The chaos plan and rule
=======================

Pure functions, so the schedule can be tested without processes:

* :func:`plan` turns a seed into the run's injections: one every 5-15 s
  (each gap drawn uniformly), every kind once first in a seeded order, then
  kinds drawn by weight; victims (group, rank) and hold times are drawn too.
* :func:`decide` says, at time ``now``, what to do about the next
  injection given each replica group's health: wait, strike, or (for the two
  mid-heal kinds) carry out the second half once the heal is seen running.

The kinds:

``kill``
    SIGKILL one trainer; as under torchrun, its whole group is restarted.
``stop``
    SIGSTOP one trainer for ``hold_s``, then SIGCONT.
``kill-source``
    SIGKILL a group (the provocation); when its restart heals, SIGKILL the
    trainer serving the heal, in the middle of the transfer.
``kill-healing``
    SIGKILL a group; when its restart heals, SIGKILL the group again.
``lighthouse``
    Stop the lighthouse for ``hold_s``; start a new one on the same port.
``cut-lighthouse``
    Cut one group off from the lighthouse for ``hold_s``.
``cut-peers``
    Cut one group off from the other groups (not the lighthouse) for ``hold_s``.
``cut-peers-long``
    The same for three to four times the trainers' collective timeout: the
    others must leave the cut group out after one failed step and train on,
    and it must rejoin and heal once the cut is lifted.

The control-plane kinds strike a replicated lighthouse (three replicas
electing a leader through a three-member etcd cluster; ``ftdist chaos
--replicated-lighthouse``), which replaces ``lighthouse``
(:data:`REPLICATED_KINDS`):

``kill-leader-lighthouse``
    SIGKILL the leading replica; a follower takes over once its etcd lease
    expires. The killed one starts again (a follower) after ``hold_s``.
``stop-leader-lighthouse``
    SIGSTOP the leading replica past its lease (``hold_s`` is the lease's
    TTL and 1-2 s more), then SIGCONT: a follower took over meanwhile, and
    the woken one must not serve.
``cut-lighthouse-etcd``
    Cut the leading replica off from etcd (not from the groups) for
    ``hold_s``, longer than its lease: it cannot renew, stops answering, and
    a replica that reaches etcd takes over.
``kill-etcd-member``
    SIGKILL etcd member ``member``; the cluster of three survives one loss.
    It starts again (same data) after ``hold_s``.

An injection strikes only when every group is healthy (it committed a step
with every group since its last disruption) and its gap since the previous
strike has passed. The second half of a mid-heal injection is the one
deliberate exception, and it never takes the last up-to-date copy of the
state: a source is killed only when another up-to-date group remains.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

KILL = "kill"
STOP = "stop"
KILL_SOURCE = "kill-source"
KILL_HEALING = "kill-healing"
LIGHTHOUSE = "lighthouse"
CUT_LIGHTHOUSE = "cut-lighthouse"
CUT_PEERS = "cut-peers"
CUT_PEERS_LONG = "cut-peers-long"
KILL_LEADER_LIGHTHOUSE = "kill-leader-lighthouse"
STOP_LEADER_LIGHTHOUSE = "stop-leader-lighthouse"
CUT_LIGHTHOUSE_ETCD = "cut-lighthouse-etcd"
KILL_ETCD_MEMBER = "kill-etcd-member"
# The kinds of a run with one lighthouse (the default).
KINDS = (
    KILL,
    STOP,
    KILL_SOURCE,
    KILL_HEALING,
    LIGHTHOUSE,
    CUT_LIGHTHOUSE,
    CUT_PEERS,
    CUT_PEERS_LONG,
)
# Strikes at a replicated lighthouse and its etcd; they need one.
CONTROL_PLANE = (
    KILL_LEADER_LIGHTHOUSE,
    STOP_LEADER_LIGHTHOUSE,
    CUT_LIGHTHOUSE_ETCD,
    KILL_ETCD_MEMBER,
)
# The kinds of a run with a replicated lighthouse: the control-plane kinds
# take the place of ``lighthouse`` (a restart of the one lighthouse), before
# the partitions, so that an ordered first round still ends with the slowest.
REPLICATED_KINDS = (KILL, STOP, KILL_SOURCE, KILL_HEALING, *CONTROL_PLANE, *KINDS[5:])
ALL_KINDS = (*KINDS, *CONTROL_PLANE)
# The replicated lighthouse's etcd lease TTL (its replicas run with it): a
# stop or a cut of the leader outlasts it by 1-2 s and more.
LEASE_TTL_S = 2.0
# Members of the replicated lighthouse's etcd cluster.
ETCD_MEMBERS = 3
PARTITIONS = (CUT_LIGHTHOUSE, CUT_PEERS, CUT_PEERS_LONG)
# Cuts between replica groups (the victim keeps its lighthouse).
PEER_CUTS = (CUT_PEERS, CUT_PEERS_LONG)
# The chaos trainers' collective timeout (ChaosWorkerConfig.timeout_s): a long
# cut outlasts it three to four times.
COLLECTIVE_TIMEOUT_S = 5.0
MID_HEAL = (KILL_SOURCE, KILL_HEALING)
# After the first round of every kind, kinds are drawn with these weights:
# trainer kills and stops are the everyday failures.
WEIGHTS = {
    KILL: 4,
    STOP: 3,
    KILL_SOURCE: 1,
    KILL_HEALING: 1,
    LIGHTHOUSE: 1,
    CUT_LIGHTHOUSE: 1,
    CUT_PEERS: 1,
    CUT_PEERS_LONG: 1,
    KILL_LEADER_LIGHTHOUSE: 1,
    STOP_LEADER_LIGHTHOUSE: 1,
    CUT_LIGHTHOUSE_ETCD: 1,
    KILL_ETCD_MEMBER: 1,
}
# Seconds a kind holds its fault, drawn uniformly.
HOLDS = {
    STOP: (1.0, 6.0),
    LIGHTHOUSE: (1.0, 4.0),
    CUT_LIGHTHOUSE: (3.0, 10.0),
    CUT_PEERS: (3.0, 10.0),
    CUT_PEERS_LONG: (3.0 * COLLECTIVE_TIMEOUT_S, 4.0 * COLLECTIVE_TIMEOUT_S),
    # Until the killed replica or member starts again.
    KILL_LEADER_LIGHTHOUSE: (1.0, 4.0),
    KILL_ETCD_MEMBER: (2.0, 6.0),
    STOP_LEADER_LIGHTHOUSE: (LEASE_TTL_S + 1.0, LEASE_TTL_S + 2.0),
    CUT_LIGHTHOUSE_ETCD: (LEASE_TTL_S + 1.0, LEASE_TTL_S + 6.0),
}
# A mid-heal injection whose heal is not seen within this long is abandoned.
ARM_LIMIT_S = 45.0


@dataclass(frozen=True)
class Injection:
    """One planned injection.

    Attributes:
        index: its position in the plan (0-based).
        gap_s: seconds after the previous strike (or the start) before it is due.
        kind: one of :data:`KINDS`.
        group: the victim group (the provoked group of a mid-heal kind; unused
            by ``lighthouse`` and the control-plane kinds).
        rank: the victim's group rank (``kill`` and ``stop``).
        hold_s: how long the fault lasts (``stop``, ``lighthouse``, cuts,
            the control-plane kinds).
        member: the etcd member (``kill-etcd-member``).
    """

    index: int
    gap_s: float
    kind: str
    group: int = 0
    rank: int = 0
    hold_s: float = 0.0
    member: int = 0


@dataclass(frozen=True)
class GroupHealth:
    """What the rule knows about one replica group.

    Attributes:
        group: its index.
        healthy: it committed a step with every group since its last disruption.
        up_to_date: it is training (not restarting, healing, stopped or cut off).
        why_not: a short description when not healthy.
        receiving_from: ``(group, rank)`` of each trainer serving it a heal now.
    """

    group: int
    healthy: bool
    up_to_date: bool
    why_not: str = ""
    receiving_from: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Armed:
    """A mid-heal injection whose provocation struck: it waits for the heal.

    Attributes:
        injection: the injection.
        provoked_at_s: when the provoked group was killed.
    """

    injection: Injection
    provoked_at_s: float


@dataclass(frozen=True)
class Decision:
    """The rule's answer.

    Attributes:
        action: ``"wait"``, ``"strike"`` (the first pending injection, or the
            provocation of a mid-heal one), ``"follow-up"`` (the second half
            of the armed injection) or ``"abandon"`` (the armed one, never
            carried out).
        injection: the injection acted on (None when waiting).
        group: the group to strike.
        rank: the trainer to strike (``kill``, ``stop``, ``kill-source``).
        reason: why, for the log.
    """

    action: str
    injection: Injection | None = None
    group: int | None = None
    rank: int | None = None
    reason: str = ""


def plan(
    seed: int,
    duration_s: float,
    groups: int,
    group_size: int,
    kinds: Sequence[str] = KINDS,
    gap_s: tuple[float, float] = (5.0, 15.0),
    ordered: bool = False,
) -> list[Injection]:
    """The run's injections, reproducible from ``seed``.

    Gaps are drawn until their sum passes ``duration_s`` less 10 %; every kind
    of ``kinds`` comes once (in a seeded order, or in the order given with
    ``ordered``) before any repeats.

    Args:
        seed: the run's seed.
        duration_s: the run's length.
        groups: replica groups (victims are drawn among them).
        group_size: ranks per group (victim ranks are drawn among them).
        kinds: the kinds to inject (of :data:`ALL_KINDS`).
        gap_s: the least and most seconds between two strikes.
        ordered: keep the first round in the order of ``kinds`` (a short run
            that must reach every kind puts the slowest to recover last).

    Returns:
        The injections in order.

    Raises:
        ValueError: an argument is out of range or a kind is unknown.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s ({duration_s}) must be positive")
    if groups < 2 or group_size < 1:
        raise ValueError(f"need at least 2 groups of 1 rank, got {groups} of {group_size}")
    if not 0 < gap_s[0] <= gap_s[1]:
        raise ValueError(f"gap_s {gap_s}: give 0 < least <= most")
    unknown = sorted(set(kinds) - set(ALL_KINDS))
    if unknown or not kinds:
        raise ValueError(f"kinds {list(kinds)}: give some of {list(ALL_KINDS)}")
    rng = random.Random(f"ftdist-chaos-plan/{seed}")
    first = list(dict.fromkeys(kinds))
    if not ordered:
        rng.shuffle(first)
    weights = [WEIGHTS[k] for k in first]
    out: list[Injection] = []
    elapsed = 0.0
    while True:
        gap = round(rng.uniform(*gap_s), 2)
        elapsed += gap
        if elapsed > duration_s * 0.9:
            return out
        index = len(out)
        kind = first[index] if index < len(first) else rng.choices(first, weights)[0]
        low, high = HOLDS.get(kind, (0.0, 0.0))
        group, rank = rng.randrange(groups), rng.randrange(group_size)
        hold = round(rng.uniform(low, high), 2) if high else 0.0
        # Drawn for this kind only, so that plans without it stay as they were.
        member = rng.randrange(ETCD_MEMBERS) if kind == KILL_ETCD_MEMBER else 0
        out.append(Injection(index, gap, kind, group, rank, hold, member))


def _follow_up(now_s: float, armed: Armed, health: Sequence[GroupHealth]) -> Decision:
    inj = armed.injection
    target = next((h for h in health if h.group == inj.group), None)
    waited = now_s - armed.provoked_at_s
    if target is None:
        return Decision("abandon", inj, reason=f"{inj.kind}: group {inj.group} does not exist")
    if not target.receiving_from:
        if waited > ARM_LIMIT_S:
            return Decision(
                "abandon",
                inj,
                reason=f"{inj.kind}: no heal of group {inj.group} seen in {ARM_LIMIT_S:.0f} s",
            )
        return Decision("wait", reason=f"{inj.kind}: waiting for group {inj.group} to heal")
    if inj.kind == KILL_HEALING:
        return Decision(
            "follow-up",
            inj,
            group=inj.group,
            reason=f"kill-healing: SIGKILL group {inj.group} while it heals",
        )
    src_group, src_rank = min(target.receiving_from)
    others = [
        h.group
        for h in health
        if h.up_to_date and h.group not in (src_group, inj.group) and not h.receiving_from
    ]
    if not others:
        return Decision(
            "abandon",
            inj,
            reason=(
                f"kill-source: group {src_group} serves the heal but is the last up-to-date "
                "copy of the state"
            ),
        )
    return Decision(
        "follow-up",
        inj,
        group=src_group,
        rank=src_rank,
        reason=(
            f"kill-source: SIGKILL group {src_group} rank {src_rank} while it serves "
            f"group {inj.group}'s heal"
        ),
    )


def decide(
    now_s: float,
    pending: Sequence[Injection],
    health: Sequence[GroupHealth],
    last_strike_s: float,
    armed: Armed | None = None,
) -> Decision:
    """What to do now about the plan.

    Args:
        now_s: seconds since the run's clock started.
        pending: injections not yet carried out, in plan order.
        health: every replica group's health.
        last_strike_s: when the previous injection struck (0 for none).
        armed: the mid-heal injection waiting for its heal, if any.

    Returns:
        The decision and its reason.

    Raises:
        ValueError: ``health`` describes fewer than two groups.
    """
    if len(health) < 2:
        raise ValueError("health must describe at least two replica groups")
    if armed is not None:
        return _follow_up(now_s, armed, health)
    if not pending:
        return Decision("wait", reason="no injection left in the plan")
    nxt = pending[0]
    due = last_strike_s + nxt.gap_s
    if now_s < due:
        return Decision("wait", reason=f"next injection ({nxt.kind}) due at {due:.1f} s")
    sick = [h for h in health if not h.healthy]
    if sick:
        names = ", ".join(f"group {h.group} {h.why_not or 'not healthy'}" for h in sick)
        return Decision("wait", reason=f"{nxt.kind} postponed: {names}")
    group = nxt.group % len(health)
    late = now_s - due
    if nxt.kind == KILL_ETCD_MEMBER:
        where = f" m{nxt.member}"
    elif nxt.kind == LIGHTHOUSE or nxt.kind in CONTROL_PLANE:
        where = ""
    else:
        where = f" group {group}"
    return Decision(
        "strike",
        nxt,
        group=group,
        rank=nxt.rank if nxt.kind in (KILL, STOP) else None,
        reason=f"{nxt.kind}{where}" + (f" ({late:.1f} s late)" if late >= 0.5 else ""),
    )


__all__ = [
    "ALL_KINDS",
    "ARM_LIMIT_S",
    "CONTROL_PLANE",
    "KINDS",
    "MID_HEAL",
    "PARTITIONS",
    "REPLICATED_KINDS",
    "Armed",
    "Decision",
    "GroupHealth",
    "Injection",
    "decide",
    "plan",
]
