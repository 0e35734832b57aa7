"""
Quorum rule
===========

The pure decision at the heart of the lighthouse: given the time and what the
lighthouse has heard, which replica groups train together next, and why (or
why not yet). Nothing here reads a clock, touches a socket or logs; the
lighthouse server passes ``now`` in and acts on the answer, and the unit tests
drive it with a fake clock.

The rule is torchft's, reason strings included (tools grep for them):

* A replica is **healthy** when its last heartbeat is less than
  ``heartbeat_timeout_s`` old. A quorum request counts as a heartbeat.
* **Fast quorum**: when every member of the previous quorum is a healthy
  participant again, the quorum forms at once with every healthy participant,
  new joiners included, unless some participant asks ``shrink_only``, in which
  case only previous members are kept. No other check applies.
* Otherwise a quorum needs at least ``min_replicas`` healthy participants and
  more than half of the healthy replicas (the split-brain guard, so two
  disjoint quorums can never both form), and it waits up to
  ``join_timeout_s`` after the first participant joined for healthy replicas
  that heartbeat but have not asked yet.
* A lighthouse that has just become the leader of a replicated set forms
  only the fast quorum until ``learning_until``, and until ``takeover_until``
  no quorum that leaves out a healthy member of the previous one (see
  :class:`LighthouseState`).
* Members are sorted by ``replica_id``, and a quorum is never empty (torchft
  would form an empty one when ``shrink_only`` excludes every participant).
* Members cut off from their peers, by their own reports, are left out
  (:mod:`ftdist.lighthouse.partition`; a single member can only exclude
  itself), on both paths; if that leaves fewer than ``min_replicas``, no
  quorum forms.
* The ``quorum_id`` grows by one when the membership (the ordered list of
  replica ids) changes or when a member reports ``commit_failures > 0``, and
  only then (:func:`next_quorum_id`); a lighthouse that restarted goes on
  above the highest id its members report having used (ftdist's managers
  report it; torchft's do not, and their ids start again from 1 as with
  torchft's lighthouse).

Members are generic: anything with ``replica_id``, ``shrink_only`` and
``commit_failures`` attributes works, so the server hands in its protobuf
messages unchanged and gets the same objects back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ftdist.lighthouse.partition import exclude_partitioned

# The key of a member's ``data`` JSON object that reports the last quorum id
# its manager used (see next_quorum_id's ``seen``).
QUORUM_ID_KEY = "quorum_id"
_DECODER = json.JSONDecoder()

__all__ = [
    "QUORUM_ID_KEY",
    "LighthouseState",
    "MemberLike",
    "Participant",
    "QuorumConfig",
    "QuorumDecision",
    "QuorumIdDecision",
    "compute_quorum",
    "next_quorum_id",
    "reported_quorum_id",
]


class MemberLike(Protocol):
    """What the rule reads from a quorum request."""

    @property
    def replica_id(self) -> str:
        """The requester's replica group id."""
        ...

    @property
    def shrink_only(self) -> bool:
        """Whether the requester asks that no new member be added."""
        ...

    @property
    def commit_failures(self) -> int:
        """Failed commits the requester reports."""
        ...


M = TypeVar("M", bound=MemberLike)


@dataclass(frozen=True, slots=True)
class QuorumConfig:
    """The knobs of the rule.

    Attributes:
        min_replicas: fewest healthy participants a (non-fast) quorum needs.
        join_timeout_s: how long a ready quorum waits for healthy replicas
            that have not asked yet, counted from the first participant.
        heartbeat_timeout_s: a replica whose last heartbeat is at least this
            old is not healthy.
    """

    min_replicas: int
    join_timeout_s: float
    heartbeat_timeout_s: float

    def __post_init__(self) -> None:
        """Validate the settings.

        Raises:
            ValueError: if ``min_replicas`` is below 1 or a timeout is not
                positive.
        """
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be at least 1.")
        if self.join_timeout_s < 0:
            raise ValueError(f"join_timeout_s ({self.join_timeout_s}) must not be negative.")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be positive.")


@dataclass(slots=True)
class Participant(Generic[M]):
    """A quorum request waiting for the next quorum.

    Attributes:
        joined: when the request (re)joined, in the caller's clock (seconds).
        member: the request itself.
    """

    joined: float
    member: M


@dataclass(slots=True)
class LighthouseState(Generic[M]):
    """What the rule looks at. The server owns and mutates it; the rule only reads.

    Attributes:
        participants: waiting requests by ``replica_id``.
        heartbeats: last heartbeat time by ``replica_id``.
        prev_member_ids: replica ids of the previous quorum in order, or None
            before the first quorum.
        quorum_id: id of the previous quorum (0 before the first).
        learning_until: a lighthouse that has just taken over as leader
            (:mod:`ftdist.lighthouse.replica`) forms no new (non-fast)
            quorum before this time: it has heard from no replica outside
            the previous quorum yet, and the split-brain guard must count
            the replicas that are alive, not only those that have found it
            yet. None: no such wait.
        takeover_until: before this time (one heartbeat timeout after a
            takeover), no quorum forms without a healthy member of the
            previous quorum: its client may still be timing out against the
            old leader, and the join timeout must not leave it out (it would
            heal forward and skip a step). None: no such wait.
    """

    participants: dict[str, Participant[M]] = field(default_factory=dict)
    heartbeats: dict[str, float] = field(default_factory=dict)
    prev_member_ids: tuple[str, ...] | None = None
    quorum_id: int = 0
    learning_until: float | None = None
    takeover_until: float | None = None


@dataclass(frozen=True, slots=True)
class QuorumDecision(Generic[M]):
    """The outcome of :func:`compute_quorum`.

    Attributes:
        members: the next quorum sorted by ``replica_id``, or None when no
            quorum can form yet.
        reason: why, in words (logged and shown on the dashboard).
    """

    members: list[M] | None
    reason: str

    @property
    def ready(self) -> bool:
        """Whether a quorum formed."""
        return self.members is not None


@dataclass(frozen=True, slots=True)
class QuorumIdDecision:
    """The outcome of :func:`next_quorum_id`.

    Attributes:
        quorum_id: the id of the new quorum.
        reason: why the id changed, or None when it did not.
    """

    quorum_id: int
    reason: str | None


def _sorted_members(participants: Iterable[Participant[M]]) -> list[M]:
    members = [p.member for p in participants]
    members.sort(key=lambda m: m.replica_id)
    return members


def compute_quorum(
    now: float, state: LighthouseState[M], settings: QuorumConfig
) -> QuorumDecision[M]:
    """Decide whether a quorum can form now and with whom.

    Args:
        now: the current time, in the same clock as the state's timestamps.
        state: participants, heartbeats and the previous quorum.
        settings: the rule's knobs.

    Returns:
        The members sorted by ``replica_id`` (or None) and the reason.

    The function is total over valid states.
    """
    heartbeat_timeout = settings.heartbeat_timeout_s
    num_healthy = 0
    healthy_participants: dict[str, Participant[M]] = {}
    participants = state.participants
    for replica_id, last_seen in state.heartbeats.items():
        if now - last_seen < heartbeat_timeout:
            num_healthy += 1
            entry = participants.get(replica_id)
            if entry is not None:
                healthy_participants[replica_id] = entry
    num_participants = len(healthy_participants)
    shrink_only = any(p.member.shrink_only for p in healthy_participants.values())
    metadata = (
        f"[{num_participants}/{len(participants)} participants healthy]"
        f"[{num_healthy} heartbeating][shrink_only={'true' if shrink_only else 'false'}]"
    )

    prev_ids = state.prev_member_ids
    if prev_ids is not None:
        if all(rid in healthy_participants for rid in prev_ids):
            # Every previous member asked again: no straggler can be missing,
            # so nothing is gained by waiting.
            if shrink_only:
                keep = set(prev_ids)
                chosen = [p for rid, p in healthy_participants.items() if rid in keep]
            else:
                chosen = list(healthy_participants.values())
            return _without_partitioned(
                _sorted_members(chosen), f"Fast quorum found! {metadata}", settings
            )

    if state.learning_until is not None and now < state.learning_until:
        return QuorumDecision(
            None,
            f"New quorum not ready: this lighthouse took over as leader and waits "
            f"{state.learning_until - now:.2f} s more to learn which replicas are alive "
            f"(only the previous quorum asking again forms at once) {metadata}",
        )
    takeover_until = state.takeover_until
    if prev_ids is not None and takeover_until is not None and now < takeover_until:
        heartbeats = state.heartbeats
        awaited = sum(
            1
            for rid in prev_ids
            if rid not in healthy_participants
            and rid in heartbeats
            and now - heartbeats[rid] < heartbeat_timeout
        )
        if awaited:
            return QuorumDecision(
                None,
                f"New quorum not ready: this lighthouse took over as leader and waits up to "
                f"{takeover_until - now:.2f} s more for {awaited} healthy member(s) of the "
                f"previous quorum that have not asked yet {metadata}",
            )
    if num_participants < settings.min_replicas:
        return QuorumDecision(
            None,
            f"New quorum not ready, only have {num_participants} participants, "
            f"need min_replicas {settings.min_replicas} {metadata}",
        )
    if num_participants <= num_healthy // 2:
        return QuorumDecision(
            None,
            f"New quorum not ready, only have {num_participants} participants, "
            f"need at least half of {num_healthy} healthy workers {metadata}",
        )
    if num_participants != num_healthy:
        first_joined = min(p.joined for p in healthy_participants.values())
        if now - first_joined < settings.join_timeout_s:
            return QuorumDecision(
                None,
                f"Valid quorum with {num_participants} participants, waiting for "
                f"{num_healthy - num_participants} healthy but not participating stragglers "
                f"due to join timeout {metadata}",
            )

    chosen = list(healthy_participants.values())
    if shrink_only and prev_ids is not None:
        keep = set(prev_ids)
        chosen = [p for p in chosen if p.member.replica_id in keep]
        if not chosen:
            # torchft forms an empty quorum here, which then re-forms empty
            # forever while the shrink_only request repeats: nobody trains.
            return QuorumDecision(
                None,
                f"New quorum not ready, shrink_only excludes all {num_participants} "
                f"participants (none was in the previous quorum) {metadata}",
            )
    return _without_partitioned(_sorted_members(chosen), f"Valid quorum found {metadata}", settings)


def _without_partitioned(
    members: list[M], reason: str, settings: QuorumConfig
) -> QuorumDecision[M]:
    """Leave out members cut off from their peers (:mod:`.partition`)."""
    split = exclude_partitioned(members)
    if split.reason is None:
        return QuorumDecision(members, reason)
    if len(split.kept) < settings.min_replicas:
        return QuorumDecision(
            None,
            f"New quorum not ready: {split.reason}, which leaves {len(split.kept)} "
            f"members, need min_replicas {settings.min_replicas}",
        )
    return QuorumDecision(split.kept, f"{reason} [{split.reason}]")


def next_quorum_id(
    quorum_id: int,
    prev_member_ids: Sequence[str] | None,
    members: Sequence[MemberLike],
    seen: int = 0,
) -> QuorumIdDecision:
    """Give a newly formed quorum its id.

    Args:
        quorum_id: the previous quorum's id (0 before the first quorum).
        prev_member_ids: the previous quorum's replica ids in order, or None.
        members: the new quorum's members in order.
        seen: the highest quorum id the members report having used
            (:func:`reported_quorum_id`). Above ``quorum_id`` it means this
            lighthouse restarted and has forgotten ids it gave out: the new
            id goes above it, since managers key their stores by the id and
            one must never name two memberships.

    Returns:
        The new id and, when it grew, why.
    """
    if seen > quorum_id:
        return QuorumIdDecision(
            seen + 1,
            f"Members used quorum ids up to {seen} (an earlier lighthouse's): "
            f"bumping quorum_id to {seen + 1}",
        )
    member_ids = [m.replica_id for m in members]
    if prev_member_ids is None or member_ids != list(prev_member_ids):
        return QuorumIdDecision(
            quorum_id + 1, f"Detected quorum change, bumping quorum_id to {quorum_id + 1}"
        )
    failed = [m.replica_id for m in members if m.commit_failures > 0]
    if failed:
        return QuorumIdDecision(
            quorum_id + 1,
            f"Detected commit failures in {failed}, bumping quorum_id to {quorum_id + 1}",
        )
    return QuorumIdDecision(quorum_id, None)


def reported_quorum_id(data: str) -> int:
    """The last quorum id a member's ``data`` JSON reports (``"quorum_id"``), else 0.

    ftdist's managers report it; torchft's send other data (or none), which
    reads as 0. Anything malformed reads as 0 too.
    """
    # Read on every formation, for every member: decode the one value, not
    # the whole document (ftdist's managers put the key at its top level).
    at = data.find(f'"{QUORUM_ID_KEY}"') if data else -1
    if at < 0 or not data.lstrip().startswith("{"):
        return 0
    colon = data.find(":", at + len(QUORUM_ID_KEY) + 2)
    if colon < 0:
        return 0
    start = colon + 1
    while start < len(data) and data[start] in " \t\r\n":
        start += 1
    try:
        value, _ = _DECODER.raw_decode(data, start)
    except ValueError:
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
