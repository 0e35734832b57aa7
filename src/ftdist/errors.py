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
    "FtdistError",
    "ProcessFailedError",
    "ProcessGroupAbortedError",
    "StateDivergenceError",
]
