"""
Launching processes
===================

ml-starter's ``ml.utils.torch_distributed`` launcher over ftdist (see
docs/launch.md)::

    from ftdist.launch import MultiprocessConfig, get_parallel_groups, launch_subprocesses

    def train() -> None:
        groups = get_parallel_groups()      # mp, pp, dp GroupCoordinators
        ...

    if __name__ == "__main__":
        launch_subprocesses(train, MultiprocessConfig(world_size=4, model_parallelism=2,
                                                      backend="gloo"))

``launch_subprocesses(..., fault_tolerant=True)`` runs every data-parallel
replica group under a Manager (:func:`get_manager`) and restarts a failed
group from a fork server that has already imported torch.

Modules:

* :mod:`~ftdist.launch.config`: ``MultiprocessConfig``, ``FaultTolerance``.
* :mod:`~ftdist.launch.layout`: pure: the model/pipeline/data-parallel layout.
* :mod:`~ftdist.launch.dist_env`: ``init_dist`` and the backend helpers.
* :mod:`~ftdist.launch.parallel`: the parallel groups as coordinators.
* :mod:`~ftdist.launch.alltoall`: the differentiable all-to-all.
* :mod:`~ftdist.launch.process`: ``init_and_run``; the Manager of a replica.
* :mod:`~ftdist.launch.launcher`: ``launch_subprocesses``.
* :mod:`~ftdist.launch.fault_tolerant`: replica groups under Managers.
* :mod:`~ftdist.launch.supervisor`, :mod:`~ftdist.launch.policy` (pure),
  :mod:`~ftdist.launch.children`: starting, watching, restarting children.
* :mod:`~ftdist.launch.ranks`: N ranks from the warm fork server (the
  demo, the benchmarks and the tests start their ranks with it).

Names are imported on first use, so ``import ftdist.launch`` does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_PORT": "config",
    "MISSING": "config",
    "FaultTolerance": "config",
    "MultiprocessConfig": "config",
    "ParallelLayout": "layout",
    "parallel_layout": "layout",
    "default_backend": "dist_env",
    "get_distributed_backend": "dist_env",
    "init_dist": "dist_env",
    "init_process_group_from_backend": "dist_env",
    "set_distributed_backend": "dist_env",
    "ParallelGroups": "parallel",
    "get_parallel_groups": "parallel",
    "init_parallelism": "parallel",
    "all_to_all": "alltoall",
    "ReplicaInfo": "process",
    "get_manager": "process",
    "get_replica_info": "process",
    "init_and_run": "process",
    "launch_subprocesses": "launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ftdist.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ftdist.launch.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
