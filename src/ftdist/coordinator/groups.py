"""
Where a coordinator's two groups come from
==========================================

A :class:`~ftdist.coordinator.GroupCoordinator` owns two groups over the
same ranks: a *device group* for tensors (the requested backend) and a *CPU
group* (Gloo) for objects, metadata, barriers and the message queue. They
come from one of two places:

- **torch.distributed** (``torch_distributed_backend="gloo"`` or
  ``"nccl"``): ``dist.new_group`` over the default group, exactly as vLLM
  builds them. Every process of the default group must build every group
  of ``group_ranks``, in the same order. These groups cannot be rebuilt.
- **ftdist reconfigurable groups** (``torch_distributed_backend=FtBackend(...)``):
  each group is an ftdist ``ProcessGroup`` that meets on a TCPStore, so
  only the group's own members take part, no default group is needed, and
  ``GroupCoordinator.reconfigure`` rebuilds both groups for a new
  membership after a death.

Invariant: in both cases a rank's position in its ``ranks`` list is its rank
in both groups (torch sorts ``new_group`` ranks, so lists given to it must
be sorted; ftdist groups take the position as given).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ftdist.process_group import (
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    parse_store_addr,
)

# Device backends an FtBackend can build, by name.
FT_DEVICE_BACKENDS = {
    "gloo": ProcessGroupGloo,
    "nccl": ProcessGroupNCCL,
    "baby-gloo": ProcessGroupBabyGloo,
    "baby-nccl": ProcessGroupBabyNCCL,
}


@dataclass(frozen=True)
class FtBackend:
    """Build a coordinator's groups as ftdist reconfigurable groups.

    Pass it as ``torch_distributed_backend``. The store must outlive every
    rank (a TCPStore the launcher or the test harness hosts), so that the
    survivors can meet again after a death.

    Args:
        store_addr: ``host:port/prefix`` of the TCPStore; each coordinator
            meets below it at ``<unique_name>/<ranks>/{device,cpu}``.
        rank: this process's global rank: its id in ``group_ranks`` and in
            every later ``reconfigure``.
        device: the device group's backend: ``"gloo"``, ``"nccl"``,
            ``"baby-gloo"`` or ``"baby-nccl"``. The CPU group is always Gloo.
        timeout: the groups' collective timeout; a dead or stopped peer
            makes an operation fail within it.
        failure_news: post a failure that one coordinator sees to the
            store and abort every coordinator watching it, so survivors
            that wait on each other fail at once too (see
            :mod:`ftdist.coordinator.failures`).

    Raises:
        ValueError: a malformed ``store_addr``, an unknown ``device`` or a
            negative ``rank``.
        TypeError: ``rank`` is not an int or ``timeout`` not a timedelta.
    """

    store_addr: str
    rank: int
    device: str = "gloo"
    timeout: timedelta = field(default=timedelta(seconds=60))
    failure_news: bool = True

    def __post_init__(self) -> None:
        parse_store_addr(self.store_addr)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"FtBackend rank must be an int, got {self.rank!r}")
        if self.rank < 0:
            raise ValueError(f"FtBackend rank must be >= 0, got {self.rank}")
        if self.device not in FT_DEVICE_BACKENDS:
            raise ValueError(
                f"FtBackend device {self.device!r} is not one of {sorted(FT_DEVICE_BACKENDS)}"
            )
        if not isinstance(self.timeout, timedelta) or self.timeout <= timedelta(0):
            raise TypeError(f"FtBackend timeout must be a positive timedelta, got {self.timeout!r}")

    @property
    def is_nccl(self) -> bool:
        """True when the device group runs NCCL."""
        return self.device.endswith("nccl")


def check_group_ranks(group_ranks: Any) -> list[list[int]]:
    """Validate ``group_ranks``: a non-empty list of non-empty lists of distinct ints.

    Raises:
        TypeError: not a list of lists of ints.
        ValueError: empty, a group empty or with a repeated or negative rank,
            or a rank in two groups.
    """
    if not isinstance(group_ranks, (list, tuple)) or not group_ranks:
        raise TypeError(
            f"group_ranks must be a non-empty list of rank lists, e.g. [[0, 1], "
            f"[2, 3]], got {group_ranks!r}"
        )
    seen: set[int] = set()
    out = []
    for i, ranks in enumerate(group_ranks):
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise TypeError(f"group_ranks[{i}] must be a non-empty list of ranks, got {ranks!r}")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(f"group_ranks[{i}] holds {r!r}, not an int rank")
            if r < 0:
                raise ValueError(f"group_ranks[{i}] holds a negative rank {r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"group_ranks[{i}] = {list(ranks)} repeats a rank")
        both = seen & set(ranks)
        if both:
            raise ValueError(
                f"rank(s) {sorted(both)} appear in more than one group of "
                f"group_ranks; the groups of one coordinator must be disjoint"
            )
        seen |= set(ranks)
        out.append([int(r) for r in ranks])
    return out


def own_group(group_ranks: list[list[int]], rank: int) -> list[int]:
    """The group of ``group_ranks`` that holds ``rank``.

    Raises:
        ValueError: no group holds it.
    """
    for ranks in group_ranks:
        if rank in ranks:
            return ranks
    raise ValueError(
        f"rank {rank} is in none of the groups {group_ranks}; every process "
        "that builds a coordinator must belong to one of its groups"
    )


def require_torch_distributed(backend: str) -> None:
    """Check that torch.distributed's default group exists.

    Raises:
        RuntimeError: it does not; the message names both ways out.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"a GroupCoordinator with backend {backend!r} builds torch.distributed groups: call "
            "init_distributed_environment() (or dist.init_process_group) first, or pass "
            "torch_distributed_backend=FtBackend(store_addr, rank) for ftdist groups"
        )


def new_torch_groups(
    group_ranks: list[list[int]], rank: int, backend: str, timeout: timedelta | None
) -> tuple[list[int], Any, Any]:
    """Build every group of ``group_ranks`` with ``dist.new_group`` (collective over the world).

    Returns:
        ``(ranks, device_group, cpu_group)`` of the group that holds ``rank``.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: a group's ranks are not sorted, or outside the world.
    """
    require_torch_distributed(backend)
    world = dist.get_world_size()
    mine: tuple[list[int], Any, Any] | None = None
    for ranks in group_ranks:
        if ranks != sorted(ranks):
            raise ValueError(
                f"group {ranks} is not sorted: torch.distributed orders a group's ranks by "
                f"global rank, so rank_in_group would disagree with the collectives' order; "
                f"pass {sorted(ranks)}"
            )
        if max(ranks) >= world:
            raise ValueError(f"group {ranks} names a rank outside the world of {world} ranks")
    for ranks in group_ranks:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        device_group = dist.new_group(ranks, backend=backend, **kwargs)
        cpu_group = dist.new_group(ranks, backend="gloo", **kwargs)
        if rank in ranks:
            mine = (ranks, device_group, cpu_group)
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the groups {group_ranks}")
    return mine


def group_store_addr(store_addr: str, unique_name: str, ranks: list[int], kind: str) -> str:
    """The store address where one ftdist group of a coordinator meets."""
    return f"{store_addr}/{unique_name}/{'-'.join(map(str, ranks))}/{kind}"


def new_ft_groups(spec: FtBackend) -> tuple[ProcessGroup, ProcessGroup]:
    """Unconfigured ``(device_group, cpu_group)`` for ``spec``."""
    return (
        FT_DEVICE_BACKENDS[spec.device](timeout=spec.timeout),
        ProcessGroupGloo(timeout=spec.timeout),
    )


def configure_ft_groups(
    device_group: ProcessGroup,
    cpu_group: ProcessGroup,
    store_addr: str,
    unique_name: str,
    ranks: list[int],
    rank: int,
) -> None:
    """(Re)configure both ftdist groups for ``ranks``; work in flight on the old ones fails.

    Raises:
        ValueError: a malformed ``store_addr``.
        RuntimeError: a peer did not join within the groups' timeout.
    """
    position = ranks.index(rank)
    for group, kind in ((device_group, "device"), (cpu_group, "cpu")):
        group.configure(
            group_store_addr(store_addr, unique_name, ranks, kind), position, len(ranks)
        )


__all__ = [
    "FT_DEVICE_BACKENDS",
    "FtBackend",
    "check_group_ranks",
    "configure_ft_groups",
    "group_store_addr",
    "new_ft_groups",
    "new_torch_groups",
    "own_group",
    "require_torch_distributed",
]
