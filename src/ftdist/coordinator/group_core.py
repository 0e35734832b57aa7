"""
A group coordinator's core: membership and the helpers every method uses
========================================================================

:class:`GroupCore` holds what a :class:`~ftdist.coordinator.GroupCoordinator`
knows about its group (global ranks, this rank's position, the two process
groups, the device communicator and the message queue) and the checks its
methods share. :func:`reports_failures` posts a method's communication
failure as failure news, so the other members of ftdist groups abort at once.

The coordinator's methods are split by concept: the tensor collectives and
the lifetime are in ``group.py``, objects, point-to-point and tensor
dictionaries in ``group_messages.py``; both build on this class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ftdist.coordinator import failures
from ftdist.coordinator.communicator import DeviceCommunicator, check_group_rank
from ftdist.coordinator.groups import FtBackend
from ftdist.coordinator.message_queue import MessageQueue
from ftdist.errors import CommunicationError

# The coordinator's broadcaster: 4 MiB chunks, 6 of them (vLLM's choice).
MQ_CHUNK_BYTES = 1 << 22
MQ_CHUNKS = 6

F = TypeVar("F", bound=Callable[..., Any])


def reports_failures(fn: F) -> F:
    """Post a communication failure of this method as failure news (ftdist groups)."""

    @functools.wraps(fn)
    def wrapper(self: GroupCore, *args: Any, **kwargs: Any) -> Any:
        if self._watch is None or torch.compiler.is_compiling():
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        except CommunicationError as exc:
            self._watch.report(f"{self.unique_name} (rank {self.rank}) {fn.__name__}: {exc}")
            raise

    return wrapper  # type: ignore[return-value]


class GroupCore:
    """A group's membership and the state its communication runs on.

    Not built directly: :class:`~ftdist.coordinator.GroupCoordinator`
    fills these attributes in its constructor and in ``reconfigure``.

    Attributes:
        unique_name: the coordinator's name in the custom-op registry (``"tp:0"``).
        rank: this process's global rank.
        ranks: the group's global ranks; a position is a rank in the group.
        world_size: the number of members.
        rank_in_group: this process's position in :attr:`ranks`.
        local_rank: the device index on this host.
        backend: ``"gloo"``, ``"nccl"``, or the ftdist device kind.
        device: the device tensors of the device group live on.
        device_group: the group device tensors travel over.
        cpu_group: the Gloo (or ftdist CPU) group objects and metadata travel over.
        device_communicator: the tensor collectives, or None.
        mq_broadcaster: the shared-memory broadcaster of rank 0, or None.
        timeout: the collective timeout, or None (torch's default).
        destroyed: True after ``destroy``.
    """

    unique_name: str
    rank: int
    ranks: list[int]
    world_size: int
    rank_in_group: int
    local_rank: int
    backend: str
    device: torch.device
    device_group: Any
    cpu_group: Any
    device_communicator: DeviceCommunicator | None
    mq_broadcaster: MessageQueue | None
    timeout: timedelta | None
    destroyed: bool
    _watch: failures.FailureWatch | None
    _ft: FtBackend | None

    def _set_members(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(self.rank)

    def _timeout_s(self) -> float | None:
        return None if self.timeout is None else self.timeout.total_seconds()

    @property
    def first_rank(self) -> int:
        """The global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """The global rank of the group's last member."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """True if this process is the group's first member."""
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        """True if this process is the group's last member."""
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """The global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """The global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @property
    def is_reconfigurable(self) -> bool:
        """True when built over ftdist groups, so :meth:`reconfigure` works."""
        return self._ft is not None

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.unique_name!r}, ranks={self.ranks}, "
            f"rank_in_group={self.rank_in_group}, backend={self.backend!r})"
        )

    def _communicator(self) -> DeviceCommunicator:
        if self.destroyed:
            raise RuntimeError(f"group {self.unique_name} is destroyed")
        if self.device_communicator is None:
            why = (
                "the group has one rank"
                if self.world_size == 1
                else "it was built with use_device_communicator=False"
            )
            raise ValueError(f"No device communicator found for group {self.unique_name}: {why}")
        return self.device_communicator

    def _src(self, src: Any, what: str = "src") -> int:
        return check_group_rank(src, self.world_size, what)

    def _check_peer(self, peer: Any, what: str) -> int:
        self._src(peer, what)
        if peer == self.rank_in_group:
            raise ValueError(
                f"Invalid {what} rank ({peer}): {what} is the same as the current rank"
            )
        return int(peer)


__all__ = ["MQ_CHUNKS", "MQ_CHUNK_BYTES", "GroupCore", "reports_failures"]
