"""
Errors
======

Every error ftdist raises on purpose derives from :class:`FtdistError`, so a
training loop can tell a fault ftdist detected from a bug in its own code.

Misuse (bad arguments, calls in the wrong order) raises the builtin
``ValueError``/``TypeError``/``RuntimeError`` at once, before any communication.
Faults inside a step (a dead peer, a timeout) are :class:`CommunicationError`
subclasses; the Manager records them and votes not to commit.
"""

from __future__ import annotations

import traceback


class FtdistError(Exception):
    """Root of every error that ftdist raises for a detected fault."""


class CommunicationError(FtdistError, RuntimeError):
    """A collective or transfer failed because a peer or the network failed."""


class CollectiveTimeoutError(CommunicationError, TimeoutError):
    """A collective did not complete within its timeout."""


class ProcessGroupAbortedError(CommunicationError):
    """The work belonged to a backend that was aborted or reconfigured away."""


class BackendProcessError(CommunicationError):
    """The subprocess running a Baby process group died or stopped answering."""


class StateDivergenceError(FtdistError):
    """Replicas that should hold the same state do not; the step must not commit."""


class DataCoverageError(FtdistError):
    """A step's samples were not all trained (a replica group's part failed):
    the step must not commit, so that it is issued again whole
    (:meth:`ftdist.data.ExactSampler.verify`)."""


class RecoveryError(FtdistError):
    """A heal could not be completed; the replica heals again at the next quorum."""


class CheckpointError(CommunicationError):
    """A live checkpoint transfer failed: wrong step, truncated or corrupted."""


class CoordinationError(FtdistError, RuntimeError):
    """A call to the lighthouse or a manager server failed.

    The message carries the server's status and text. torchft raises a plain
    ``RuntimeError`` here, which this still is.
    """


class CoordinationTimeoutError(FtdistError, TimeoutError):
    """A call to the lighthouse or a manager server ran past its deadline.

    torchft raises a plain ``TimeoutError`` here, which this still is.
    """


class EtcdError(CoordinationError):
    """A call to etcd failed: no endpoint answered in time, or etcd refused it.

    The replicated lighthouse (:mod:`ftdist.lighthouse.replica`) treats it as
    a loss of contact with etcd: a leader stops forming quorums.
    """


class NotReconfigurableError(TypeError, ValueError):
    """A process group that ftdist cannot reconfigure was given where it must.

    A ``TypeError`` (the wrong kind of group) that is also the ``ValueError``
    torchft raises for it.
    """


class ExceptionWithTraceback(FtdistError):
    """A recorded error together with where it was raised (torchft's name).

    Args:
        e: the original exception.

    Attributes:
        original_exception: ``e``.
        stack_trace: ``e``'s formatted traceback.
    """

    def __init__(self, e: BaseException) -> None:
        self.original_exception = e
        self.stack_trace = "".join(traceback.format_exception(e))
        super().__init__(f"{e}\n{self.stack_trace}")


def with_traceback(e: BaseException) -> BaseException:
    """``e`` itself, carrying ``original_exception`` and ``stack_trace`` attributes.

    Both generations of torchft read a recorded error: the seed era expects
    the very exception (``manager.errored() is e``, ``raise
    manager.errored()``), today's an object with ``.original_exception``.
    The original, with the attributes added, is both. An exception that
    refuses attributes is wrapped in :class:`ExceptionWithTraceback`.
    """
    try:
        e.original_exception = e  # type: ignore[attr-defined]
        e.stack_trace = "".join(traceback.format_exception(e))  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return ExceptionWithTraceback(e)
    return e


class ProcessFailedError(FtdistError, RuntimeError):
    """A launched process raised, exited non-zero or died, and the launch stopped.

    Raised in the launching process by :func:`ftdist.launch.launch_subprocesses`
    (and ``ftdist run``) after the other processes were stopped. A
    ``RuntimeError``, as ml-starter's launcher raises.

    Attributes:
        rank: the global rank of the process that failed.
        exitcode: its exit code; negative for the signal that killed it.
        child_traceback: the traceback the process reported, or None if it
            died without reporting one (a signal, ``os._exit``).
        replica_group: its replica group (0 without fault tolerance).
    """

    def __init__(
        self,
        message: str,
        rank: int,
        exitcode: int,
        child_traceback: str | None,
        replica_group: int = 0,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.child_traceback = child_traceback
        self.replica_group = replica_group

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (str(self), self.rank, self.exitcode, self.child_traceback, self.replica_group),
        )


__all__ = [
    "BackendProcessError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "CommunicationError",
    "CoordinationError",
    "CoordinationTimeoutError",
    "DataCoverageError",
    "EtcdError",
    "ExceptionWithTraceback",
    "FtdistError",
    "NotReconfigurableError",
    "ProcessFailedError",
    "ProcessGroupAbortedError",
    "RecoveryError",
    "StateDivergenceError",
]
