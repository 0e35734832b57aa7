"""
Manager
=======

The Manager runs the fault-tolerant step protocol of one rank of one replica
group. Each step:

1. :meth:`Manager.start_quorum` (``OptimizerWrapper.zero_grad``) asks the
   replica group's ManagerServer, and through it the lighthouse, which
   replica groups take this step. In the background it rebuilds the process
   group when the membership changed, serves its state to peers that are
   behind, and fetches a peer's state when it is behind itself.
2. :meth:`Manager.allreduce` averages over the participants. It never
   raises into the training loop: a failure is recorded, the step votes no.
3. :meth:`Manager.should_commit` (``OptimizerWrapper.step``) waits for the
   step's collectives, applies a received state, and votes with the other
   ranks of the replica group; the optimizer steps only if all voted yes.

Guarantees:

* **The step and the state move together.** A received state is applied on
  the training thread, after every rank of the replica group confirmed its
  own transfer: the step counter jumps to the source's step at that moment,
  never before, and a group never ends up with ranks at different steps.
* **A healthy job never stalls.** Only what must be identical (the
  consistency parts: parameters and optimizer state) is compared between
  replicas; a replica that disagrees with the majority heals from it
  instead of failing everyone. A failed quorum fails one step; the next
  step starts a fresh one.
* **Peers are never left waiting.** A replica whose step already failed
  still takes part in the step's collectives (contributing zeros) and
  votes no. Every future the Manager hands out completes within its timeout.
* **Leaving is not failing.** :meth:`shutdown` tells the lighthouse the
  group is leaving, so peers neither wait for it nor report it dead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ftdist._weak import weakly
from ftdist.checkpointing import CheckpointTransport, HTTPTransport
from ftdist.collectives import check_allreduce, start_allreduce
from ftdist.errors import (
    CollectiveTimeoutError,
    ExceptionWithTraceback,
    NotReconfigurableError,
    ProcessGroupAbortedError,
    RecoveryError,
    with_traceback,
)
from ftdist.manager.allreduce_result import AllreduceResult, bounded_future
from ftdist.manager.client import ManagerClientLike
from ftdist.manager.config import ManagerConfig, WorldSizeMode
from ftdist.manager.heal import Healer, HealTimeline, load_received, manager_counters
from ftdist.manager.internals import TorchftInternals
from ftdist.manager.membership import GroupMembership
from ftdist.manager.round import Participation, QuorumRound, RoundOutcome
from ftdist.manager.state import ConsistencyParts, StateRegistration, UserState
from ftdist.process_group import ProcessGroup

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["ExceptionWithTraceback", "Manager", "WorldSizeMode"]


class Manager(TorchftInternals, StateRegistration):
    """Fault-tolerant step protocol for one rank of one replica group.

    Args:
        pg: the ftdist process group spanning the replica groups (the same
            group rank of every replica group).
        load_state_dict: loads the user state received when healing.
        state_dict: returns the user state to send when a peer heals.
        min_replica_size: fewest replica groups with which a step may commit.
        use_async_quorum: run the quorum (and healing) in the background,
            overlapping the forward pass.
        timeout: collectives, votes and checkpoint transfers.
        quorum_timeout: one quorum round.
        connect_timeout: connecting to the ManagerServer and lighthouse.
        rank: this rank in the replica group (default ``RANK``).
        world_size: ranks in the replica group (default ``WORLD_SIZE``).
        world_size_mode: see :class:`WorldSizeMode`.
        store_addr: the replica group's TCPStore host (default ``MASTER_ADDR``).
        store_port: its port (default ``MASTER_PORT``).
        lighthouse_addr: the lighthouse (default ``FTDIST_LIGHTHOUSE``).
        replica_id: this replica group's name; a uuid is appended so that a
            restarted group counts as a new member.
        port: the ManagerServer port (default ``FTDIST_MANAGER_PORT`` or any).
        hostname: the name peers use to reach this host.
        heartbeat_interval: ManagerServer heartbeats to the lighthouse.
        checkpoint_transport: how state moves when healing (default HTTP).
        init_sync: heal every replica from one primary at step 0.
        max_retries: raise after this many consecutive failed commits.
        quorum_retries: lighthouse quorum retries inside the ManagerServer.
        client: for tests: use this client (e.g.
            :class:`ftdist.testing.FakeManagerClient`) instead of starting or
            joining the replica group's ManagerServer; no store, server or
            lighthouse connection is made, and heal sources' checkpoint
            metadata is asked of this client too.
        check_consistency_every: also compare the consistency parts every
            this many steps (default ``FTDIST_CHECK_CONSISTENCY_EVERY``, else
            0: only after each reconfigure and heal), to catch silent
            corruption in a job whose membership does not change.

    Raises:
        TypeError: ``pg`` is not an ftdist ProcessGroup (also a ValueError,
            as torchft raises), or an argument has the wrong type.
        ValueError: ``min_replica_size < 1``, no lighthouse address, or
            another setting out of range (all before any connection).
    """

    def __init__(
        self,
        pg: ProcessGroup,
        load_state_dict: Callable[[T], None] | None,
        state_dict: Callable[[], T] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta | None = None,
        quorum_timeout: timedelta | None = None,
        connect_timeout: timedelta | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta | None = None,
        checkpoint_transport: CheckpointTransport[Any] | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int | None = None,
        *,
        client: ManagerClientLike | None = None,
        check_consistency_every: int | None = None,
    ) -> None:
        if not isinstance(pg, ProcessGroup):
            raise NotReconfigurableError(
                f"pg must be an ftdist ProcessGroup, got {type(pg).__name__}: the Manager "
                "reconfigures it every time the quorum changes, which torch's own groups cannot "
                "do (torchft: enable_reconfigure=True); use ftdist.ProcessGroupGloo or "
                "ProcessGroupNCCL"
            )
        config = ManagerConfig.resolve(
            timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout,
            quorum_retries=quorum_retries, lighthouse_addr=lighthouse_addr, port=port,
            rank=rank, world_size=world_size, store_addr=store_addr, store_port=store_port,
            hostname=hostname, heartbeat_interval=heartbeat_interval,
            min_replica_size=min_replica_size, max_retries=max_retries,
            check_consistency_every=check_consistency_every, needs_lighthouse=client is None,
        )  # fmt: skip
        self._config = config
        self._timeout = config.timeout
        self._pg = pg
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._world_size_mode = WorldSizeMode(world_size_mode)
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._group_rank = config.group_rank
        # This replica's part in the latest round (torchft's _healing, ...).
        self._participation = Participation()

        self._user_state = UserState(config.timeout)
        if load_state_dict is not None and state_dict is not None:
            self._user_state.register("default", load_state_dict, state_dict)
        elif (load_state_dict is None) != (state_dict is None):
            raise ValueError(
                "pass both load_state_dict and state_dict, or neither (and use "
                "register_state_dict_fn)"
            )
        self._consistency = ConsistencyParts()

        transport = checkpoint_transport or HTTPTransport(
            config.timeout, num_chunks=0, hostname=config.hostname
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftdist-quorum")
        self._lock = threading.Lock()

        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._errored: BaseException | None = None
        self._group_failed = False  # a collective of this step failed
        self._quorum_future: Future[RoundOutcome] | None = None
        # This step's round, once the training thread has taken it.
        self._outcome: RoundOutcome | None = None
        # The step's heal is settled (applied or dropped) by should_commit.
        self._settled = True
        self._membership = GroupMembership(pg, config.group_rank, config.timeout)
        self._fingerprint_due = False
        self.heal_timelines: list[HealTimeline] = []
        self._pending_work: list[torch.futures.Future[Any]] = []

        from ftdist.manager.bootstrap import bootstrap

        try:
            boot = bootstrap(
                config, replica_id, weakly(self._on_member_failed, lambda: None), client
            )
        except BaseException:
            transport.shutdown(wait=False)
            self._executor.shutdown(wait=False)
            raise
        self._server = boot.server
        self._client = boot.client
        self._replica_id = boot.replica_id
        self._news = boot.news
        self._own_store = boot.own_store
        report = getattr(boot.server, "report_heal", None)  # group rank 0: to the lighthouse
        self._healer = Healer(transport, config.timeout, boot.connect, report, config.reserve)
        self._round = QuorumRound(
            client=self._client,
            group_rank=config.group_rank,
            membership=self._membership,
            healer=self._healer,
            consistency=self._consistency,
            init_sync=init_sync,
            async_quorum=use_async_quorum,
            fixed_with_spares=self._world_size_mode == WorldSizeMode.FIXED_WITH_SPARES,
            min_replica_size=min_replica_size,
            state_for_peers=weakly(self._manager_state_dict),
            user_state=self._user_state,
            log_prefix=weakly(self._prefix, lambda: "[gone]"),
            participation=self._participation,
        )
        rank, size = self._group_rank, config.group_world_size
        logger.info("%s manager ready (group rank %d of %d)", self._prefix(), rank, size)

    def state_dict(self) -> dict[str, int]:
        """The Manager's own state: ``step`` and ``batches_committed``. Checkpoint it with yours."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            KeyError: ``step`` or ``batches_committed`` is missing.
        """
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    # -- errors ------------------------------------------------------------------------
    def report_error(self, e: Exception) -> None:
        """Record an error: this step will not commit. Cleared by the next quorum.

        The error carries ``original_exception`` and ``stack_trace``
        attributes; the last one reported is kept.
        """
        recorded = with_traceback(e)
        with self._lock:
            self._errored = recorded
        logger.warning("%s error recorded: %s", self._prefix(), e)

    def errored(self) -> BaseException | None:
        """The error recorded in this step (the original exception), if any."""
        return self._errored

    def _collective_failed(self, exc: BaseException) -> None:
        """A collective of this step failed or timed out (from its completion thread)."""
        self._group_failed = True
        self.report_error(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
        if isinstance(exc, TimeoutError) and not isinstance(exc, CollectiveTimeoutError):
            self._membership.abort_stuck()  # our deadline, not the backend's

    def _on_member_failed(self, replica_id: str, reason: str) -> None:
        """Failure news from the lighthouse: abort collectives that wait on the dead member."""
        if self._membership.member_failed(replica_id, getattr(self, "_replica_id", "")):
            logger.warning(
                "%s lighthouse reports replica %s failed (%s): aborted the process group",
                self._prefix(),
                replica_id,
                reason,
            )

    # -- the quorum --------------------------------------------------------------------
    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Start this step's quorum (in the background unless ``use_async_quorum=False``).

        A failed previous quorum does not stop this one: each step starts afresh.
        With ``use_async_quorum=False`` a received state (and its step) is
        applied before this returns, as DiLoCo needs.

        Args:
            allow_heal: heal (or serve peers) if needed; with False this
                replica only joins the up-to-date set.
            shrink_only: ask that no new replica group join this quorum.
            timeout: overrides the quorum timeout for this round.

        Raises:
            ValueError: healing is needed but no state is registered
                (asynchronous mode: raised by the next wait instead).
            TimeoutError: (synchronous mode only) the quorum did not form.
            RuntimeError: (synchronous mode only) the quorum call failed.
        """
        if not self._settled:
            # A step that never reached should_commit: settle its round and heal first.
            self._await_round()
            self._settle_heal(self._timeout)
        self._pending_work = []
        self._errored = None
        self._group_failed = False
        self._outcome = None
        self._settled = False
        self._round.init_sync = self._init_sync
        every = self._config.check_consistency_every
        periodic = every > 0 and self._step > 0 and self._step % every == 0
        send_fingerprint, self._fingerprint_due = self._fingerprint_due or periodic, False
        fresh = self._step == 0 and self._batches_committed == 0
        self._quorum_future = self._executor.submit(
            self._round.run,
            step=self._step,
            heal_in_place=fresh,
            commit_failures=self._commit_failures,
            send_fingerprint=send_fingerprint,
            allow_heal=allow_heal,
            shrink_only=shrink_only,
            timeout=timeout or self._config.quorum_timeout,
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            self._await_round()  # takes the outcome, so that its heal is applied now
            self._settle_heal(self._timeout)
        elif fresh:
            # Never committed: heal before a forward on weights about to go (adds zeros: async).
            try:
                self._await_round()
            except (ValueError, TypeError):  # misuse found by the round: the next wait raises it
                return
            self._settle_heal(self._timeout)

    def wait_quorum(self) -> None:
        """Block until the quorum started by :meth:`start_quorum` is done.

        Raises:
            RuntimeError: :meth:`start_quorum` was never called, or the
                quorum call failed.
            ValueError: healing is needed but no state_dict function is registered.
            TimeoutError: the quorum did not form in time.
        """
        if self._quorum_future is None:
            raise RuntimeError(
                "wait_quorum() called before start_quorum(): call "
                "start_quorum() (or OptimizerWrapper.zero_grad()) first"
            )
        self._quorum_future.result()

    def _await_round(self) -> RoundOutcome | None:
        """Wait for this step's round and take its outcome (once).

        A failed round is this step's error: it is recorded, and the next
        step starts a fresh round.

        Returns:
            The outcome, or None when the round failed (or never started).

        Raises:
            ValueError: misuse found by the round (no state registered).
        """
        if self._quorum_future is None:
            return None
        try:
            outcome = self._quorum_future.result()
        except (ValueError, TypeError):
            raise
        except Exception as exc:
            if self._errored is None:
                self.report_error(exc)
            return None
        if outcome is self._outcome:
            return outcome
        self._outcome = outcome
        for error in outcome.errors:
            self.report_error(error)
        self.heal_timelines.extend(outcome.served)
        if outcome.reconfigured or bool(getattr(outcome.quorum, "divergence", "")):
            # Replicas that just (re)joined, or healed after diverging, must
            # agree on their state: compare fingerprints at the next quorum.
            self._fingerprint_due = True
        return outcome

    def _settle_heal(self, timeout: timedelta) -> None:
        """Apply a received state and move to its step, on the training thread.

        Every rank of a healing replica group votes on whether it received
        its part; all apply, or none does (a group never splits across two
        steps; it heals again at the next quorum).
        """
        outcome = self._await_round()
        if outcome is None or outcome.heal_settled:
            return
        outcome.heal_settled = True
        healing, staged = outcome.heal, outcome.staged
        outcome.heal, outcome.staged = False, None
        self._healing = False
        group_vote = self._config.group_world_size > 1 and getattr(
            outcome.quorum, "group_heals", False
        )
        # Only transfers count: another error fails the step, not the heal (state, step move).
        if group_vote and not self._vote(staged is not None or not healing, timeout):
            why = RecoveryError(
                "a rank of the replica group did not receive its part of the heal; "
                "no rank applies it, and the group heals again at the next quorum"
            )
            self._healer.tell(staged.timeline if staged else None, "failed", str(why))
            if self._errored is None:  # keep this rank's own cause, if any
                self.report_error(why)
            return
        if staged is None:
            return
        error = load_received(staged, self._user_state, self._consistency)
        self.load_state_dict(manager_counters(staged.state))
        self._step = staged.step
        self._healer.tell(staged.timeline, "done" if error is None else "failed", str(error or ""))
        if error is not None:
            self.report_error(error)
        self._fingerprint_due = True
        self.heal_timelines.append(staged.timeline)
        logger.info("%s %s", self._prefix(), staged.timeline.summary())

    # -- the step ---------------------------------------------------------------------------
    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool | str = False,
        reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
    ) -> AllreduceResult:
        """Fault-tolerant allreduce of ``tensor``, in place, over the participants.

        ``AVG`` divides by the number of participants. A replica that is
        healing (or a spare) contributes zeros. So does a replica whose step
        already failed: it still takes part, so that its peers are not left
        waiting, and votes no; but once a collective of the step failed the
        group is broken, and later ones return at once with ``tensor`` as it
        is (as in torchft). Errors are recorded, never raised.
        ``should_quantize`` (True or ``"int8"``, or ``"bf16"``) sends the
        tensor quantized: see :mod:`ftdist.collectives` for the error bound.

        Returns:
            An :class:`~ftdist.manager.allreduce_result.AllreduceResult`: a future of the
            tensor that is also a ``Work`` (``wait()``, ``get_future()``).

        Raises:
            ValueError: ``AVG`` of a tensor that is not floating point, or a
                ``should_quantize`` that names no format.
        """
        mode = check_allreduce(tensor, reduce_op, should_quantize)
        outcome = self._await_round()
        if outcome is None or not outcome.configured or self._group_failed:
            return AllreduceResult(self, None, tensor, None, self._timeout)
        if self._errored is not None or not self.is_participating():
            tensor.zero_()
        op, divisor = reduce_op, None
        if reduce_op == dist.ReduceOp.AVG:
            op, divisor = dist.ReduceOp.SUM, self._participating_replica_world_size
        try:
            work = start_allreduce(self._pg, tensor, op, mode)
        except Exception as exc:
            self._collective_failed(exc)
            return AllreduceResult(self, None, tensor, None, self._timeout)
        result = AllreduceResult(self, work, tensor, divisor, self._timeout)
        self._pending_work.append(result)
        return result

    def wrap_future(
        self, fut: torch.futures.Future[T], default: T, timeout: timedelta | None = None
    ) -> torch.futures.Future[T]:
        """``fut``, bounded by ``timeout`` and made fault tolerant.

        The returned future resolves to ``fut``'s value, or, if ``fut``
        fails or does not complete within ``timeout`` (default: the Manager's
        timeout), the error is recorded (the step votes no) and it resolves
        to ``default``. :meth:`should_commit` waits for it.
        """
        wrapped = bounded_future(fut, default, timeout or self._timeout, self._collective_failed)
        self._pending_work.append(wrapped)
        return wrapped

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Vote on this step with the other ranks of the replica group.

        Waits for the step's collectives, applies a received state (once
        every rank of the group confirms it received its part), then votes.
        True if every rank can commit: enough replicas participated and no
        error was recorded.

        Raises:
            RuntimeError: more than ``max_retries`` consecutive steps failed.
            ValueError: healing was needed but no state is registered.
        """
        timeout = timeout or self._timeout
        # Every collective of the step must be done (and its errors
        # recorded) before the vote, even if the caller never waited on it.
        pending, self._pending_work = self._pending_work, []
        for work in pending:
            work.wait()
        self._await_round()
        pg_error = self._pg.errored()
        # An abort on failure news is not an error by itself: collectives it
        # cut short reported their own errors.
        if isinstance(pg_error, Exception) and not (
            self._membership.broken and isinstance(pg_error, ProcessGroupAbortedError)
        ):
            self.report_error(pg_error)
        self._settle_heal(timeout)
        self._settled = True
        enough = self.num_participants() >= self._min_replica_size
        local = enough and self._errored is None
        decision = self._vote(local, timeout)
        self._checkpoint_transport.disallow_checkpoint()
        logger.debug("%s commit vote %s -> %s", self._prefix(), local, decision)
        if decision:
            self._step += 1
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                last = self._errored
                raise RuntimeError(
                    f"should_commit failed {self._commit_failures} times consecutively, "
                    f"exceeding max_retries={self._max_retries}; last error: "
                    f"{type(last).__name__ if last else 'none'}: {last}"
                )
        return decision

    def _vote(self, local: bool, timeout: timedelta) -> bool:
        if self._config.group_world_size == 1:
            return local  # a vote of one: no round trip to the server
        try:
            return bool(
                self._client.should_commit(self._group_rank, self._step, local, timeout=timeout)
            )
        except Exception as exc:
            self.report_error(exc)
            return False

    # -- accessors ---------------------------------------------------------------------------
    def current_step(self) -> int:
        """The number of committed steps (a heal jumps it to the source's)."""
        return self._step

    def batches_committed(self) -> int:
        """Sum of participants over committed steps."""
        return self._batches_committed

    def participating_rank(self) -> int | None:
        """This replica's rank among the participants, or None (healing, spare, no quorum)."""
        outcome = self._await_round()
        return None if outcome is None else self._participating_replica_rank

    def num_participants(self) -> int:
        """How many replica groups take part in this step (0 before the first quorum)."""
        outcome = self._await_round()
        return 0 if outcome is None else self._participating_replica_world_size

    def is_participating(self) -> bool:
        """False while healing or as a spare: this replica contributes zeros."""
        if self.participating_rank() is None:
            return False
        return not (self._healing and self._use_async_quorum)

    def replica_id(self) -> str:
        """This replica group's full id (with its uuid)."""
        return self._replica_id

    def quorum_id(self) -> int:
        """The id of the quorum the process group is configured for (-1 before any)."""
        return self._membership.quorum_id

    def shutdown(self, wait: bool = True) -> None:
        """Leave the job: stop the server (group rank 0), the transport and threads.

        The lighthouse is told that the replica group is leaving, so peers
        do not wait for it or report it dead. The process group is the
        caller's and is left alone.
        """
        self._news.close(leaving=True)
        self._checkpoint_transport.shutdown(wait)
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._client.close()
        self._healer.close()
        if self._server is not None:
            self._server.shutdown(leaving=True)
        self._own_store = None
