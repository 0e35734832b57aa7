"""
Process groups
==============

Fault-tolerant process groups that are reconfigured and resized at runtime.
They extend ``torch.distributed.ProcessGroup`` and work wherever a standard
group does; since their size can change, do not cache ``rank()``/``size()``
across a :meth:`~ProcessGroup.configure`.

- :class:`ProcessGroupGloo`, :class:`ProcessGroupNCCL`: the backend runs in
  this process and is rebuilt on each configure.
- :class:`ProcessGroupBabyGloo`, :class:`ProcessGroupBabyNCCL`: the backend
  runs in a child process, so a hung or crashed backend is killed without
  taking the trainer down.
- :class:`ErrorSwallowingProcessGroupWrapper`, :class:`ManagedProcessGroup`,
  :class:`ProcessGroupDummy`: wrappers for fault-tolerant training code.
"""

from __future__ import annotations

from ftdist.process_group._store import create_store_client, parse_store_addr
from ftdist.process_group.baby import (
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)
from ftdist.process_group.base import ProcessGroup
from ftdist.process_group.device_mesh import extend_device_mesh
from ftdist.process_group.dummy import ProcessGroupDummy
from ftdist.process_group.error_swallowing import ErrorSwallowingProcessGroupWrapper
from ftdist.process_group.gloo import ProcessGroupGloo
from ftdist.process_group.managed import ManagedProcessGroup
from ftdist.process_group.nccl import ProcessGroupNCCL
from ftdist.process_group.work import CompletedWork
from ftdist.process_group.wrapper import ProcessGroupWrapper

__all__ = [
    "CompletedWork",
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "create_store_client",
    "extend_device_mesh",
    "parse_store_addr",
]
