"""
Lighthouse engine
=================

The live state of a lighthouse and everything it does over time, with no
networking: it records heartbeats, parks quorum requests until a quorum that
includes them forms, runs the pure rule of :mod:`ftdist.lighthouse.quorum`
and acts on its decisions, notices dead members and tells subscribers, and
keeps the numbers the dashboard shows.

Invariants:

* It is used from one thread (the lighthouse's server thread); no locks.
* A parked request is answered only with a quorum that contains its
  requester. A requester left out (unhealthy, or a joiner during
  ``shrink_only``) is parked again for the next round with its join time
  reset, as torchft does.
* A quorum is serialized once, and that one response goes to every member.

Performance: torchft runs the full rule on every request, which is O(N) per
request and O(N^2) per round. Here a request runs it only when its arrival can
have made a quorum possible (every previous member is back, or there are
enough participants for the slow path); the periodic tick catches what only
the passage of time changes (join timeout, expired heartbeats). The decisions
are the same; only evaluations that cannot succeed are skipped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist.lighthouse.history import Histogram, JobHistory
from ftdist.lighthouse.news import News, Subscriber
from ftdist.lighthouse.quorum import (
    LighthouseState,
    Participant,
    QuorumConfig,
    QuorumDecision,
    compute_quorum,
    next_quorum_id,
    reported_quorum_id,
)
from ftdist.lighthouse.streams import StreamWatch

__all__ = ["LATENCY_BUCKETS_S", "FormedQuorum", "LighthouseEngine", "Subscriber"]

logger = logging.getLogger("ftdist.lighthouse.server")

Member = torchft_pb2.QuorumMember

LATENCY_BUCKETS_S = tuple(
    ms / 1000 for ms in (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1e3, 2.5e3, 5e3, 1e4, 3e4, 6e4)
)
"""Upper bounds of the quorum latency histogram buckets, in seconds."""

# Heartbeats of replicas silent this many heartbeat timeouts are forgotten, so
# a long job whose replica ids change on every restart (torchft appends a
# uuid) does not grow the table forever. Such entries cannot change a
# decision: they are not healthy either way.
_FORGET_AFTER_TIMEOUTS = 12.0
# A not-ready reason is logged at INFO only once the round has waited this
# long; partial rounds are normal and would flood the log.
_STUCK_LOG_AFTER_S = 1.0

# Left replica ids remembered (to ignore their late heartbeats and streams).
_MAX_LEFT = 4096


@dataclass(frozen=True, slots=True)
class FormedQuorum:
    """A quorum as the engine hands it out.

    Attributes:
        quorum: the protobuf quorum.
        member_ids: replica ids in order.
        member_set: the same ids as a set, for O(1) membership checks.
        response: the serialized ``LighthouseQuorumResponse`` every member gets.
        formed_at: engine-clock time of formation.
    """

    quorum: torchft_pb2.Quorum
    member_ids: tuple[str, ...]
    member_set: frozenset[str]
    response: bytes
    formed_at: float


Deliver = Callable[[FormedQuorum | None], None]
"""Answers a parked request: with its quorum, or None if the lighthouse closes."""


class _Waiter:
    """A parked quorum request."""

    __slots__ = ("deliver", "entry", "member")

    def __init__(self, member: Member, deliver: Deliver) -> None:
        self.member = member
        self.deliver = deliver
        self.entry: Participant[Member] | None = None


class LighthouseEngine:
    """Quorum state machine of one lighthouse. Use it from one thread.

    Args:
        settings: the quorum rule's knobs.
        clock: monotonic time source in seconds (tests may inject one).
        wall_clock: wall time source in seconds since the epoch.
        max_replica_ids: most replica ids whose heartbeat is remembered
            (see :meth:`admit`).
        history: where quorum changes, failures and steps are recorded
            (a fresh :class:`~ftdist.lighthouse.history.JobHistory` if None).
    """

    def __init__(
        self,
        settings: QuorumConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_replica_ids: int = 65536,
        history: JobHistory | None = None,
    ) -> None:
        self.settings = settings
        self.max_replica_ids = max_replica_ids
        # At most one sweep for expired ids between ticks, so that a flood of
        # new ids against a full table costs O(1) per request.
        self._may_sweep = True
        self._clock = clock
        self._wall_clock = wall_clock
        self.state: LighthouseState[Member] = LighthouseState()
        self.current: FormedQuorum | None = None
        # Parked requests by replica id; almost always one each, two while a
        # manager's retry overlaps its timed-out call.
        self._waiters: dict[str, list[_Waiter]] = {}
        self._round_started: float | None = None
        self._prev_set: frozenset[str] = frozenset()
        self._num_prev_present = 0
        self._expired_at_tick = 0
        self._failed_reported: set[str] = set()
        # Replica groups that left on purpose, oldest first; bounded, since
        # every restart of a group is a new id.
        self._left: dict[str, None] = {}
        self._news = News(wall_clock)
        self._streams = StreamWatch()
        self._last_reason = ""
        self.closed = False
        self.started_at = clock()
        self.num_quorums = 0
        self.num_member_failures = 0
        self.latency = Histogram(LATENCY_BUCKETS_S)
        self.history = history if history is not None else JobHistory()
        # A replicated lighthouse's: records a new quorum durably before any
        # reply carries it; returns why not (then it is not issued), or None.
        self.persist: Callable[[int, tuple[str, ...]], str | None] | None = None

    def now(self) -> float:
        """The engine's clock, in seconds."""
        return self._clock()

    def restore(
        self, quorum_id: int, member_ids: tuple[str, ...] | None, learning_until: float | None
    ) -> None:
        """Start from the last quorum another lighthouse issued (a takeover):
        its members asking again unchanged get it back, same id; any other
        quorum gets a higher id, and none forms before ``learning_until``
        (engine clock; None: no wait). ``member_ids`` is None if none was issued.
        Its members count as heartbeating from now, and for a heartbeat
        timeout no quorum forms without them (``takeover_until``): one still
        timing out against the old leader is waited for, not healed forward.
        """
        state = self.state
        state.quorum_id = quorum_id
        state.prev_member_ids = member_ids
        state.learning_until = learning_until
        now = self._clock()
        state.takeover_until = now + self.settings.heartbeat_timeout_s if member_ids else None
        for replica_id in member_ids or ():
            state.heartbeats.setdefault(replica_id, now)
        self._prev_set = frozenset(member_ids or ())
        self._num_prev_present = sum(1 for rid in state.participants if rid in self._prev_set)

    # -- requests ---------------------------------------------------------

    def heartbeat(self, replica_id: str) -> None:
        """Record a heartbeat from ``replica_id`` (ignored once it left)."""
        if replica_id in self._left:
            return
        self.state.heartbeats[replica_id] = self._clock()

    def admit(self, replica_id: str) -> bool:
        """Whether a request naming ``replica_id`` may be recorded.

        Known ids always are. A new id is refused while ``max_replica_ids``
        ids are remembered, unless expired ones (silent for a heartbeat
        timeout, so unhealthy either way: the rule decides the same without
        them) can be forgotten to make room; that sweep runs at most once
        per tick.
        """
        heartbeats = self.state.heartbeats
        if replica_id in heartbeats or len(heartbeats) < self.max_replica_ids:
            return True
        if self._may_sweep:
            self._may_sweep = False
            now = self._clock()
            timeout = self.settings.heartbeat_timeout_s
            expired = [rid for rid, seen in heartbeats.items() if now - seen >= timeout]
            for rid in expired:
                del heartbeats[rid]
            self._expired_at_tick = max(0, self._expired_at_tick - len(expired))
        return len(heartbeats) < self.max_replica_ids

    def parked(self, replica_id: str) -> int:
        """How many quorum requests of ``replica_id`` are waiting."""
        return len(self._waiters.get(replica_id, ()))

    def leave(self, replica_id: str) -> None:
        """``replica_id`` leaves the job on purpose.

        It is forgotten at once (peers' next quorum does not wait for it),
        its connections closing are not a failure, and subscribers hear that
        it left.
        """
        if not replica_id or replica_id in self._left:
            return
        self._left[replica_id] = None
        while len(self._left) > _MAX_LEFT:
            del self._left[next(iter(self._left))]
        self.state.heartbeats.pop(replica_id, None)
        self._streams.forget(replica_id)
        logger.info("Replica %s left", replica_id)
        self.history.member_failed(self._wall_clock(), replica_id, "it left the job")
        self._publish(ftdist_pb2.MEMBER_LEFT, replica_id=replica_id, reason="it left the job")
        if self.state.participants:
            self._evaluate(self._clock())

    def join(self, member: Member, deliver: Deliver) -> object:
        """Park a quorum request until a quorum containing its requester forms.

        ``deliver`` is called exactly once, possibly before this returns: with
        that quorum, or with None if the lighthouse closes first. Nothing is
        delivered after :meth:`withdraw`.

        Args:
            member: the validated requester.
            deliver: how to answer it.

        Returns:
            A ticket for :meth:`withdraw`.

        The rule is total and ``deliver`` must not raise.
        """
        waiter = _Waiter(member, deliver)
        if self.closed:
            deliver(None)
            return waiter
        now = self._clock()
        self.state.heartbeats[member.replica_id] = now
        self.history.step_seen(self._wall_clock(), member.step)
        self._park(waiter, now)
        self._on_arrival(now)
        return waiter

    def withdraw(self, ticket: object) -> None:
        """Forget a parked request whose caller went away, so no quorum
        counts a requester that cannot hear the answer.

        Unknown or answered tickets are ignored.
        """
        if not isinstance(ticket, _Waiter):
            return
        replica_id = ticket.member.replica_id
        parked = self._waiters.get(replica_id)
        if parked is None or ticket not in parked:
            return
        parked.remove(ticket)
        if not parked:
            del self._waiters[replica_id]
        participants = self.state.participants
        if ticket.entry is None or participants.get(replica_id) is not ticket.entry:
            return  # a newer request from the same replica is the one counted
        older = parked[-1].entry if parked else None
        if older is not None:
            # An older request of the same replica still waits: count it again.
            participants[replica_id] = older
            return
        del participants[replica_id]
        if replica_id in self._prev_set:
            self._num_prev_present -= 1
        if not participants:
            self._round_started = None

    def _park(self, waiter: _Waiter, now: float) -> None:
        participants = self.state.participants
        replica_id = waiter.member.replica_id
        if replica_id not in participants:
            if replica_id in self._prev_set:
                self._num_prev_present += 1
            if self._round_started is None:
                self._round_started = now
        waiter.entry = Participant(joined=now, member=waiter.member)
        participants[replica_id] = waiter.entry
        self._waiters.setdefault(replica_id, []).append(waiter)

    def _on_arrival(self, now: float) -> None:
        num = len(self.state.participants)
        prev = self.state.prev_member_ids
        if prev is None or self._num_prev_present != len(prev):
            # No fast quorum possible; check cheap necessary conditions of the
            # slow path. The healthy count is estimated from the last tick:
            # an overestimate (a replica died since) only delays the quorum to
            # the next tick, which is when torchft would notice too.
            if num < self.settings.min_replicas:
                return
            num_healthy = len(self.state.heartbeats) - self._expired_at_tick
            if num <= num_healthy // 2:
                return
            started = self._round_started if self._round_started is not None else now
            if num < num_healthy and now - started < self.settings.join_timeout_s:
                return
        self._evaluate(now)

    # -- deciding and acting ----------------------------------------------

    def _evaluate(self, now: float) -> QuorumDecision[Member]:
        decision = compute_quorum(now, self.state, self.settings)
        if decision.members is not None:
            self._form(decision.members, now, decision.reason)
        return decision

    def _form(self, members: list[Member], now: float, reason: str) -> None:
        state = self.state
        seen = max((reported_quorum_id(m.data) for m in members), default=0)
        id_decision = next_quorum_id(state.quorum_id, state.prev_member_ids, members, seen)
        quorum = torchft_pb2.Quorum(quorum_id=id_decision.quorum_id, participants=members)
        quorum.created.FromNanoseconds(int(self._wall_clock() * 1e9))
        response = torchft_pb2.LighthouseQuorumResponse(quorum=quorum).SerializeToString()
        member_ids = tuple(m.replica_id for m in members)
        formed = FormedQuorum(quorum, member_ids, frozenset(member_ids), response, now)

        id_changed = self.current is None or id_decision.quorum_id != state.quorum_id
        new_id = state.prev_member_ids is None or id_decision.quorum_id != state.quorum_id
        if new_id and self.persist is not None:
            problem = self.persist(id_decision.quorum_id, member_ids)
            if problem is not None:
                # The requests stay parked; a deposed leader hands them back.
                self._last_reason = f"quorum {id_decision.quorum_id} not issued: {problem}"
                logger.warning("Quorum %d not issued: %s", id_decision.quorum_id, problem)
                return
        if id_decision.reason is not None:
            shown = ", ".join(member_ids[:16]) + (" ..." if len(member_ids) > 16 else "")
            logger.info("%s", id_decision.reason)
            logger.info(
                "Quorum %d: %d members [%s] (%s)",
                id_decision.quorum_id,
                len(member_ids),
                shown,
                reason,
            )
        else:
            logger.debug("Quorum %d formed again (%s)", id_decision.quorum_id, reason)
        if self._round_started is not None:
            self.latency.observe(max(0.0, now - self._round_started))
        self.num_quorums += 1

        state.quorum_id = id_decision.quorum_id
        state.prev_member_ids = member_ids
        state.takeover_until = None  # every member of this one has found this leader
        state.participants.clear()
        self._prev_set = formed.member_set
        self._num_prev_present = 0
        self._round_started = None
        self._last_reason = reason
        self.current = formed
        if id_changed:
            self._failed_reported.clear()
            self._publish(ftdist_pb2.QUORUM_FORMED, replica_ids=member_ids, reason=reason)
            self.history.quorum_formed(
                self._wall_clock(), formed.quorum.quorum_id, member_ids, reason
            )

        waiters, self._waiters = self._waiters, {}
        for replica_id, parked in waiters.items():
            for waiter in parked:
                if replica_id in formed.member_set:
                    waiter.deliver(formed)
                else:
                    # Left out: wait for the next round like a new request
                    # (evaluated at the next tick or arrival, as in torchft).
                    self._park(waiter, now)

    def tick(self) -> QuorumDecision[Member] | None:
        """Re-evaluate the quorum, expire heartbeats and report dead members.

        Returns:
            The rule's decision when there were participants, else None.
        """
        if self.closed:
            return None
        now = self._clock()
        self._may_sweep = True
        heartbeats = self.state.heartbeats
        timeout = self.settings.heartbeat_timeout_s
        forget_before = now - timeout * _FORGET_AFTER_TIMEOUTS
        for replica_id in [rid for rid, seen in heartbeats.items() if seen < forget_before]:
            del heartbeats[replica_id]
        expired = [rid for rid, seen in heartbeats.items() if now - seen >= timeout]
        self._expired_at_tick = len(expired)
        if expired:
            wall, why = self._wall_clock(), f"no heartbeat for {timeout:g} s or more"
            for rid in expired:
                self.history.lost(wall, rid, why)
        self._check_lost_streams(now)
        self._report_dead_members(now)
        if not self.state.participants:
            return None
        decision = self._evaluate(now)
        if not decision.ready and decision.reason != self._last_reason:
            self._last_reason = decision.reason
            started = self._round_started
            stuck = started is not None and now - started >= _STUCK_LOG_AFTER_S
            logger.log(
                logging.INFO if stuck else logging.DEBUG, "Quorum status: %s", decision.reason
            )
        return decision

    def decide(self) -> QuorumDecision[Member]:
        """Run the rule now without acting on it (for the dashboard).

        Returns:
            The decision the next evaluation would make.
        """
        return compute_quorum(self._clock(), self.state, self.settings)

    def stream_opened(self, replica_id: str, listener: str = "") -> None:
        """A subscriber naming ``replica_id`` opened its failure-news stream.

        Args:
            replica_id: the replica group it belongs to.
            listener: which process of the group listens (stable across its
                reconnects); empty for clients that do not say.
        """
        self._streams.opened(replica_id, listener)

    def stream_closed(self, replica_id: str, listener: str = "") -> None:
        """A subscriber naming ``replica_id`` lost its stream.

        Only a stream that stays lost for :data:`STREAM_GRACE_S` makes the
        member count as failed (:class:`~ftdist.lighthouse.streams.StreamWatch`).
        """
        if replica_id in self._left:
            return
        self._streams.closed(replica_id, listener, self._clock())

    def check_lost_streams(self) -> None:
        """Report members whose streams stayed lost for the grace, at once.

        The server calls this :data:`STREAM_GRACE_S` after a stream closed,
        so that a death is news within the grace, not at the next tick.
        """
        if self.closed:
            return
        now = self._clock()
        self._check_lost_streams(now)
        if self.state.participants:
            self._evaluate(now)

    def _check_lost_streams(self, now: float) -> None:
        for replica_id, since in self._streams.expired(now):
            why = f"its connection to the lighthouse closed {now - since:.1f} s ago"
            self.history.lost(self._wall_clock(), replica_id, why)
            current = self.current
            if (
                current is None
                or replica_id not in current.member_ids
                or replica_id in self._failed_reported
            ):
                continue
            # Forget its heartbeat so the next quorum (evaluated by the tick
            # that called this) forms without it; a group whose other ranks
            # live will heartbeat again, and simply not complete the next
            # quorum request.
            self.state.heartbeats.pop(replica_id, None)
            self._report_failed(
                current,
                replica_id,
                f"its connection to the lighthouse closed {now - since:.1f} s ago",
            )

    def _report_failed(self, current: FormedQuorum, replica_id: str, reason: str) -> None:
        self._failed_reported.add(replica_id)
        self.num_member_failures += 1
        self.history.member_failed(self._wall_clock(), replica_id, reason)
        logger.warning(
            "Member %s of quorum %d failed: %s", replica_id, current.quorum.quorum_id, reason
        )
        self._publish(ftdist_pb2.MEMBER_FAILED, replica_id=replica_id, reason=reason)

    def _report_dead_members(self, now: float) -> None:
        current = self.current
        if current is None:
            return
        timeout = self.settings.heartbeat_timeout_s
        heartbeats = self.state.heartbeats
        for replica_id in current.member_ids:
            if replica_id in self._failed_reported or replica_id in self._left:
                continue
            seen = heartbeats.get(replica_id)
            age = math.inf if seen is None else now - seen
            if age >= timeout:
                self._report_failed(
                    current,
                    replica_id,
                    f"no heartbeat for {age:.1f} s (heartbeat timeout {timeout:g} s)",
                )

    # -- failure news -----------------------------------------------------

    def _publish(
        self,
        kind: ftdist_pb2.EventKind,
        replica_id: str = "",
        reason: str = "",
        replica_ids: tuple[str, ...] = (),
    ) -> None:
        if not self._news:
            return  # no listener: nothing to build
        self._news.publish(
            ftdist_pb2.LighthouseEvent(
                kind=kind,
                quorum_id=self.state.quorum_id,
                replica_id=replica_id,
                reason=reason,
                replica_ids=replica_ids,
            )
        )

    def subscribe(self, subscriber: Subscriber) -> None:
        """Start sending events to ``subscriber``, beginning with SUBSCRIBED
        (which carries the current quorum's members).

        After :meth:`close` the subscriber is closed at once.
        """
        if self.closed:
            subscriber.close()
            return
        members = self.current.member_ids if self.current is not None else ()
        self._news.add(
            subscriber,
            ftdist_pb2.LighthouseEvent(
                kind=ftdist_pb2.SUBSCRIBED, quorum_id=self.state.quorum_id, replica_ids=members
            ),
        )

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """Stop sending events to ``subscriber``."""
        self._news.discard(subscriber)

    @property
    def num_subscribers(self) -> int:
        """How many event streams are open."""
        return len(self._news)

    def close(self) -> None:
        """Answer every parked request with None and close every stream.

        Idempotent; later requests are answered with None at once.
        """
        if self.closed:
            return
        self.closed = True
        waiters, self._waiters = self._waiters, {}
        self.state.participants.clear()
        for parked in waiters.values():
            for waiter in parked:
                waiter.deliver(None)
        self._news.close()
