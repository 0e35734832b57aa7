"""
Fault-tolerant launching
========================

The world of ``world_size`` ranks is split into data-parallel replica
groups of ``model_parallelism * pipeline_parallelism`` ranks (group ``g``
holds global ranks ``g*G .. g*G + G-1``, the data-parallel index of the
layout). Each replica group is a torch.distributed world of its own, with
its own store, and each of its ranks runs a :class:`~ftdist.manager.Manager`
that joins the other groups through a lighthouse: the one in
``$FTDIST_LIGHTHOUSE``/``$TORCHFT_LIGHTHOUSE`` (or
:attr:`FaultTolerance.lighthouse`), else one started in the launching
process.

When a process fails, its whole replica group is killed and started again
from the warm fork server; the other groups drop it from their quorum at
their next step and keep committing, and the new processes heal from a
peer's memory at their first step. The environment of every child follows
torchrun and torchft: ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
``FTDIST_LIGHTHOUSE``/``TORCHFT_LIGHTHOUSE``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftdist.launch.config import FaultTolerance, MultiprocessConfig
from ftdist.launch.layout import parallel_layout

logger = logging.getLogger(__name__)


def replica_env(
    group: int, groups: int, attempt: int, lighthouse: str, max_restarts: int
) -> dict[str, str]:
    """The environment of a process of replica group ``group`` (torchrun's and torchft's names)."""
    return {
        "REPLICA_GROUP_ID": str(group),
        "NUM_REPLICA_GROUPS": str(groups),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "FTDIST_LIGHTHOUSE": lighthouse,
        "TORCHFT_LIGHTHOUSE": lighthouse,
    }


def embedded_lighthouse(min_replicas: int, join_timeout: timedelta) -> Any:
    """A lighthouse in this process on ``127.0.0.1`` (a free port, no dashboard).

    Raises:
        ValueError: a setting is invalid.
        OSError: no port could be bound.
    """
    from ftdist.lighthouse import LighthouseServer

    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout,
        http_port=-1,
    )


def launch_fault_tolerant(
    func: Callable[..., None],
    cfg: MultiprocessConfig,
    setup: Callable[[], None] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ft: FaultTolerance,
    context: Any,
) -> None:
    """Run ``func`` on every rank, one Manager per rank, restarting failed replica groups.

    ``cfg`` is resolved; its ``world_size`` is the whole job's.

    Raises:
        ValueError: the world size is not divisible by the group size.
        ProcessFailedError: a replica group failed more than ``ft.max_restarts`` times.
        CoordinationError: the lighthouse is unreachable (from a child, as
            its failure).
    """
    from ftdist.launch.children import FunctionJob
    from ftdist.launch.process import ReplicaInfo
    from ftdist.launch.supervisor import Supervisor

    layout = parallel_layout(cfg.world_size, cfg.model_parallelism, cfg.pipeline_parallelism)
    size = cfg.model_parallelism * cfg.pipeline_parallelism
    groups = layout.data_parallelism
    address = ft.lighthouse_address()
    lighthouse = None
    if address is None:
        lighthouse = embedded_lighthouse(ft.min_replica_size, ft.join_timeout)
        address = lighthouse.address()

    def make_job(rank: int, group: int, attempt: int, port: int) -> tuple[Any, Any]:
        child = copy.copy(cfg)
        child.world_size = size
        child.local_world_size = min(cfg.local_world_size, size)
        child.rank = rank - group * size
        child.local_rank = rank % cfg.local_world_size
        child.master_port = port
        replica = ReplicaInfo(group, groups, attempt, address)
        env = replica_env(group, groups, attempt, address, ft.max_restarts)
        return FunctionJob(func, setup, child, args, kwargs, replica, ft), env

    def on_restart(group: int, attempt: int, reason: str) -> None:
        logger.warning("replica group %d: attempt %d started", group, attempt)

    logger.info("Launching %d replica groups of %d ranks (lighthouse %s)", groups, size, address)
    try:
        Supervisor(
            context=context,
            groups=groups,
            group_size=size,
            first_rank=0,
            make_job=make_job,
            master_addr=cfg.master_addr,
            master_port=0,
            host_stores=True,
            fault_tolerant=True,
            max_restarts=ft.max_restarts,
            on_restart=on_restart,
        ).run()
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()


__all__ = ["embedded_lighthouse", "launch_fault_tolerant", "replica_env"]
