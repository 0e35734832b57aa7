"""
XCCL (Intel XPU)
================

:class:`ProcessGroupXCCL`: torch's XCCL backend in this process, rebuilt on
every :meth:`~ftdist.process_group.ProcessGroup.configure`, like
:class:`~ftdist.process_group.ProcessGroupNCCL` for CUDA. It needs an Intel
XPU and a torch build with XCCL; elsewhere the group still constructs (so
code that picks a group by device imports and builds it everywhere) and
``configure`` fails at once, before any connection, naming the fix.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup

from ftdist.process_group.base import ProcessGroup
from ftdist.process_group.nccl import AcceleratorGroup

_FIX = (
    "install torch's XPU build on a machine with an Intel GPU "
    "(pip install torch --index-url https://download.pytorch.org/whl/xpu), or use "
    "ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) instead"
)


def xccl_unavailable() -> str | None:
    """Why XCCL cannot run here, or None if it can."""
    is_available = getattr(dist, "is_xccl_available", None)
    if is_available is None or not is_available():
        return "this torch build has no XCCL (torch.distributed.is_xccl_available() is False)"
    if not torch.xpu.is_available():
        return "no Intel XPU is available (torch.xpu.is_available() is False)"
    return None


def check_xccl(group: str) -> None:
    """Raise a clear error if XCCL cannot run here.

    Raises:
        RuntimeError: naming the reason and the fix.
    """
    reason = xccl_unavailable()
    if reason is not None:
        raise RuntimeError(
            f"{group} needs an Intel XPU and a torch build with XCCL: {reason}; {_FIX}"
        )


def create_xccl_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """An XCCL backend, connected eagerly on the current XPU.

    Raises:
        RuntimeError: XCCL or an XPU is unavailable, or peers did not arrive.
    """
    check_xccl("an XCCL group")
    backend_class = c10d.ProcessGroupXCCL
    opts = backend_class.Options()
    opts._timeout = timeout
    backend = backend_class(store, rank, world_size, opts)
    if hasattr(backend, "_set_sequence_number_for_group"):
        backend._set_sequence_number_for_group()
    if hasattr(backend, "eager_connect_single_device"):
        backend.eager_connect_single_device(torch.device("xpu", torch.xpu.current_device()))
    return backend


class ProcessGroupXCCL(AcceleratorGroup):
    """A reconfigurable XCCL group, for Intel XPUs.

    Reconfiguring aborts the old communicator; work waits order the current
    XPU stream. Constructs on any machine; ``configure`` raises where torch
    has no XPU support.

    Args:
        pg: an existing group to wrap instead of creating XCCL communicators
            (``ProcessGroupXCCL(timedelta(...))`` also works: the first
            positional argument is read by its type).
        timeout: the collective timeout.

    Raises:
        TypeError: ``pg`` is not a process group or ``timeout`` not a duration.
        RuntimeError: at configure, if there is no XPU or no XCCL.
    """

    def __init__(
        self,
        pg: BaseProcessGroup | timedelta | float | None = None,
        timeout: timedelta | float | BaseProcessGroup | None = None,
    ) -> None:
        super().__init__(pg=pg, timeout=timeout)

    def getBackendName(self) -> str:
        """``"ftdist-xccl"``."""
        return "ftdist-xccl"

    def _native_avg(self) -> bool:
        return False  # emulated as SUM + division, which every XCCL version supports

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """See :meth:`ProcessGroupWrapper.configure`.

        Raises:
            RuntimeError: there is no XPU or no XCCL here (before any
                connection), or the backend could not be created.
            ValueError: malformed ``store_addr`` or invalid rank/world size.
        """
        if not isinstance(self._pg, ProcessGroup) and not self._static:
            check_xccl(type(self).__name__)
        super().configure(store_addr, rank, world_size)

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> BaseProcessGroup:
        backend: BaseProcessGroup = create_xccl_backend(store, rank, world_size, self._timeout)
        return backend


__all__ = ["ProcessGroupXCCL", "check_xccl", "create_xccl_backend", "xccl_unavailable"]
