"""DistributedSampler over replica groups."""

from __future__ import annotations

import pytest

from ftdist.data import DistributedSampler


def test_global_rank_and_world_size_span_every_replica_group() -> None:
    sampler = DistributedSampler(
        list(range(1000)), replica_rank=1, num_replica_groups=2, group_rank=3, num_replicas=4
    )
    assert (sampler.global_rank, sampler.global_world_size) == (7, 8)
    assert (sampler.rank, sampler.num_replicas) == (7, 8)
    assert next(iter(sampler)) == 500  # torch's default shuffle with seed 0
    assert len(sampler) == 125


def test_shards_are_disjoint_and_cover_the_data() -> None:
    seen: list[int] = []
    for replica in range(3):
        for group_rank in range(2):
            seen += list(
                DistributedSampler(list(range(60)), replica, 3, group_rank, 2, shuffle=False)
            )
    assert sorted(seen) == list(range(60))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"replica_rank": 2, "num_replica_groups": 2}, r"replica_rank must be in \[0, 2\)"),
        ({"replica_rank": 0, "num_replica_groups": 0}, "num_replica_groups must be >= 1"),
        (
            {"replica_rank": 0, "num_replica_groups": 1, "group_rank": 4, "num_replicas": 4},
            r"group_rank must be in \[0, 4\)",
        ),
    ],
)
def test_bad_ranks_are_rejected(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        DistributedSampler(list(range(10)), **kwargs)
