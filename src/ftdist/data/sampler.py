"""
torchft's sampler: static shards across replica groups
======================================================

Each rank of each replica group reads its own shard: the global rank is
``group_rank + group_world_size * replica_rank``. This is torchft's
``DistributedSampler``, kept exactly as it is for code written against it.

Under failures this sampling is lossy, as torchft's documentation says: the
shard of a replica group that is down is skipped, not reassigned, and the
global batch shrinks with every group that is out.
:class:`~ftdist.data.exact.ExactSampler` reads every sample exactly once
with a constant global batch instead (docs/data.md compares them).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data import distributed as torch_distributed

__all__ = ["DistributedSampler"]

# Every spelling torchft has used, by meaning: the early-2025 wheel
# (replica_group, rank), mid-2025 examples (replica_group_id, group_rank)
# and today's wheel (replica_rank, group_rank).
_REPLICA_ALIASES = ("replica_rank", "replica_group_id", "replica_group")
_GROUP_RANK_ALIASES = ("group_rank", "rank")


def _one_of(given: dict[str, Any], names: tuple[str, ...]) -> Any:
    present = [n for n in names if given.get(n) is not None]
    if len(present) > 1:
        raise TypeError(
            f"DistributedSampler got {' and '.join(present)}, which mean the same thing; "
            f"pass only one of {', '.join(names)}"
        )
    return given[present[0]] if present else None


class DistributedSampler(torch_distributed.DistributedSampler[Any]):
    """A ``DistributedSampler`` over every rank of every replica group.

    This rank reads the indices of global rank
    ``group_rank + num_replicas * replica_rank`` out of
    ``num_replicas * num_replica_groups``, with torch's shuffling, padding
    and ``drop_last`` rules.

    Every keyword spelling torchft has used works: the replica group's index
    as ``replica_rank`` (today), ``replica_group_id`` (mid-2025) or
    ``replica_group`` (early 2025), and the rank inside the group as
    ``group_rank`` or ``rank``. Positionally the order is
    ``(dataset, replica, num_replica_groups, group_rank, num_replicas)``.

    Args:
        dataset: the dataset to shard.
        replica_rank: this replica group's index (0-based); also
            ``replica_group_id=`` or ``replica_group=``.
        num_replica_groups: how many replica groups there are in total.
        group_rank: this rank inside its replica group (default: the default
            process group's rank, or 0 without one); also ``rank=``.
        num_replicas: ranks per replica group (default: the default process
            group's size, or 1 without one).
        replica_group_id: same as ``replica_rank``.
        replica_group: same as ``replica_rank``.
        rank: same as ``group_rank``.
        **kwargs: passed to ``torch.utils.data.DistributedSampler``
            (``shuffle``, ``seed``, ``drop_last``).

    Raises:
        TypeError: two spellings of the same argument, or the replica index
            or ``num_replica_groups`` missing.
        ValueError: a rank or count is out of range.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        replica_rank: int | None = None,
        num_replica_groups: int | None = None,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        *,
        replica_group_id: int | None = None,
        replica_group: int | None = None,
        rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        replica = _one_of(
            {
                "replica_rank": replica_rank,
                "replica_group_id": replica_group_id,
                "replica_group": replica_group,
            },
            _REPLICA_ALIASES,
        )
        group_rank = _one_of({"group_rank": group_rank, "rank": rank}, _GROUP_RANK_ALIASES)
        if replica is None:
            raise TypeError(
                "DistributedSampler needs the replica group's index: replica_rank= "
                "(or replica_group_id=, replica_group=)"
            )
        if num_replica_groups is None:
            raise TypeError("DistributedSampler needs num_replica_groups=")
        initialized = dist.is_available() and dist.is_initialized()
        if group_rank is None:
            group_rank = dist.get_rank() if initialized else 0
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if num_replica_groups < 1:
            raise ValueError(f"num_replica_groups must be >= 1, got {num_replica_groups}")
        if not 0 <= replica < num_replica_groups:
            raise ValueError(f"replica_rank must be in [0, {num_replica_groups}), got {replica}")
        if num_replicas < 1 or not 0 <= group_rank < num_replicas:
            raise ValueError(f"group_rank must be in [0, {num_replicas}), got {group_rank}")
        self.global_rank = group_rank + num_replicas * replica
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
