"""
NCCL
====

:class:`ProcessGroupNCCL`: an NCCL communicator in this process, rebuilt on
every :meth:`~ftdist.process_group.ProcessGroup.configure`. Tearing one down
aborts it (``ncclCommAbort``), the only thing that unblocks kernels waiting
on a dead peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup

from ftdist.process_group.base import Post, ProcessGroup
from ftdist.process_group.work import FtWork, Generation
from ftdist.process_group.wrapper import ProcessGroupWrapper

logger = logging.getLogger(__name__)


def create_nccl_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """An NCCL backend, connected eagerly on the current CUDA device.

    Connecting eagerly keeps NCCL's communicator init out of the first
    collective, which would otherwise run after the quorum has declared the
    group ready.

    Raises:
        RuntimeError: CUDA or NCCL is unavailable, or peers did not arrive.
    """
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise RuntimeError("an NCCL group needs CUDA and an NCCL-enabled torch build")
    from torch._C._distributed_c10d import ProcessGroupNCCL as NCCLBackend

    opts = NCCLBackend.Options()
    opts._timeout = timeout
    backend = NCCLBackend(store, rank, world_size, opts)
    backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    return backend


class AcceleratorGroup(ProcessGroupWrapper):
    """What NCCL and XCCL groups share: aborting communicators, stream-ordered waits.

    Tearing a communicator down aborts it (``ncclCommAbort`` and its XCCL
    counterpart), the only thing that unblocks kernels waiting on a dead
    peer; work waits order the current device stream, as torch's do.
    """

    def _native_avg(self) -> bool:
        return True

    def _wrap(self, work: Any, gen: Generation, op: str, post: Post) -> dist.Work:
        return _NCCLWork(work, gen, op, post)

    def abort(self) -> None:
        """Abort the communicator so stuck kernels exit; configure to resume."""
        backend = self._pg
        super().abort()
        if not isinstance(backend, ProcessGroup) and not self._static:
            _abort_communicator(backend)

    def _bury(self, backend: Any, busy: Callable[[], bool]) -> None:
        _abort_communicator(backend)
        super()._bury(backend, busy)


class ProcessGroupNCCL(AcceleratorGroup):
    """A reconfigurable NCCL group.

    Reconfiguring aborts the old communicator (``ncclCommAbort``), which
    unblocks kernels waiting on a dead peer. Work waits only block the current
    CUDA stream, as with torch's NCCL group; a watchdog aborts the
    communicator when a wait exceeds the timeout.

    ``ProcessGroupNCCL(timedelta(seconds=30))`` (today's torchft) and
    ``ProcessGroupNCCL(pg)`` (the early-2025 one) both work: the first
    positional argument is read by its type.

    Args:
        pg: an existing group to wrap instead of creating NCCL communicators.
        timeout: the collective timeout.

    Raises:
        TypeError: ``pg`` is not a process group or ``timeout`` not a duration.
        RuntimeError: at configure, if CUDA or NCCL is unavailable.
    """

    def __init__(
        self,
        pg: BaseProcessGroup | timedelta | float | None = None,
        timeout: timedelta | float | BaseProcessGroup | None = None,
    ) -> None:
        super().__init__(pg=pg, timeout=timeout)

    def getBackendName(self) -> str:
        """``"ftdist-nccl"``."""
        return "ftdist-nccl"

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> BaseProcessGroup:
        backend: BaseProcessGroup = create_nccl_backend(store, rank, world_size, self._timeout)
        return backend


def _abort_communicator(backend: Any) -> None:
    # ncclCommAbort is what unblocks kernels stuck on a dead peer; unlike
    # Gloo's abort it does not wait for the op to finish.
    if backend is None:
        return
    try:
        backend.abort()
    except Exception:
        logger.warning("NCCL abort failed", exc_info=True)


class _NCCLWork(FtWork):
    """NCCL work: ``wait`` orders the current stream, as torch's does.

    It does not block the CPU, so there is nothing to time out here: a hung
    communicator is aborted by NCCL's own watchdog (the group's timeout) or
    by the Manager on failure news, via :meth:`ProcessGroupNCCL.abort`.
    """

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._gen.error is not None:
            raise self._gen.error
        try:
            ok = bool(self._inner.wait(timeout) if timeout else self._inner.wait())
        except Exception as exc:
            raise self._fail(exc) from exc
        self._run_post()
        return ok


__all__ = ["AcceleratorGroup", "ProcessGroupNCCL", "create_nccl_backend"]
