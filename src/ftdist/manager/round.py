"""
One step's quorum round
=======================

What the Manager does on its quorum thread at the start of each step: ask
the replica group's ManagerServer for the quorum, work out this replica's
part in the step, rebuild the process group when the membership changed,
serve this rank's state to peers that are behind, and fetch a peer's state
when this replica is behind.

The round only *produces* a :class:`RoundOutcome`; it changes nothing the
training thread reads. The Manager applies the outcome on the training
thread, so a received state and its step can never be seen apart.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ftdist.checkpointing._prefault import ReceiveReserve
from ftdist.manager.client import ManagerClientLike, ManagerQuorumResult
from ftdist.manager.heal import Healer, HealTimeline, Staged
from ftdist.manager.membership import GroupMembership
from ftdist.manager.rule import participation
from ftdist.manager.state import ConsistencyParts, UserState

__all__ = ["Participation", "QuorumRound", "RoundOutcome", "Staged"]

logger = logging.getLogger(__name__)


@dataclass
class RoundOutcome:
    """What one round found out and did.

    Attributes:
        quorum: the quorum, as this group rank sees it.
        participating_rank: this replica's rank among the step's
            participants, or None if it does not take part.
        participating_world_size: how many replica groups take part.
        configured: the process group is configured for this quorum.
        reconfigured: it was rebuilt in this round.
        heal: the quorum told this rank to heal (the transfer may still
            have failed: then ``staged`` is None and ``errors`` says why).
        staged: the received state, not yet applied.
        served: timelines of the states served to peers.
        errors: faults of the round; the step must not commit.
        heal_settled: the training thread applied (or dropped) the heal.
    """

    quorum: ManagerQuorumResult
    participating_rank: int | None = None
    participating_world_size: int = 0
    configured: bool = False
    reconfigured: bool = False
    heal: bool = False
    staged: Staged | None = None
    served: list[HealTimeline] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    heal_settled: bool = False


@dataclass
class Participation:
    """This replica's part in the latest round, as the quorum thread left it.

    Written when a round ends and read by the training thread after it
    waited for the round (torchft's ``_participating_replica_rank``,
    ``_participating_replica_world_size`` and ``_healing`` are these; a test
    may set them between).

    Attributes:
        rank: this replica's rank among the participants, or None.
        world_size: how many replica groups take part.
        healing: this replica heals in this step.
    """

    rank: int | None = None
    world_size: int = 0
    healing: bool = False


class QuorumRound:
    """Runs the quorum round of each step for one rank.

    Args:
        client: the replica group's manager client.
        group_rank: this rank inside its replica group.
        membership: keeps the process group configured for the quorum.
        healer: serves and receives states (its transport's metadata is
            what peers fetch from).
        consistency: the parts fingerprinted for the cross-replica check.
        init_sync: heal every replica from one primary at step 0.
        async_quorum: the round overlaps the step (a healing replica
            contributes zeros instead of taking part).
        fixed_with_spares: at most ``min_replica_size`` replicas take part.
        min_replica_size: see the Manager.
        state_for_peers: the state to serve (user state and counters).
        user_state: the registered user state.
        log_prefix: names this rank in log lines.
        participation: where each round's outcome records this replica's
            part (a new one by default).
    """

    def __init__(
        self,
        *,
        client: ManagerClientLike,
        group_rank: int,
        membership: GroupMembership,
        healer: Healer,
        consistency: ConsistencyParts,
        init_sync: bool,
        async_quorum: bool,
        fixed_with_spares: bool,
        min_replica_size: int,
        state_for_peers: Callable[[], dict[str, Any]],
        user_state: UserState,
        log_prefix: Callable[[], str] = str,
        participation: Participation | None = None,
    ) -> None:
        self._client = client
        self._group_rank = group_rank
        self.participation = participation if participation is not None else Participation()
        self._membership = membership
        self._healer = healer
        self._consistency = consistency
        self.init_sync = init_sync
        self._async = async_quorum
        self._spares = fixed_with_spares
        self._min_replica_size = min_replica_size
        self._state_for_peers = state_for_peers
        self._user_state = user_state
        self._prefix = log_prefix

    def _own_state(self) -> dict[str, Any] | None:
        # Asked on the receiving side only for an in-place heal: if it fails,
        # the heal still goes ahead, into fresh memory.
        try:
            return {"user": self._user_state.save()}
        except Exception as exc:
            logger.info(
                "%s no in-place heal or receive reserve: state_dict() failed: %r",
                self._prefix(),
                exc,
            )
            return None

    def _record(self, outcome: RoundOutcome) -> RoundOutcome:
        part = self.participation
        part.rank = outcome.participating_rank
        part.world_size = outcome.participating_world_size
        part.healing = outcome.heal
        return outcome

    def run(
        self,
        *,
        step: int,
        heal_in_place: bool = False,
        commit_failures: int,
        send_fingerprint: bool,
        allow_heal: bool,
        shrink_only: bool,
        timeout: timedelta,
    ) -> RoundOutcome:
        """One round (on the quorum thread); records this replica's part in it.

        ``heal_in_place``: a heal is received straight into this replica's own
        tensors (it never committed, and the caller awaits the heal before
        anything reads them). Such a round asks the user's state once, before
        the quorum, to size a receive reserve (:meth:`Healer.reserve_like`)
        where one can be had, and keeps it for the heal.

        Raises:
            TimeoutError: no quorum within ``timeout``.
            CoordinationError: the manager server or the lighthouse refused.
            ValueError: healing is needed but no state is registered.
        """
        with self._first_heal(heal_in_place, allow_heal) as (own, reserve):
            start = time.perf_counter()
            fingerprint = None
            if send_fingerprint and self._consistency:
                fingerprint = self._consistency.fingerprint()
            # By keyword, under torchft's name: code that mocks the client
            # scripts ``_quorum`` and reads its keyword arguments.
            extra = {} if fingerprint is None else {"fingerprint": fingerprint}
            quorum = self._client._quorum(
                group_rank=self._group_rank,
                step=step,
                checkpoint_metadata=self._healer.transport.metadata(),
                shrink_only=shrink_only,
                timeout=timeout,
                commit_failures=commit_failures,
                init_sync=self.init_sync,
                **extra,
            )
            quorum_s = time.perf_counter() - start
            out = RoundOutcome(quorum)
            if getattr(quorum, "divergence", ""):
                logger.warning("%s %s", self._prefix(), quorum.divergence)
            out.participating_rank, out.participating_world_size = participation(
                quorum,
                async_quorum=self._async,
                allow_heal=allow_heal,
                fixed_with_spares=self._spares,
                min_replica_size=self._min_replica_size,
            )
            try:
                reconfigure_s = self._membership.follow(quorum)
            except Exception as exc:
                out.errors.append(exc)
                return self._record(out)
            out.configured = True
            out.reconfigured = reconfigure_s is not None
            if out.reconfigured:
                logger.info(
                    "%s reconfigured for quorum %d: %d replica groups %s",
                    self._prefix(),
                    quorum.quorum_id,
                    quorum.replica_world_size,
                    quorum.replica_ids,
                )
            if not allow_heal:
                return self._record(out)
            if (quorum.heal or quorum.recover_dst_replica_ranks) and not self._user_state:
                raise ValueError(
                    "healing is needed but no state_dict function is registered: pass "
                    "load_state_dict/state_dict to Manager or call register_state_dict_fn()"
                )
            out.heal = quorum.heal
            try:
                if quorum.recover_dst_replica_ranks:
                    out.served.append(
                        self._healer.serve(
                            quorum, self._state_for_peers(), quorum_s, reconfigure_s or 0.0
                        )
                    )
                if quorum.heal:
                    # In place only while nothing committed is in the tensors (a
                    # transfer that fails half-way leaves them half overwritten)
                    # and nothing reads them (the heal is awaited before a forward).
                    out.staged = self._healer.receive(
                        quorum,
                        self._group_rank,
                        quorum_s,
                        reconfigure_s or 0.0,
                        into=own,
                        reserve=reserve,
                    )
            except Exception as exc:
                out.errors.append(exc)
            return self._record(out)

    @contextlib.contextmanager
    def _first_heal(
        self, heal_in_place: bool, allow_heal: bool
    ) -> Iterator[tuple[Callable[[], object] | None, ReceiveReserve | None]]:
        """For a replica that never committed: its own state, asked at most
        once, and a receive reserve populated from now on (closed on leaving)."""
        if not heal_in_place:
            yield None, None
            return
        # Asked at most once, for the reserve and the heal both.
        own = functools.cache(self._own_state)

        reserve = None
        if self._user_state and allow_heal:
            # Never committed: a heal is likely, and its optimizer state is
            # fresh memory to fault in. Populate some during the quorum wait,
            # while a core is idle.
            try:
                reserve = self._healer.reserve_like(own)
            except Exception as exc:  # a speed-up only: never a reason to fail the round
                logger.info("%s no receive reserve: %r", self._prefix(), exc)
        try:
            yield own, reserve
        finally:
            if reserve is not None:
                reserve.close()
