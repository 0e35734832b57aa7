"""
Gloo
====

:class:`ProcessGroupGloo`: a Gloo backend in this process, rebuilt on every
:meth:`~ftdist.process_group.ProcessGroup.configure`. Gloo runs on CPU
tensors (and CUDA tensors, staged through the host); ftdist emulates the
``AVG`` reduction Gloo lacks.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup

from ftdist.process_group.wrapper import DEFAULT_TIMEOUT, ProcessGroupWrapper


def create_gloo_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A Gloo backend built as ``torch.distributed`` builds its own.

    Raises:
        RuntimeError: peers did not all arrive within ``timeout``.
    """
    from torch._C._distributed_c10d import ProcessGroupGloo as GlooBackend

    backend = GlooBackend(store, rank, world_size, timeout)
    backend._set_sequence_number_for_group()
    return backend


class ProcessGroupGloo(ProcessGroupWrapper):
    """A reconfigurable Gloo group.

    Args:
        timeout: the collective timeout; a dead or stopped peer makes waits
            raise within it (plus a small margin).

    Raises:
        TypeError: ``timeout`` is not a timedelta or a number of seconds.
        ValueError: ``timeout`` is not positive.
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)

    def getBackendName(self) -> str:
        """``"ftdist-gloo"``."""
        return "ftdist-gloo"

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> BaseProcessGroup:
        backend: BaseProcessGroup = create_gloo_backend(store, rank, world_size, self._timeout)
        return backend


__all__ = ["ProcessGroupGloo", "create_gloo_backend"]
