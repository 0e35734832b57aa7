"""
Leadership rules
================

The pure decisions of a replicated lighthouse (:mod:`ftdist.lighthouse.replica`):
whether the leader may still answer, when it renews its lease, and what a
replica does next in its election loop. Nothing here reads a clock or talks to
etcd; the replica passes ``now`` (``time.monotonic()``) in and acts on the
answer, and the unit tests drive every rule with hypothesis.

Why the leader can trust its own clock: etcd starts a lease's TTL again when it
*receives* a renewal, which is after the leader *sent* it. A leader that counts
its TTL from the send time therefore always believes its lease ends no later
than etcd does, and stopping ``margin_s`` before that leaves room for a reply
already on its way. A process that was stopped (SIGSTOP, a long pause) finds
on waking that its own deadline has passed, so it answers nothing more; its
writes are fenced on top of that (the leader key's create revision).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Action",
    "ElectionView",
    "LeaseView",
    "Step",
    "Verdict",
    "next_step",
    "renewal_due",
    "serving_verdict",
]

# A lease is renewed this often, as a fraction of its TTL: three renewals can
# fail in a row before the leader stops answering.
RENEW_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class LeaseView:
    """What a replica knows of its lease.

    Attributes:
        ttl_s: the TTL etcd granted, in seconds.
        renewed_at: when the last grant or renewal that etcd confirmed was
            sent, on the replica's monotonic clock.
    """

    ttl_s: float
    renewed_at: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the leader may answer now.

    Attributes:
        ok: it may.
        left_s: how long it still may, without another renewal (0 if not ok).
        reason: why, in words (shown on the dashboard and in errors).
    """

    ok: bool
    left_s: float
    reason: str


def serving_verdict(
    now: float, lease: LeaseView | None, is_leader: bool, margin_s: float
) -> Verdict:
    """Decide whether this replica may answer quorum requests now.

    Args:
        now: the replica's monotonic clock.
        lease: its lease, or None when it holds none.
        is_leader: whether it won the election with that lease.
        margin_s: how long before the lease's end (counted from the renewal's
            send time) it stops.

    Returns:
        The verdict.
    """
    if not is_leader:
        return Verdict(False, 0.0, "this replica is not the leader")
    if lease is None:
        return Verdict(False, 0.0, "the leader holds no lease")
    left = lease.renewed_at + lease.ttl_s - margin_s - now
    if left <= 0:
        silent = now - lease.renewed_at
        return Verdict(
            False,
            0.0,
            f"the leader has not renewed its {lease.ttl_s:g} s lease for {silent:.2f} s, so "
            "another replica may lead now; it stops forming quorums",
        )
    return Verdict(True, left, f"leader; the lease holds for {left:.2f} s without renewal")


def renewal_due(lease: LeaseView) -> float:
    """When the next renewal of ``lease`` should be sent (monotonic clock)."""
    return lease.renewed_at + lease.ttl_s * RENEW_FRACTION


class Action(enum.Enum):
    """What the election loop does next."""

    GRANT = "grant"
    """Get a new lease (none is held, or the last one ended)."""
    RENEW = "renew"
    """Renew the lease."""
    CAMPAIGN = "campaign"
    """Try to create the leader key with the lease (it is absent)."""
    RESIGN = "resign"
    """Stop leading: the lease may have ended; revoke it and start again."""
    WATCH = "watch"
    """Read the leader key again (follower), or check it is still ours."""
    WAIT = "wait"
    """Nothing is due; sleep until ``at``."""


@dataclass(frozen=True, slots=True)
class ElectionView:
    """What the election loop knows.

    Attributes:
        lease: the replica's lease, or None.
        is_leader: it holds the leader key with that lease.
        leader_seen: a leader key was seen at the last read (ours or not).
        read_at: when the leader key was last read (None: never).
        poll_s: how often a follower reads the leader key (and the leader
            checks it is still its own, every ``poll_s * 10``).
        margin_s: see :func:`serving_verdict`.
    """

    lease: LeaseView | None
    is_leader: bool
    leader_seen: bool
    read_at: float | None
    poll_s: float
    margin_s: float


@dataclass(frozen=True, slots=True)
class Step:
    """The loop's next action.

    Attributes:
        action: what to do.
        at: when (now or later, monotonic clock).
        reason: why, in words (logged).
    """

    action: Action
    at: float
    reason: str


def next_step(now: float, view: ElectionView) -> Step:
    """Decide the election loop's next action.

    The order encodes the safety rules: a leader whose lease may have ended
    resigns before anything else; no replica campaigns without a live lease;
    a follower campaigns only after a read found no leader key.

    Args:
        now: the replica's monotonic clock.
        view: what the loop knows.

    Returns:
        The action, when, and why.
    """
    lease = view.lease
    if view.is_leader:
        verdict = serving_verdict(now, lease, True, view.margin_s)
        if not verdict.ok:
            return Step(Action.RESIGN, now, verdict.reason)
    if lease is None:
        return Step(Action.GRANT, now, "no lease held")
    if now >= lease.renewed_at + lease.ttl_s:
        return Step(Action.GRANT, now, "the lease ran out without a confirmed renewal")
    due = renewal_due(lease)
    if now >= due:
        return Step(Action.RENEW, now, "the lease is due for renewal")
    if view.is_leader:
        check_at = now if view.read_at is None else view.read_at + view.poll_s * 10
        if now >= check_at:
            return Step(Action.WATCH, now, "the leader checks that the leader key is still its own")
        return Step(Action.WAIT, min(due, check_at), "leading")
    if view.read_at is not None and not view.leader_seen:
        return Step(Action.CAMPAIGN, now, "no leader key: campaign")
    read_due = now if view.read_at is None else view.read_at + view.poll_s
    if now >= read_due:
        return Step(Action.WATCH, now, "a follower reads the leader key")
    return Step(Action.WAIT, min(due, read_due), "following")
