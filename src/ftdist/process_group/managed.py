"""A group whose allreduce goes through a fault-tolerance Manager."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from ftdist.process_group.base import Post, ProcessGroup, _as_list, _reduce_op
from ftdist.process_group.work import CompletedWork, FutureWork
from ftdist.process_group.wrapper import ProcessGroupWrapper


class _ManagerLike(Protocol):
    _pg: Any

    def allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any: ...

    def wait_quorum(self) -> None: ...

    def errored(self) -> BaseException | None: ...

    def report_error(self, e: Exception) -> None: ...

    def wrap_future(self, fut: Any, default: Any, timeout: Any = None) -> Any: ...

    def num_participants(self) -> int: ...

    def participating_rank(self) -> int | None: ...


class ReportingWork(dist._Work):
    """A work whose errors go to the manager (torchft 2025's ``process_group._ManagedWork``).

    Its ``wait()`` always returns True, unlike the Manager's own lazy work
    (:class:`~ftdist.manager.lazy_work.LazyWork`, today's torchft's
    ``manager._ManagedWork``), whose ``wait()`` returns False on an error.

    ``wait()`` reports a failure with ``manager.report_error`` and returns
    True; ``get_future()`` is ``manager.wrap_future(work.get_future(),
    default_result)``: bounded by the manager's timeout, resolving to
    ``default_result`` on error.

    Args:
        manager: records errors and bounds futures.
        work: the underlying work.
        default_result: the future's value if the work fails.
    """

    def __init__(self, manager: Any, work: Any, default_result: Any) -> None:
        super().__init__()
        self._manager = manager
        self._work = work
        self._default_result = default_result

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the work; a failure is reported, not raised. Returns True."""
        try:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        except Exception as exc:
            self._manager.report_error(exc)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """The work's future, fault tolerant (see the class docstring)."""
        fut: torch.futures.Future[Any] = self._manager.wrap_future(
            self._work.get_future(), self._default_result
        )
        return fut


class ManagedProcessGroup(ProcessGroupWrapper):
    """The Manager's group, seen by model code as an ordinary group.

    ``allreduce`` goes to ``manager.allreduce(tensor)``: fault tolerant (errors
    are reported to the manager, not raised) and averaged over the
    participating replicas. :meth:`size` is the number of participants, which
    changes as replicas come and go. Every other collective goes straight to
    the manager's group.

    Args:
        manager: a :class:`ftdist.manager.Manager` (or anything with ``_pg``,
            ``allreduce(tensor, reduce_op=...)``, ``wait_quorum()``,
            ``errored()``, ``report_error()``, ``wrap_future()``,
            ``num_participants()`` and ``participating_rank()``).

    Raises:
        TypeError: the manager's group is not a torch ProcessGroup.
    """

    def __init__(self, manager: _ManagerLike) -> None:
        super().__init__(pg=manager._pg)
        self._manager = manager

    def size(self) -> int:
        """The number of replicas participating in the current quorum."""
        return int(self._manager.num_participants())

    def rank(self) -> int:
        """This replica's rank among the participants (its rank in the group if it sits out)."""
        rank = self._manager.participating_rank()
        return int(rank) if rank is not None else int(self._manager._pg.rank())

    def getBackendName(self) -> str:
        """The manager's group's backend name."""
        pg = self._manager._pg
        return pg.getBackendName() if isinstance(pg, ProcessGroup) else str(pg.name())

    # As in base.ProcessGroup: the stub's (tensor(s), op, timeout) overload; no timeout here.
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Fault-tolerant allreduce of one tensor through the manager.

        Waits for the step's quorum first; once the step has failed (or its
        quorum did), nothing runs and a completed work is returned. Errors
        are reported to the manager, never raised: the returned work's
        ``wait()`` is always True and its future resolves to ``tensors``.

        Raises:
            ValueError: more than one tensor is given.
        """
        tensors = _as_list(tensors, "allreduce")
        if len(tensors) != 1:
            raise ValueError(
                f"ManagedProcessGroup.allreduce takes exactly one tensor, got {len(tensors)}"
            )
        op: c10d.ReduceOp | c10d.ReduceOp.RedOpType
        if opts is None:
            op = dist.ReduceOp.SUM
        elif isinstance(opts, c10d.AllreduceOptions):
            op = opts.reduceOp
        else:
            op = opts
        manager = self._manager
        try:
            manager.wait_quorum()
        except Exception as exc:  # a failed quorum fails the step, not the caller
            manager.report_error(exc)
        if manager.errored() is not None:
            return CompletedWork(tensors)
        result = manager.allreduce(tensors[0], reduce_op=_reduce_op(op))
        if isinstance(result, torch.futures.Future) and not isinstance(result, dist._Work):
            result = FutureWork(result)
        return ReportingWork(manager, result, tensors)

    def _collective(self, op: str, args: tuple[Any, ...], post: Post = None) -> dist.Work:
        # Other ops go to the manager's current group, whatever it is now.
        self._pg = self._manager._pg
        return super()._collective(op, args, post)
