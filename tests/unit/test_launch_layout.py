"""The model/pipeline/data-parallel layout, checked exhaustively against an independent grid."""

from __future__ import annotations

import itertools

import pytest

from ftdist.launch.layout import parallel_layout, upstream_indices


def _grid_groups(world: int, mp: int, pp: int) -> dict[str, list[list[int]]]:
    """ml-starter's group lists, built its way: ``arange(world).view(dp, pp, mp)`` and slices."""
    dp = world // (mp * pp)
    grid = [[[d * pp * mp + p * mp + m for m in range(mp)] for p in range(pp)] for d in range(dp)]
    mp_groups = [grid[d][p] for d in range(dp) for p in range(pp)]  # flatten(0, 1).unbind(0)
    # transpose(0, 1).flatten(1).unbind(1): index d*mp + m, members over p
    pp_groups = [[grid[d][p][m] for p in range(pp)] for d in range(dp) for m in range(mp)]
    # flatten(1).unbind(1): index p*mp + m, members over d
    dp_groups = [[grid[d][p][m] for d in range(dp)] for p in range(pp) for m in range(mp)]
    return {"mp": mp_groups, "pp": pp_groups, "dp": dp_groups}


def _layouts(max_world: int) -> list[tuple[int, int, int]]:
    return [
        (world, mp, pp)
        for world in range(1, max_world + 1)
        for mp, pp in itertools.product(range(1, world + 1), repeat=2)
        if world % (mp * pp) == 0
    ]


@pytest.mark.parametrize("world,mp,pp", _layouts(24))
def test_every_rank_sits_in_its_groups_at_its_rank(world: int, mp: int, pp: int) -> None:
    layout = parallel_layout(world, mp, pp)
    expected = _grid_groups(world, mp, pp)
    assert [list(g) for g in layout.mp_groups] == expected["mp"]
    assert [list(g) for g in layout.pp_groups] == expected["pp"]
    assert [list(g) for g in layout.dp_groups] == expected["dp"]
    assert layout.data_parallelism * mp * pp == world
    for kind, size in (("mp", mp), ("pp", pp), ("dp", world // (mp * pp))):
        groups = getattr(layout, f"{kind}_groups")
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), f"{kind} groups do not partition the world"
        assert all(list(g) == sorted(g) and len(g) == size for g in groups)
    for rank in range(world):
        places = layout.places(rank)
        for kind in ("mp", "pp", "dp"):
            place = getattr(places, kind)
            assert place.ranks == getattr(layout, f"{kind}_groups")[place.index]
            assert place.ranks[place.rank] == rank
        # Together the three positions locate the rank in the grid.
        assert rank == places.dp.rank * mp * pp + places.pp.rank * mp + places.mp.rank


def test_world_8_with_mp_2_pp_2_matches_the_reference() -> None:
    layout = parallel_layout(8, 2, 2)
    assert layout.mp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.pp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.dp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    table = {r: layout.places(r) for r in range(8)}
    assert [(p.mp.ranks, p.mp.rank) for p in table.values()] == [
        ((0, 1), 0), ((0, 1), 1), ((2, 3), 0), ((2, 3), 1),
        ((4, 5), 0), ((4, 5), 1), ((6, 7), 0), ((6, 7), 1),
    ]  # fmt: skip
    assert [(p.pp.ranks, p.pp.rank) for p in table.values()] == [
        ((0, 2), 0), ((1, 3), 0), ((0, 2), 1), ((1, 3), 1),
        ((4, 6), 0), ((5, 7), 0), ((4, 6), 1), ((5, 7), 1),
    ]  # fmt: skip
    assert [(p.dp.ranks, p.dp.rank) for p in table.values()] == [
        ((0, 4), 0), ((1, 5), 0), ((2, 6), 0), ((3, 7), 0),
        ((0, 4), 1), ((1, 5), 1), ((2, 6), 1), ((3, 7), 1),
    ]  # fmt: skip


def test_upstream_arithmetic_picks_wrong_groups_and_in_group_ranks() -> None:
    # world 8, mp 2, pp 2: upstream's pipeline index puts rank 2 in a group without it.
    layout = parallel_layout(8, 2, 2)
    assert 2 not in upstream_indices(layout, 2).pp.ranks
    assert 2 in layout.places(2).pp.ranks
    # ... and its model-parallel index too, once pp > 1.
    assert 2 not in upstream_indices(layout, 2).mp.ranks
    # world 4, mp 2, pp 1: both ranks of model-parallel group [0, 1] get rank 0 upstream.
    small = parallel_layout(4, 2, 1)
    assert [upstream_indices(small, r).mp.rank for r in (0, 1)] == [0, 0]
    assert [small.places(r).mp.rank for r in (0, 1)] == [0, 1]
    # Across every small layout, upstream's data-parallel index is always right.
    for world, mp, pp in _layouts(16):
        lay = parallel_layout(world, mp, pp)
        for r in range(world):
            assert upstream_indices(lay, r).dp.index == lay.places(r).dp.index


@pytest.mark.parametrize(
    "args,error",
    [
        ((6, 4, 1), ValueError),
        ((8, 2, 3), ValueError),
        ((0, 1, 1), ValueError),
        ((4, 0, 1), ValueError),
        ((4, 1, -2), ValueError),
        ((4.0, 1, 1), TypeError),
        ((4, True, 1), TypeError),
    ],
)
def test_bad_sizes_are_refused(args: tuple[object, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        parallel_layout(*args)  # type: ignore[arg-type]


def test_places_checks_the_rank() -> None:
    layout = parallel_layout(4, 2, 1)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        layout.places(4)
    with pytest.raises(TypeError):
        layout.places("1")  # type: ignore[arg-type]
