"""
Coordination value types
========================

What the lighthouse client hands back: plain frozen dataclasses with torchft's
attribute names (``Quorum``, ``QuorumMember``, ``Timestamp``), plus ftdist's
:class:`LighthouseEvent` for the failure-news stream.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from ftdist._rpc._proto import ftdist_pb2, torchft_pb2

__all__ = ["LighthouseEvent", "Quorum", "QuorumMember", "Timestamp"]


@dataclass(frozen=True, slots=True)
class Timestamp:
    """Wall-clock time as protobuf carries it.

    Args:
        seconds: whole seconds since the Unix epoch.
        nanos: nanoseconds past ``seconds``.
    """

    seconds: int
    nanos: int

    def to_datetime(self) -> dt.datetime:
        """The same instant as an aware UTC datetime.

        Returns:
            The datetime.

        Raises:
            OverflowError: for seconds outside datetime's range.
        """
        base = dt.datetime.fromtimestamp(self.seconds, tz=dt.timezone.utc)
        return base + dt.timedelta(microseconds=self.nanos // 1000)


@dataclass(frozen=True, slots=True)
class QuorumMember:
    """One replica group in a quorum.

    Args:
        replica_id: the replica group's stable id.
        address: its ManagerServer address.
        store_address: its TCPStore address.
        step: the step it reported.
        world_size: ranks in the replica group.
        shrink_only: whether it asked that no new member be added.
        data: the JSON data it attached, decoded, or None.
        commit_failures: failed commits it reported.
        reconfigure_handles: process-group reconfigure handles, one per group
            rank (empty unless its manager sends them).
    """

    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: dict[str, Any] | None = None
    commit_failures: int = 0
    reconfigure_handles: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, member: torchft_pb2.QuorumMember) -> QuorumMember:
        """Convert the wire message.

        Args:
            member: the protobuf message.

        Returns:
            The member; ``data`` that is not a JSON object is kept under the
            key ``"raw"`` rather than failing the whole quorum.
        """
        data: dict[str, Any] | None = None
        if member.data:
            try:
                decoded = json.loads(member.data)
            except ValueError:
                decoded = None
            data = decoded if isinstance(decoded, dict) else {"raw": member.data}
        handles = member.reconfigure_handles
        # Positional, and no tuple() of an empty list: a client turns every
        # member of every quorum into one of these (1024 per round at 1024
        # groups), and the keywords and the empty copy were a fifth of it.
        return cls(
            member.replica_id,
            member.address,
            member.store_address,
            member.step,
            member.world_size,
            member.shrink_only,
            data,
            member.commit_failures,
            tuple(handles) if handles else (),
        )


@dataclass(frozen=True, slots=True)
class Quorum:
    """The replica groups that train together from now on.

    Args:
        quorum_id: grows when the membership changes or after a failed commit.
        participants: the members, sorted by ``replica_id``.
        created: when the lighthouse formed it.
    """

    quorum_id: int
    participants: list[QuorumMember]
    created: Timestamp

    @classmethod
    def from_proto(cls, quorum: torchft_pb2.Quorum) -> Quorum:
        """Convert the wire message.

        Args:
            quorum: the protobuf message.

        Returns:
            The quorum.
        """
        return cls(
            quorum_id=quorum.quorum_id,
            participants=[QuorumMember.from_proto(m) for m in quorum.participants],
            created=Timestamp(quorum.created.seconds, quorum.created.nanos),
        )


_KINDS = {
    ftdist_pb2.SUBSCRIBED: "subscribed",
    ftdist_pb2.QUORUM_FORMED: "quorum_formed",
    ftdist_pb2.MEMBER_FAILED: "member_failed",
    ftdist_pb2.MEMBER_LEFT: "member_left",
}


@dataclass(frozen=True, slots=True)
class LighthouseEvent:
    """One piece of news from the lighthouse.

    Attributes:
        kind: ``"subscribed"`` (first event of every stream),
            ``"quorum_formed"`` (a quorum with a new quorum_id) or
            ``"member_failed"`` (a member of the current quorum went silent)
            or ``"member_left"`` (a member left the job on purpose).
        quorum_id: the current quorum's id when the event was sent.
        replica_id: the failed or departed member; else empty.
        reason: the cause, in words.
        time: when the lighthouse sent it (UTC).
        replica_ids: the quorum's members, for ``"subscribed"`` and
            ``"quorum_formed"``.
    """

    kind: str
    quorum_id: int
    replica_id: str
    reason: str
    time: dt.datetime
    replica_ids: tuple[str, ...]

    @classmethod
    def from_proto(cls, event: ftdist_pb2.LighthouseEvent) -> LighthouseEvent:
        """Convert the wire message.

        Args:
            event: the protobuf message.

        Returns:
            The event; unknown kinds (from a newer lighthouse) read
            ``"unknown"``.
        """
        return cls(
            kind=_KINDS.get(event.kind, "unknown"),
            quorum_id=event.quorum_id,
            replica_id=event.replica_id,
            reason=event.reason,
            time=event.time.ToDatetime(tzinfo=dt.timezone.utc),
            replica_ids=tuple(event.replica_ids),
        )
