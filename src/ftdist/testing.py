"""
Test doubles
============

Fakes for testing code that drives a :class:`~ftdist.manager.Manager`
without servers, sockets or peers:

* :class:`FakeManagerClient` answers the Manager's quorum and commit calls
  from a script, and records what the Manager asked. Pass it as
  ``Manager(..., client=FakeManagerClient())``.
* :class:`FakeProcessGroup` stands for a group of identical peers: an
  allreduce SUM multiplies by the group's size, as if every peer had
  contributed the same tensor; failures are injected per call.
* :func:`quorum_result` builds the answer of a quorum call.

Everything here is deterministic and single-process. To run real processes,
use :mod:`ftdist.launch.ranks`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftdist.errors import ProcessGroupAbortedError
from ftdist.manager.client import ManagerQuorumResult
from ftdist.process_group.base import Post, ProcessGroup
from ftdist.process_group.work import CompletedWork

__all__ = ["FakeManagerClient", "FakeProcessGroup", "QuorumCall", "quorum_result"]


def quorum_result(**fields: Any) -> ManagerQuorumResult:
    """A quorum answer: a lone, up-to-date replica group unless ``fields`` say otherwise.

    Args:
        **fields: any :class:`~ftdist.manager.client.ManagerQuorumResult`
            field (``quorum_id``, ``max_step``, ``heal``,
            ``recover_src_replica_rank``, ...).

    Raises:
        TypeError: a field name is unknown.
    """
    defaults: dict[str, Any] = {
        "quorum_id": 1,
        "replica_rank": 0,
        "replica_world_size": 1,
        "max_replica_rank": 0,
        "max_world_size": 1,
        "store_address": "fake-store:1",
        "replica_ids": ["replica"],
    }
    defaults.update(fields)
    return ManagerQuorumResult(**defaults)


@dataclass(frozen=True)
class QuorumCall:
    """One quorum call the Manager made (what it reported)."""

    group_rank: int
    step: int
    shrink_only: bool
    init_sync: bool
    commit_failures: int
    fingerprint: dict[str, int] | None


class FakeManagerClient:
    """Answers a Manager's calls from a script instead of a ManagerServer.

    Quorum calls pop the next scripted answer (:meth:`push_quorum`); with none
    scripted, the answer is a quorum of this replica group alone, at the step
    the Manager reported, with the same ``quorum_id`` as the last answer (so
    no reconfigure). Commit votes return the Manager's own vote unless an
    answer was scripted with :meth:`push_vote` (another rank voting no, say).

    Attributes:
        quorum_calls: every quorum call, in order.
        votes: every vote, as ``(group_rank, step, vote)``.
        metadata: what :meth:`checkpoint_metadata` answers.
    """

    def __init__(self, metadata: str = "fake://checkpoint") -> None:
        self.quorum_calls: list[QuorumCall] = []
        self.votes: list[tuple[int, int, bool]] = []
        self.metadata = metadata
        self.closed = False
        self._quorums: deque[ManagerQuorumResult | BaseException] = deque()
        self._decisions: deque[bool] = deque()
        self._quorum_id = 1
        self._lock = threading.Lock()

    def push_quorum(self, answer: ManagerQuorumResult | BaseException) -> None:
        """Answer the next quorum call with ``answer`` (an exception is raised)."""
        with self._lock:
            self._quorums.append(answer)

    def push_vote(self, decision: bool) -> None:
        """Answer the next commit vote with ``decision``, whatever the Manager voted."""
        with self._lock:
            self._decisions.append(decision)

    def quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool,
        commit_failures: int,
        timeout: timedelta,
        fingerprint: dict[str, int] | None = None,
    ) -> ManagerQuorumResult:
        """Record the call; return the next scripted answer, or a lone quorum.

        Raises:
            BaseException: the scripted exception, if one is next.
        """
        with self._lock:
            self.quorum_calls.append(
                QuorumCall(group_rank, step, shrink_only, init_sync, commit_failures, fingerprint)
            )
            answer = self._quorums.popleft() if self._quorums else None
        if isinstance(answer, BaseException):
            raise answer
        if answer is None:
            answer = quorum_result(quorum_id=self._quorum_id, max_step=step)
        self._quorum_id = answer.quorum_id
        return answer

    def _quorum(
        self,
        *,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        commit_failures: int = 0,
        init_sync: bool = True,
        fingerprint: dict[str, int] | None = None,
        reconfigure_handle: str = "",
    ) -> ManagerQuorumResult:
        """:meth:`quorum` by torchft's name and keywords (what the Manager calls).

        Raises:
            BaseException: the scripted exception, if one is next.
        """
        return self.quorum(
            group_rank, step, checkpoint_metadata, shrink_only, init_sync, commit_failures,
            timeout, fingerprint,
        )  # fmt: skip

    def checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """The :attr:`metadata` string."""
        return self.metadata

    _checkpoint_metadata = checkpoint_metadata

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Record the vote; return the scripted decision or the vote itself."""
        with self._lock:
            self.votes.append((group_rank, step, should_commit))
            return self._decisions.popleft() if self._decisions else should_commit

    def close(self) -> None:
        """Mark the client closed."""
        self.closed = True


class FakeProcessGroup(ProcessGroup):
    """A group of ``world_size`` identical peers, simulated in this process.

    Every collective completes at once. An allreduce with ``SUM`` multiplies
    the tensors by the world size (each peer contributed the same values);
    ``all_gather_single`` fills every peer's slot with this rank's input;
    other collectives leave their tensors as they are.

    Attributes:
        configures: every ``(store_addr, rank, world_size)`` configured.
        ops: the name of every collective run.
        aborts: how many times :meth:`abort` was called.
    """

    def __init__(self) -> None:
        super().__init__()
        self.configures: list[tuple[str, int, int]] = []
        self.ops: list[str] = []
        self.aborts = 0
        self._failures: deque[BaseException] = deque()
        self._error: Exception | None = None

    def fail_next(self, error: BaseException) -> None:
        """Make the next collective's work fail with ``error`` when waited on."""
        self._failures.append(error)

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Record the topology; clears an abort.

        Raises:
            ValueError: invalid ``rank``/``world_size`` or store address.
        """
        self._check_configure_args(store_addr, rank, world_size)
        self.configures.append((store_addr, rank, world_size))
        self._set_topology(rank, world_size)
        self._error = None

    def abort(self) -> None:
        """Count the abort; collectives fail until the next configure."""
        self.aborts += 1
        self._error = ProcessGroupAbortedError("FakeProcessGroup was aborted")

    def errored(self) -> Exception | None:
        """The abort error, until the next configure."""
        return self._error

    def getBackendName(self) -> str:
        """``"ftdist-fake"``."""
        return "ftdist-fake"

    def _collective(self, op: str, args: tuple[Any, ...], post: Post = None) -> dist.Work:
        self.ops.append(op)
        failure = self._failures.popleft() if self._failures else self._error
        if failure is not None:
            return _FailedWork(failure)
        if op == "allreduce":
            tensors, opts = args
            if opts.reduceOp == dist.ReduceOp.SUM:
                for t in tensors:
                    t.mul_(self.size())
        elif op == "all_gather_single":
            output, inp = args[0], args[1]
            output.view(self.size(), -1).copy_(inp.reshape(1, -1).expand(self.size(), -1))
        if post is not None:
            post()
        return CompletedWork(args[0] if args else None)

    def _collective_many(
        self, op: str, calls: list[tuple[Any, ...]], post: Post = None
    ) -> dist.Work:
        for args in calls:
            self._collective(op, args)
        if post is not None:
            post()
        return CompletedWork([c[0] for c in calls])


class _FailedWork(dist._Work):
    """Work that failed with ``error``: ``wait`` raises, the future is failed."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self._error

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_exception(self._error)
        return fut
