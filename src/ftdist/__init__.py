"""
ftdist
======

Fault-tolerant, runtime-reconfigurable process groups and training primitives
for PyTorch, in pure Python.

Replica groups that fail drop out of the quorum at the next step; the survivors
reconfigure their process groups and keep stepping; a restarted replica heals
live from a healthy peer's memory.

The public API follows torchft's (replace ``torchft`` by ``ftdist`` in imports):
``from ftdist import Manager, DistributedDataParallel, Optimizer, ...`` gives
the names of both torchft generations' top-level package. They are loaded on
first use, so that ``import ftdist`` stays cheap and does not import torch.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ftdist.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    FtdistError,
    ProcessGroupAbortedError,
)

if TYPE_CHECKING:
    from ftdist.data import DistributedSampler
    from ftdist.ddp import DistributedDataParallel
    from ftdist.manager import Manager
    from ftdist.optim import OptimizerWrapper as Optimizer
    from ftdist.process_group import (
        ProcessGroupBabyGloo,
        ProcessGroupBabyNCCL,
        ProcessGroupBabyXCCL,
        ProcessGroupGloo,
        ProcessGroupNCCL,
        ProcessGroupXCCL,
    )

__version__ = "0.1.0"

# name -> (module, attribute): torchft's top-level names (both generations)
# and ProcessGroupBabyGloo, which torchft keeps in its process_group module.
_LAZY = {
    "DistributedDataParallel": ("ftdist.ddp", "DistributedDataParallel"),
    "DistributedSampler": ("ftdist.data", "DistributedSampler"),
    "Manager": ("ftdist.manager", "Manager"),
    "Optimizer": ("ftdist.optim", "OptimizerWrapper"),
    "ProcessGroupBabyGloo": ("ftdist.process_group", "ProcessGroupBabyGloo"),
    "ProcessGroupBabyNCCL": ("ftdist.process_group", "ProcessGroupBabyNCCL"),
    "ProcessGroupBabyXCCL": ("ftdist.process_group", "ProcessGroupBabyXCCL"),
    "ProcessGroupGloo": ("ftdist.process_group", "ProcessGroupGloo"),
    "ProcessGroupNCCL": ("ftdist.process_group", "ProcessGroupNCCL"),
    "ProcessGroupXCCL": ("ftdist.process_group", "ProcessGroupXCCL"),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ftdist' has no attribute {name!r}")
    module, attribute = target
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public names and the submodules imported so far, not this module's helpers.
    modules = {n for n, v in globals().items() if isinstance(v, ModuleType) and n[0] != "_"}
    return sorted({*__all__, *modules} - {"importlib"})


__all__ = [
    "CollectiveTimeoutError",
    "CommunicationError",
    "DistributedDataParallel",
    "DistributedSampler",
    "FtdistError",
    "Manager",
    "Optimizer",
    "ProcessGroupAbortedError",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
    "__version__",
]
