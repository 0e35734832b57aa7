"""DistributedSampler over replica groups."""

from __future__ import annotations

from typing import Any, cast

import pytest
from torch.utils.data import Dataset

from ftdist.data import DistributedSampler


def _data(n: int) -> Dataset[int]:
    """``range(n)`` as a list: torch types a dataset as its ``Dataset`` class,
    but a sampler needs only its length, and any list is a map-style dataset."""
    return cast("Dataset[int]", list(range(n)))


def test_global_rank_and_world_size_span_every_replica_group() -> None:
    sampler = DistributedSampler(
        _data(1000), replica_rank=1, num_replica_groups=2, group_rank=3, num_replicas=4
    )
    assert (sampler.global_rank, sampler.global_world_size) == (7, 8)
    assert (sampler.rank, sampler.num_replicas) == (7, 8)
    assert next(iter(sampler)) == 500  # torch's default shuffle with seed 0
    assert len(sampler) == 125


def test_shards_are_disjoint_and_cover_the_data() -> None:
    seen: list[int] = []
    for replica in range(3):
        for group_rank in range(2):
            seen += list(DistributedSampler(_data(60), replica, 3, group_rank, 2, shuffle=False))
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
def test_bad_ranks_are_rejected(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        DistributedSampler(_data(10), **kwargs)


# The keyword spellings of torchft's three generations, and the positional order.
SPELLINGS = [
    {"replica_group": 1, "num_replica_groups": 2, "rank": 3, "num_replicas": 4},
    {"replica_group_id": 1, "num_replica_groups": 2, "group_rank": 3, "num_replicas": 4},
    {"replica_rank": 1, "num_replica_groups": 2, "group_rank": 3, "num_replicas": 4},
    {"replica_rank": 1, "num_replica_groups": 2, "rank": 3, "num_replicas": 4},
]


@pytest.mark.parametrize("kwargs", SPELLINGS, ids=lambda k: "+".join(sorted(k)))
def test_every_generations_keywords_give_the_same_shard(kwargs: dict[str, Any]) -> None:
    reference = list(DistributedSampler(_data(1000), 1, 2, 3, 4))
    sampler = DistributedSampler(_data(1000), **kwargs)
    assert (sampler.global_rank, sampler.global_world_size) == (7, 8)
    assert list(sampler) == reference and reference[0] == 500


def test_torch_sampler_options_pass_through_every_spelling() -> None:
    a = DistributedSampler(_data(10), replica_group=0, num_replica_groups=3, shuffle=False)
    assert list(a) == [0, 3, 6, 9]  # padded from the start to 12 samples
    b = DistributedSampler(
        _data(10), replica_group_id=2, num_replica_groups=3, shuffle=False, drop_last=True
    )
    assert list(b) == [2, 5, 8]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"replica_rank": 1, "replica_group": 1}, "replica_rank and replica_group"),
        ({"replica_rank": 0, "replica_group_id": 1}, "replica_rank and replica_group_id"),
        ({"replica_rank": 0, "group_rank": 0, "rank": 1}, "group_rank and rank"),
        ({"group_rank": 0}, "needs the replica group's index"),
    ],
)
def test_conflicting_or_missing_spellings_are_type_errors(
    kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(TypeError, match=needle):
        DistributedSampler(_data(10), num_replica_groups=2, **kwargs)
    with pytest.raises(TypeError, match="needs num_replica_groups"):
        DistributedSampler(_data(10), replica_rank=0)
