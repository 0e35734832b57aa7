"""Creating torch's native backends; shared by in-process and Baby groups."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def create_gloo_backend(store: dist.Store, rank: int, world_size: int,
                        timeout: timedelta) -> Any:
    """A Gloo backend built as ``torch.distributed`` builds its own.

    Raises:
        RuntimeError: peers did not all arrive within ``timeout``.
    """
    from torch._C._distributed_c10d import ProcessGroupGloo as GlooBackend

    backend = GlooBackend(store, rank, world_size, timeout)
    backend._set_sequence_number_for_group()
    return backend


def create_nccl_backend(store: dist.Store, rank: int, world_size: int,
                        timeout: timedelta) -> Any:
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


CREATORS = {"gloo": create_gloo_backend, "nccl": create_nccl_backend}
