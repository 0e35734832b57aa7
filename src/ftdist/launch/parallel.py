"""
Model, pipeline and data-parallel group coordinators
====================================================

:func:`init_parallelism` builds this process's model-, pipeline- and
data-parallel groups over torch.distributed's default group, laid out by
:func:`~ftdist.launch.layout.parallel_layout` (ml-starter's grid with its
group indices corrected), each as a
:class:`~ftdist.coordinator.GroupCoordinator`;
:func:`get_parallel_groups` returns them.

Invariants: every rank builds every group, in the same order (data,
pipeline, model, as ml-starter does), because ``dist.new_group`` is
collective over the world; each coordinator's ``rank_in_group`` is the
rank's position in its group.

Under :func:`~ftdist.launch.launch_subprocesses` with fault tolerance the
default group is one replica group, so the data-parallel coordinator holds
this rank alone: data parallelism across replica groups goes through the
Manager (:func:`~ftdist.launch.get_manager`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch.distributed as dist

from ftdist.coordinator import GroupCoordinator
from ftdist.launch.dist_env import get_distributed_backend
from ftdist.launch.layout import ParallelLayout, parallel_layout

logger = logging.getLogger(__name__)


class ParallelGroups(NamedTuple):
    """This process's groups: ``mp, pp, dp = get_parallel_groups()``.

    Attributes:
        mp: the model-parallel group.
        pp: the pipeline-parallel group.
        dp: the data-parallel group.
    """

    mp: GroupCoordinator
    pp: GroupCoordinator
    dp: GroupCoordinator

    @property
    def layout(self) -> ParallelLayout:
        """Every group of each kind (the world these three groups tile)."""
        mp, pp = self.mp.world_size, self.pp.world_size
        return parallel_layout(mp * pp * self.dp.world_size, mp, pp)


_groups: ParallelGroups | None = None


def parallelism_is_initialized() -> bool:
    """True once :func:`init_parallelism` has run (and until :func:`reset_parallelism`)."""
    return _groups is not None


def get_parallel_groups() -> ParallelGroups:
    """The model-, pipeline- and data-parallel coordinators of this process.

    Raises:
        RuntimeError: :func:`init_parallelism` has not run (a launched
            function finds it done by the launcher).
    """
    if _groups is None:
        raise RuntimeError(
            "parallel groups are not initialized: run the function with "
            "ftdist.launch.launch_subprocesses / init_and_run, or call init_parallelism()"
        )
    return _groups


def init_parallelism(
    model_parallelism: int = 1,
    pipeline_parallelism: int = 1,
    *,
    mp_backend: str | None = None,
    pp_backend: str | None = None,
    dp_backend: str | None = None,
    local_rank: int = 0,
) -> ParallelGroups:
    """Build the three kinds of group over the default group (collective over it).

    ``model_parallelism`` larger than the world is lowered to the world
    size with a warning, as in ml-starter. A backend left None is
    :func:`~ftdist.launch.get_distributed_backend`'s.

    Raises:
        RuntimeError: torch.distributed is not initialized, or the groups
            are already built (call :func:`reset_parallelism` first).
        TypeError: a size is not an int.
        ValueError: the world size is not divisible by
            ``model_parallelism * pipeline_parallelism``.
    """
    global _groups
    if _groups is not None:
        raise RuntimeError("parallelism is already initialized; call reset_parallelism() first")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call init_dist() (or launch the "
            "function with launch_subprocesses) before init_parallelism()"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(model_parallelism, int) and model_parallelism > world:
        logger.warning(
            "model_parallelism %d exceeds the world size %d; using %d",
            model_parallelism,
            world,
            world,
        )
        model_parallelism = world
    layout = parallel_layout(world, model_parallelism, pipeline_parallelism)
    default = str(get_distributed_backend())
    coordinators = {}
    for kind, groups, backend in (
        ("dp", layout.dp_groups, dp_backend),
        ("pp", layout.pp_groups, pp_backend),
        ("mp", layout.mp_groups, mp_backend),
    ):
        coordinators[kind] = GroupCoordinator(
            [list(g) for g in groups],
            max(local_rank, 0),
            backend or default,
            use_device_communicator=True,
            group_name=kind,
        )
    _groups = ParallelGroups(coordinators["mp"], coordinators["pp"], coordinators["dp"])
    places = layout.places(rank)
    logger.debug(
        "rank %d: mp %s (rank %d), pp %s (rank %d), dp %s (rank %d)",
        rank,
        places.mp.ranks,
        places.mp.rank,
        places.pp.ranks,
        places.pp.rank,
        places.dp.ranks,
        places.dp.rank,
    )
    return _groups


def reset_parallelism() -> None:
    """Destroy the coordinators built by :func:`init_parallelism`; safe to call twice."""
    global _groups
    groups, _groups = _groups, None
    if groups is not None:
        for coordinator in (groups.mp, groups.pp, groups.dp):
            coordinator.destroy()


__all__ = [
    "ParallelGroups",
    "get_parallel_groups",
    "init_parallelism",
    "parallelism_is_initialized",
    "reset_parallelism",
]
