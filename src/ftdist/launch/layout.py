"""
Model, pipeline and data-parallel layout (pure)
===============================================

Which ranks form each model-parallel (MP), pipeline-parallel (PP) and
data-parallel (DP) group, and where each rank sits in its groups. Global
ranks are laid out as a ``(dp, pp, mp)`` grid, model-parallel fastest, as
ml-starter's ``init_parallelism`` lays them out. With ``m = r % mp``,
``p = (r // mp) % pp`` and ``d = r // (mp * pp)``:

============  ====================  ==============  =========================================
group         index of the group    rank inside it  global ranks
============  ====================  ==============  =========================================
model         ``d * pp + p``        ``m``           ``[(d*pp + p)*mp + i for i < mp]``
pipeline      ``d * mp + m``        ``p``           ``[d*pp*mp + q*mp + m for q < pp]``
data          ``p * mp + m``        ``d``           ``[e*pp*mp + p*mp + m for e < dp]``
============  ====================  ==============  =========================================

ml-starter builds the same lists but picks a rank's group with
``r % (mp*pp)`` (DP: right), ``(r // pp) % mp`` (PP: a group that need not
hold the rank) and ``r // (mp*pp)`` (MP: right only when ``pp == 1``), and
reports those indices as the rank inside the group; :func:`upstream_indices`
reproduces that arithmetic so tests can show the difference.

Invariants: every kind of group partitions ``range(world_size)``; a rank's
group of each kind holds it at its in-group rank; groups are listed by
index and each group's ranks are sorted (what ``dist.new_group`` expects).
No I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupPlace:
    """One rank's place in one kind of group.

    Attributes:
        index: which group of its kind (its position in the layout's list).
        rank: the rank's position inside the group.
        ranks: the group's global ranks, sorted.
    """

    index: int
    rank: int
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self.ranks)


@dataclass(frozen=True)
class RankPlaces:
    """Where one rank sits in its model-, pipeline- and data-parallel groups."""

    mp: GroupPlace
    pp: GroupPlace
    dp: GroupPlace


@dataclass(frozen=True)
class ParallelLayout:
    """Every group of each kind for one world size and parallelism.

    Attributes:
        world_size: ranks in the world.
        model_parallelism: ranks per model-parallel group.
        pipeline_parallelism: ranks per pipeline-parallel group.
        data_parallelism: ranks per data-parallel group
            (``world_size // (model_parallelism * pipeline_parallelism)``).
        mp_groups: the model-parallel groups, by index.
        pp_groups: the pipeline-parallel groups, by index.
        dp_groups: the data-parallel groups, by index.
    """

    world_size: int
    model_parallelism: int
    pipeline_parallelism: int
    data_parallelism: int
    mp_groups: tuple[tuple[int, ...], ...]
    pp_groups: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]

    def places(self, rank: int) -> RankPlaces:
        """Where ``rank`` sits in each kind of group.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is outside ``range(world_size)``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        mp, pp = self.model_parallelism, self.pipeline_parallelism
        m, p, d = rank % mp, (rank // mp) % pp, rank // (mp * pp)
        mp_index, pp_index, dp_index = d * pp + p, d * mp + m, p * mp + m
        return RankPlaces(
            mp=GroupPlace(mp_index, m, self.mp_groups[mp_index]),
            pp=GroupPlace(pp_index, p, self.pp_groups[pp_index]),
            dp=GroupPlace(dp_index, d, self.dp_groups[dp_index]),
        )


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def parallel_layout(
    world_size: int, model_parallelism: int = 1, pipeline_parallelism: int = 1
) -> ParallelLayout:
    """The model-, pipeline- and data-parallel groups of a world (see the module docstring).

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is below 1, or ``world_size`` is not divisible by
            ``model_parallelism * pipeline_parallelism``.
    """
    world = _positive("world_size", world_size)
    mp = _positive("model_parallelism", model_parallelism)
    pp = _positive("pipeline_parallelism", pipeline_parallelism)
    if world % (mp * pp):
        raise ValueError(
            f"world_size ({world}) is not divisible by model_parallelism ({mp}) x "
            f"pipeline_parallelism ({pp}); pick sizes whose product divides the world size"
        )
    dp = world // (mp * pp)
    mp_groups = tuple(
        tuple((d * pp + p) * mp + i for i in range(mp)) for d in range(dp) for p in range(pp)
    )
    pp_groups = tuple(
        tuple(d * pp * mp + q * mp + m for q in range(pp)) for d in range(dp) for m in range(mp)
    )
    dp_groups = tuple(
        tuple(e * pp * mp + p * mp + m for e in range(dp)) for p in range(pp) for m in range(mp)
    )
    return ParallelLayout(world, mp, pp, dp, mp_groups, pp_groups, dp_groups)


def upstream_indices(layout: ParallelLayout, rank: int) -> RankPlaces:
    """ml-starter's places for ``rank`` in ``layout``, bug included (for comparison only).

    Each :class:`GroupPlace` holds upstream's index as both ``index`` and
    ``rank``, as upstream stores it, and the group at that index in the
    layout's lists, which upstream's lists equal.

    Raises:
        ValueError: ``rank`` is outside the layout's world.
    """
    layout.places(rank)  # checks the rank
    mp, pp = layout.model_parallelism, layout.pipeline_parallelism
    dp_index, pp_index, mp_index = rank % (mp * pp), (rank // pp) % mp, rank // (mp * pp)
    return RankPlaces(
        mp=GroupPlace(mp_index, mp_index, layout.mp_groups[mp_index]),
        pp=GroupPlace(pp_index, pp_index, layout.pp_groups[pp_index]),
        dp=GroupPlace(dp_index, dp_index, layout.dp_groups[dp_index]),
    )


__all__ = ["GroupPlace", "ParallelLayout", "RankPlaces", "parallel_layout", "upstream_indices"]
