"""
Running the user's function in one process
==========================================

:func:`init_and_run` is what every launched process does: initialise
torch.distributed (:func:`~ftdist.launch.init_dist`), build the model-,
pipeline- and data-parallel coordinators
(:func:`~ftdist.launch.parallel.init_parallelism`), then call the function.

In fault-tolerant mode (:func:`run_replica`) the process belongs to one
data-parallel replica group: torch.distributed's world is that group, and
a :class:`~ftdist.manager.Manager` joins it to the other replica groups
through the lighthouse. The function finds its Manager with
:func:`get_manager` and registers its state for healing::

    def train():
        manager = ftdist.launch.get_manager()
        model, optim = ...
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
        ddp = ftdist.ddp.DistributedDataParallel(manager, model)
        ...

Invariants: the Manager exists exactly while the function runs, and is
shut down when it returns or raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ftdist.launch.config import FaultTolerance, MultiprocessConfig
from ftdist.launch.dist_env import forget_dist_info, init_dist
from ftdist.launch.parallel import init_parallelism, reset_parallelism
from ftdist.manager import Manager


@dataclass(frozen=True)
class ReplicaInfo:
    """Which replica group this process serves, in fault-tolerant mode.

    Attributes:
        replica_group: this group's index, ``0 <= replica_group < num_replica_groups``.
        num_replica_groups: replica groups in the job (for sharding data).
        attempt: how many times this group was restarted before this process.
        lighthouse: the lighthouse address.
    """

    replica_group: int
    num_replica_groups: int
    attempt: int
    lighthouse: str


_manager: Manager | None = None
_replica: ReplicaInfo | None = None


def get_manager() -> Manager:
    """The :class:`~ftdist.manager.Manager` of this process (fault-tolerant launches).

    Raises:
        RuntimeError: the process was not launched with ``fault_tolerant=``,
            or the launched function has returned.
    """
    if _manager is None:
        raise RuntimeError(
            "no Manager in this process: get_manager() works inside a function launched "
            "with launch_subprocesses(..., fault_tolerant=True)"
        )
    return _manager


def get_replica_info() -> ReplicaInfo | None:
    """This process's replica group in a fault-tolerant launch; None otherwise."""
    return _replica


def _group_backend(specific: str | None, cfg: MultiprocessConfig) -> str | None:
    return specific if specific is not None else cfg.backend


def _initialize(cfg: MultiprocessConfig) -> None:
    init_dist(
        rank=cfg.rank,
        local_rank=cfg.local_rank,
        world_size=cfg.world_size,
        local_world_size=cfg.local_world_size,
        master_addr=cfg.master_addr,
        master_port=cfg.master_port,
        init_method=cfg.init_method,
        backend=cfg.backend,
    )
    init_parallelism(
        cfg.model_parallelism,
        cfg.pipeline_parallelism,
        mp_backend=_group_backend(cfg.model_parallel_backend, cfg),
        pp_backend=_group_backend(cfg.pipeline_parallel_backend, cfg),
        dp_backend=_group_backend(cfg.data_parallel_backend, cfg),
        local_rank=cfg.local_rank,
    )


def init_and_run(
    func: Callable[..., None], cfg: MultiprocessConfig, *args: Any, **kwargs: Any
) -> None:
    """Initialise torch.distributed and the parallel groups from ``cfg``, then run ``func``.

    ``cfg`` must be resolved and carry this process's ``rank`` and
    ``local_rank`` (the launcher sets them).

    Raises:
        RuntimeError: torch.distributed is initialized already, or the
            rendezvous failed.
        ValueError: the world size is not divisible by the parallelism.
        Exception: whatever ``func`` raises.
    """
    _initialize(cfg)
    func(*args, **kwargs)


def teardown() -> None:
    """Destroy the parallel groups and the default group this module built."""
    reset_parallelism()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_dist_info()


def _replica_pg(cfg: MultiprocessConfig, ft: FaultTolerance) -> Any:
    backend = _group_backend(cfg.data_parallel_backend, cfg) or ""
    if "nccl" in backend and torch.cuda.is_available():
        from ftdist.process_group import ProcessGroupNCCL

        return ProcessGroupNCCL(timeout=ft.timeout)
    from ftdist.process_group import ProcessGroupGloo

    return ProcessGroupGloo(timeout=ft.timeout)


def run_replica(
    func: Callable[..., None],
    cfg: MultiprocessConfig,
    replica: ReplicaInfo,
    ft: FaultTolerance,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Run ``func`` as one rank of one replica group, with a Manager for :func:`get_manager`.

    ``cfg`` describes the replica group (its ``world_size`` is the group's
    size, its ``rank`` the rank in the group, its store the group's).

    Raises:
        RuntimeError: torch.distributed could not be initialized.
        CoordinationError: the lighthouse is unreachable.
        Exception: whatever ``func`` raises.
    """
    global _manager, _replica
    # Manager keys live under the restart count, as under torchrun.
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(replica.attempt)
    _initialize(cfg)
    pg = _replica_pg(cfg, ft)
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=ft.min_replica_size,
        timeout=ft.timeout,
        quorum_timeout=ft.quorum_timeout,
        connect_timeout=ft.connect_timeout,
        rank=cfg.rank,
        world_size=cfg.world_size,
        store_addr=cfg.master_addr,
        store_port=cfg.master_port,
        lighthouse_addr=replica.lighthouse,
        replica_id=f"{ft.replica_id}{replica.replica_group}",
        hostname=cfg.master_addr,
    )
    _manager, _replica = manager, replica
    try:
        func(*args, **kwargs)
    finally:
        _manager, _replica = None, None
        manager.shutdown(wait=False)
        pg.shutdown()


__all__ = [
    "ReplicaInfo",
    "get_manager",
    "get_replica_info",
    "init_and_run",
    "run_replica",
    "teardown",
]
