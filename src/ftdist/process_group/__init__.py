"""
Process groups
==============

Fault-tolerant process groups that are reconfigured and resized at runtime.
They extend ``torch.distributed.ProcessGroup`` and work wherever a standard
group does; since their size can change, do not cache ``rank()``/``size()``
across a :meth:`~ProcessGroup.configure`.

- :class:`ProcessGroupGloo`, :class:`ProcessGroupNCCL`,
  :class:`ProcessGroupXCCL`: the backend runs in this process and is rebuilt
  on each configure.
- :class:`ProcessGroupBabyGloo`, :class:`ProcessGroupBabyNCCL`,
  :class:`ProcessGroupBabyXCCL`: the backend runs in a child process, so a
  hung or crashed backend is killed without taking the trainer down.
- :class:`ErrorSwallowingProcessGroupWrapper`, :class:`ManagedProcessGroup`,
  :class:`ProcessGroupDummy`, :class:`FakeProcessGroupWrapper`: wrappers for
  fault-tolerant training code and its tests.

- :func:`extend_device_mesh` and :func:`ft_init_device_mesh` (a
  :class:`ManagedDeviceMesh`) put a fault-tolerant group into a DeviceMesh,
  for FSDP2/HSDP.

Every group is reconfigured either with ``configure(store_addr, rank,
world_size)`` (torchft's early-2025 API) or with today's
``reconfigure(ReconfigureOptions)`` / :func:`reconfigure_with_store`.
"""

from __future__ import annotations

from torch.distributed import PrefixStore, TCPStore

from ftdist.process_group._store import create_store_client, parse_store_addr
from ftdist.process_group.baby import (
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
)
from ftdist.process_group.base import ProcessGroup
from ftdist.process_group.device_mesh import extend_device_mesh
from ftdist.process_group.dummy import ProcessGroupDummy
from ftdist.process_group.error_swallowing import (
    ErrorSwallowingProcessGroupWrapper,
    _ErrorSwallowingWork,
)
from ftdist.process_group.fake import FakeProcessGroupWrapper
from ftdist.process_group.gloo import ProcessGroupGloo
from ftdist.process_group.managed import ManagedProcessGroup, ReportingWork
from ftdist.process_group.managed_mesh import (
    ManagedDeviceMesh,
    _FlattenDeviceMesh,
    ft_init_device_mesh,
)
from ftdist.process_group.nccl import ProcessGroupNCCL
from ftdist.process_group.reconfigure import (
    ReconfigureOptions,
    Rendezvous,
    reconfigure_with_store,
    rendezvous,
)
from ftdist.process_group.work import CompletedWork
from ftdist.process_group.wrapper import ProcessGroupWrapper
from ftdist.process_group.xccl import ProcessGroupXCCL

# torchft 2025's name (torchft.process_group._ManagedWork).
_ManagedWork = ReportingWork
# torchft's name for CompletedWork (also ftdist.work._DummyWork: the same class).
_DummyWork = CompletedWork
# torchft's private names for reading a rendezvous from reconfigure handles.
_rendezvous = rendezvous
_Rendezvous = Rendezvous

__all__ = [
    "CompletedWork",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedDeviceMesh",
    "ManagedProcessGroup",
    "PrefixStore",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "ProcessGroupXCCL",
    "ReconfigureOptions",
    "TCPStore",
    "_DummyWork",
    "_ErrorSwallowingWork",
    "_FlattenDeviceMesh",
    "_ManagedWork",
    "create_store_client",
    "extend_device_mesh",
    "ft_init_device_mesh",
    "parse_store_addr",
    "reconfigure_with_store",
]
