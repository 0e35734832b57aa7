"""
Data sharding across replica groups
===================================

Each rank of each replica group reads its own shard: the global rank is
``group_rank + group_world_size * replica_rank``.

Under failures this sampling is lossy: the shard of a replica group that is
down is skipped, not reassigned.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data import distributed as torch_distributed


class DistributedSampler(torch_distributed.DistributedSampler[Any]):
    """A ``DistributedSampler`` over every rank of every replica group.

    Args:
        dataset: the dataset to shard.
        replica_rank: this replica group's index (0-based).
        num_replica_groups: how many replica groups there are in total.
        group_rank: this rank inside its replica group (default: the default
            process group's rank, or 0 without one).
        num_replicas: ranks per replica group (default: the default process
            group's size, or 1 without one).
        **kwargs: passed to ``torch.utils.data.DistributedSampler``
            (``shuffle``, ``seed``, ``drop_last``).

    Raises:
        ValueError: a rank or count is out of range.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if group_rank is None:
            group_rank = dist.get_rank() if initialized else 0
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if num_replica_groups < 1:
            raise ValueError(f"num_replica_groups must be >= 1, got {num_replica_groups}")
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(
                f"replica_rank must be in [0, {num_replica_groups}), got {replica_rank}"
            )
        if num_replicas < 1 or not 0 <= group_rank < num_replicas:
            raise ValueError(f"group_rank must be in [0, {num_replicas}), got {group_rank}")
        self.global_rank = group_rank + num_replicas * replica_rank
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
