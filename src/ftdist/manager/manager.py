"""
Manager
=======

The Manager runs the fault-tolerant step protocol of one rank of one replica
group. Each step:

1. :meth:`Manager.start_quorum` (called by ``OptimizerWrapper.zero_grad``)
   asks the replica group's ManagerServer, and through it the lighthouse,
   which replica groups take this step. In the background it rebuilds the
   process group when the membership changed, and heals this replica from an
   up-to-date peer when it is behind (or serves its state to those that are).
2. :meth:`Manager.allreduce` averages gradients over the participants. It
   never raises into the training loop: a failure is recorded and
   :meth:`Manager.errored` reports it.
3. :meth:`Manager.should_commit` (called by ``OptimizerWrapper.step``) applies
   a received state, then votes with the other ranks of the replica group;
   the optimizer steps only if every rank voted yes. The step counter moves
   only on a commit, so no committed step is ever lost or applied twice.

A replica that died is dropped from the quorum at the next step; the
lighthouse also pushes the news of its death, and the Manager aborts any
collective still waiting on it instead of waiting out the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from enum import IntEnum
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ftdist.checkpointing import CheckpointTransport, HTTPTransport
from ftdist.errors import FtdistError, ProcessGroupAbortedError, StateDivergenceError
from ftdist.manager.client import ManagerClient, ManagerClientLike
from ftdist.manager.config import ManagerConfig
from ftdist.manager.heal import Healer, HealTimeline, differing_parts, fingerprint
from ftdist.manager.membership import GroupMembership
from ftdist.manager.news import FailureNews
from ftdist.manager.rule import QuorumResult, participation
from ftdist.manager.state import UserState
from ftdist.manager.work import ManagedWork
from ftdist.process_group import ProcessGroup
from ftdist.process_group.work import CompletedWork

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WorldSizeMode(IntEnum):
    """How many replica groups take part in a step.

    ``DYNAMIC``: every replica group in the quorum. ``FIXED_WITH_SPARES``: at
    most ``min_replica_size``; the others are hot spares that contribute
    zeros and take over when a participant dies.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


class ExceptionWithTraceback(FtdistError):
    """A recorded error together with where it was raised."""

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        self.stack_trace = "".join(traceback.format_exception(e))
        super().__init__(f"{e}\n{self.stack_trace}")


class Manager:
    """Fault-tolerant step protocol for one rank of one replica group.

    Args:
        pg: the ftdist process group spanning the replica groups (this rank's
            "column": the same group rank of every replica group).
        load_state_dict: loads the user state received when healing.
        state_dict: returns the user state to send when a peer heals.
        min_replica_size: fewest replica groups with which a step may commit.
        use_async_quorum: run the quorum (and healing) in the background,
            overlapping the forward pass.
        timeout: collectives and checkpoint transfers.
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

    Raises:
        TypeError: ``pg`` is not an ftdist ProcessGroup, or an argument has
            the wrong type.
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
    ) -> None:
        if not isinstance(pg, ProcessGroup):
            raise TypeError(
                f"pg must be an ftdist ProcessGroup (it is reconfigured each quorum), "
                f"got {type(pg).__name__}"
            )
        if (
            isinstance(min_replica_size, bool)
            or not isinstance(min_replica_size, int)
            or min_replica_size < 1
        ):
            raise ValueError(f"min_replica_size must be an int >= 1, got {min_replica_size!r}")
        if max_retries is not None and (not isinstance(max_retries, int) or max_retries < 0):
            raise ValueError(f"max_retries must be None or an int >= 0, got {max_retries!r}")
        config = ManagerConfig.resolve(
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            quorum_retries=quorum_retries,
            lighthouse_addr=lighthouse_addr,
            port=port,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            hostname=hostname,
            heartbeat_interval=heartbeat_interval,
        )
        if client is None and config.group_rank == 0 and not config.lighthouse_addr:
            raise ValueError(
                "no lighthouse address: pass lighthouse_addr= or set "
                "FTDIST_LIGHTHOUSE (or TORCHFT_LIGHTHOUSE)"
            )
        self._config = config
        self._pg = pg
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._world_size_mode = WorldSizeMode(world_size_mode)
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._group_rank = config.group_rank

        self._user_state = UserState()
        if load_state_dict is not None and state_dict is not None:
            self._user_state.register("default", load_state_dict, state_dict)
        elif (load_state_dict is None) != (state_dict is None):
            raise ValueError(
                "pass both load_state_dict and state_dict, or neither (and use "
                "register_state_dict_fn)"
            )

        self._transport: CheckpointTransport[Any] = checkpoint_transport or HTTPTransport(
            config.timeout, num_chunks=0, hostname=config.hostname
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftdist-quorum")
        self._lock = threading.Lock()

        # Step state (see the class docstring of each accessor).
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._errored: ExceptionWithTraceback | None = None
        self._healing = False
        self._pending_state: dict[str, Any] | None = None
        self._quorum_future: Future[None] | None = None
        self._participating_rank: int | None = None
        self._participating_world_size = 0
        self._membership = GroupMembership(pg, config.group_rank)
        self._fingerprint_due = False
        self._timeline: HealTimeline | None = None
        self.heal_timelines: list[HealTimeline] = []
        self._pending_works: list[ManagedWork] = []

        self._server = None
        self._own_store: Any = None
        if client is not None:
            # The test seam: no store, server or lighthouse; the client
            # answers for heal sources too.
            self._client: ManagerClientLike = client
            self._replica_id = replica_id or "replica"
            self._news = FailureNews(
                None, self._replica_id, self._on_member_failed, config.connect_timeout
            )

            def connect(address: str) -> ManagerClientLike:
                return client
        else:
            from ftdist.manager.bootstrap import bootstrap

            boot = bootstrap(config, replica_id)
            self._own_store = boot.own_store
            self._server = boot.server
            self._client = boot.client
            self._replica_id = boot.replica_id
            self._news = boot.start_news(self._on_member_failed)

            def connect(address: str) -> ManagerClientLike:
                return ManagerClient(address, config.connect_timeout)

        self._healer = Healer(self._transport, config.timeout, connect)
        logger.info(
            "%s manager ready (group rank %d of %d)",
            self._prefix(),
            self._group_rank,
            config.group_world_size,
        )

    # -- state registration ----------------------------------------------------
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Register user state under ``key`` (e.g. one for the model, one for the optimizer).

        Raises:
            TypeError: either function is not callable.
            ValueError: ``key`` is already registered.
        """
        self._user_state.register(key, load_state_dict, state_dict)

    def _manager_state_dict(self) -> dict[str, Any]:
        return {"user": self._user_state.save(), "torchft": self.state_dict()}

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
        """Record an error: this step will not commit. Cleared by the next quorum."""
        with self._lock:
            if self._errored is None:
                self._errored = ExceptionWithTraceback(e)
        logger.warning("%s error recorded: %s", self._prefix(), e)

    def errored(self) -> ExceptionWithTraceback | None:
        """The first error recorded in this step, if any."""
        return self._errored

    def _on_member_failed(self, replica_id: str, reason: str) -> None:
        """Failure news from the lighthouse: abort collectives that wait on the dead member."""
        if self._membership.member_failed(replica_id, self._replica_id):
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

        Args:
            allow_heal: heal (or serve peers) if needed; with False this
                replica only joins the up-to-date set.
            shrink_only: ask that no new replica group join this quorum.
            timeout: overrides the quorum timeout for this round.

        Raises:
            Exception: the previous quorum's misuse error, or (synchronous
                mode) this quorum's failure.
        """
        if self._quorum_future is not None:
            self._quorum_future.result()
        self._pending_works = []
        self._errored = None
        self._healing = False
        self._quorum_future = self._executor.submit(
            self._async_quorum, allow_heal, shrink_only, timeout or self._config.quorum_timeout
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            if self._healing:
                self._apply_pending_state()

    def wait_quorum(self) -> None:
        """Block until the quorum started by :meth:`start_quorum` is done.

        Raises:
            RuntimeError: :meth:`start_quorum` was never called.
            ValueError: healing is needed but no state_dict function is registered.
            TimeoutError: the quorum did not form in time.
        """
        if self._quorum_future is None:
            raise RuntimeError(
                "wait_quorum() called before start_quorum(): call "
                "start_quorum() (or OptimizerWrapper.zero_grad()) first"
            )
        self._quorum_future.result()

    def _async_quorum(self, allow_heal: bool, shrink_only: bool, timeout: timedelta) -> None:
        start = time.perf_counter()
        data = None
        if self._fingerprint_due and self._user_state:
            data = self._user_state.fingerprint()
            self._fingerprint_due = False
        quorum = self._client.quorum(
            group_rank=self._group_rank,
            step=self._step,
            checkpoint_metadata=self._transport.metadata(),
            shrink_only=shrink_only,
            init_sync=self._init_sync,
            commit_failures=self._commit_failures,
            timeout=timeout,
            fingerprint=data,
        )
        quorum_s = time.perf_counter() - start
        if quorum.divergence:
            self.report_error(StateDivergenceError(quorum.divergence))
            # Keep comparing until the replicas agree again.
            self._fingerprint_due = True
        self._participating_rank, self._participating_world_size = participation(
            quorum,
            async_quorum=self._use_async_quorum,
            allow_heal=allow_heal,
            fixed_with_spares=self._world_size_mode == WorldSizeMode.FIXED_WITH_SPARES,
            min_replica_size=self._min_replica_size,
        )
        try:
            reconfigure_s = self._membership.follow(quorum)
        except Exception as exc:
            self.report_error(exc)
            return
        if reconfigure_s is not None:
            logger.info(
                "%s reconfigured for quorum %d: %d replica groups %s",
                self._prefix(),
                quorum.quorum_id,
                quorum.replica_world_size,
                quorum.replica_ids,
            )
            # Replicas that just (re)joined must agree on their state: compare
            # fingerprints at the next quorum.
            self._fingerprint_due = True
        reconfigure_s = reconfigure_s or 0.0
        if not allow_heal:
            return
        needs_state = quorum.heal or bool(quorum.recover_dst_replica_ranks)
        if needs_state and not self._user_state:
            raise ValueError(
                "healing is needed but no state_dict function is registered: pass "
                "load_state_dict/state_dict to Manager or call "
                "register_state_dict_fn()"
            )
        try:
            if quorum.recover_dst_replica_ranks:
                self.heal_timelines.append(
                    self._healer.serve(quorum, self._manager_state_dict(), quorum_s, reconfigure_s)
                )
            if quorum.heal:
                self._receive_state(quorum, quorum_s, reconfigure_s)
        except Exception as exc:
            self.report_error(exc)

    def _receive_state(self, quorum: QuorumResult, quorum_s: float, reconfigure_s: float) -> None:
        self._healing = True
        state, timeline = self._healer.receive(quorum, self._group_rank, quorum_s, reconfigure_s)
        self._pending_state = state
        self.load_state_dict(state["torchft"])
        self._step = quorum.max_step
        self._timeline = timeline

    def _apply_pending_state(self) -> None:
        """Load a received state into the user's objects, from the training thread."""
        self.wait_quorum()
        pending, self._pending_state = self._pending_state, None
        if pending is None:
            assert self._errored is not None, "healing without state or error"
            return
        start = time.perf_counter()
        received = fingerprint({"user": pending["user"]})
        self._user_state.load(pending["user"])
        # Whatever was received must now be what state_dict() returns: a
        # load function that skips something (a scheduler, a learning rate)
        # would otherwise leave this replica silently different.
        loaded = self._user_state.fingerprint()
        differ = differing_parts(received, loaded)
        if differ:
            self.report_error(
                StateDivergenceError(
                    f"the state loaded while healing does not match the state received: {differ} "
                    "differ; make load_state_dict restore everything state_dict returns"
                )
            )
        timeline = self._timeline
        if timeline is not None:
            timeline.load_s = time.perf_counter() - start
            self.heal_timelines.append(timeline)
            logger.info("%s %s", self._prefix(), timeline.summary())
            self._timeline = None
        self._healing = False

    # -- the step ---------------------------------------------------------------------------
    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
    ) -> dist.Work:
        """Fault-tolerant allreduce of ``tensor`` over the participating replicas.

        ``AVG`` divides by the number of participants. A replica that is
        healing (or a spare) contributes zeros. Errors are recorded, never
        raised: the returned work's ``wait()`` returns False and its future
        resolves to the tensor as it is.

        Raises:
            ValueError: ``AVG`` of a non-floating-point tensor.
        """
        if self._errored is not None:
            return CompletedWork(tensor)
        self.wait_quorum()
        participants = self.num_participants()
        if not self.is_participating():
            tensor.zero_()
        op = reduce_op
        divisor = None
        if reduce_op == dist.ReduceOp.AVG:
            if not tensor.is_floating_point():
                raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
            op, divisor = dist.ReduceOp.SUM, participants
        try:
            work = self._pg.allreduce([tensor], op)
        except Exception as exc:
            self.report_error(exc)
            return CompletedWork(tensor)
        managed = ManagedWork(self, work, tensor, divisor, self._config.timeout)
        self._pending_works.append(managed)
        return managed

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Vote on this step with the other ranks of the replica group.

        Applies a received state first. Returns True if every rank can
        commit: enough replicas participated and no error was recorded.

        Raises:
            RuntimeError: more than ``max_retries`` consecutive steps failed.
        """
        # Every collective of the step must be done (and its errors recorded)
        # before the vote, even if the caller never waited on it.
        pending, self._pending_works = self._pending_works, []
        for work in pending:
            work.wait()
        pg_error = self._pg.errored()
        # An abort on failure news is not an error of this step by itself:
        # collectives it cut short reported their own errors.
        if pg_error is not None and not (
            self._membership.broken and isinstance(pg_error, ProcessGroupAbortedError)
        ):
            self.report_error(pg_error)
        if self._healing:
            self._apply_pending_state()
        else:
            self.wait_quorum()
        enough = self.num_participants() >= self._min_replica_size
        local = enough and self._errored is None
        if self._config.group_world_size == 1:
            # A vote of one: no round trip to the server.
            decision = local
        else:
            decision = self._client.should_commit(
                self._group_rank, self._step, local, timeout or self._config.timeout
            )
        self._transport.disallow_checkpoint()
        logger.debug("%s commit vote %s -> %s", self._prefix(), local, decision)
        if decision:
            self._step += 1
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                raise RuntimeError(
                    f"should_commit failed {self._commit_failures} times in a row, "
                    f"more than max_retries={self._max_retries}; last error: "
                    f"{self._errored}"
                )
        return decision

    # -- accessors ---------------------------------------------------------------------------
    def current_step(self) -> int:
        """The number of committed steps (a heal jumps it to the source's)."""
        return self._step

    def batches_committed(self) -> int:
        """Sum of participants over committed steps."""
        return self._batches_committed

    def participating_rank(self) -> int | None:
        """This replica's rank among the participants, or None (healing, spare, no quorum)."""
        if self._quorum_future is None:
            return None
        self.wait_quorum()
        return self._participating_rank

    def num_participants(self) -> int:
        """How many replica groups take part in this step (0 before the first quorum)."""
        if self._quorum_future is None:
            return 0
        self.wait_quorum()
        return self._participating_world_size

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

    def _prefix(self) -> str:
        return f"[{getattr(self, '_replica_id', '?')}/{self._group_rank} - step {self._step}]"

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server (group rank 0), the transport and background threads.

        The process group is the caller's and is left alone.
        """
        self._news.close()
        self._transport.shutdown(wait)
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._client.close()
        self._healer.close()
        if self._server is not None:
            self._server.shutdown()
        self._own_store = None


__all__ = ["ExceptionWithTraceback", "Manager", "WorldSizeMode"]
