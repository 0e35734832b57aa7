"""
Initialising torch.distributed in a launched process
====================================================

ml-starter's ``init_dist`` family: :func:`init_dist` records the process's
place in the job (and exports it as ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``INIT_METHOD``), then :func:`init_process_group_from_backend` creates the
default group and runs a warm-up all-reduce. The backend comes from
:func:`get_distributed_backend`: ``$TORCH_DISTRIBUTED_BACKEND`` if set (see
:func:`set_distributed_backend`), else ``nccl`` with CUDA, else ``gloo``.

Differences from ml-starter, on purpose: calling :func:`init_dist` again
with the same values is not an error (ml-starter's setters refuse a value
already set), but initialising an initialised default group is; a CUDA
device is picked by the local rank, not the global one; the module's
record is read back with :func:`dist_info`.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKEND_ENV = "TORCH_DISTRIBUTED_BACKEND"


@dataclass(frozen=True)
class DistInfo:
    """What :func:`init_dist` recorded about this process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    init_method: str


_info: DistInfo | None = None


def dist_info() -> DistInfo | None:
    """The values of the last :func:`init_dist` in this process, or None."""
    return _info


def forget_dist_info() -> None:
    """Drop what :func:`init_dist` recorded (after the default group is destroyed)."""
    global _info
    _info = None


@functools.lru_cache
def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def get_distributed_backend() -> dist.Backend:
    """``$TORCH_DISTRIBUTED_BACKEND`` if set, else :func:`default_backend`.

    Raises:
        ValueError: the variable names a backend torch does not know.
    """
    name = os.environ.get(BACKEND_ENV) or default_backend()
    try:
        return dist.Backend(name)
    except ValueError as exc:
        raise ValueError(
            f"{BACKEND_ENV}={name!r} is not a torch.distributed backend: {exc}"
        ) from exc


def set_distributed_backend(backend: str) -> None:
    """Make ``backend`` the default (``$TORCH_DISTRIBUTED_BACKEND``); children inherit it.

    Raises:
        TypeError: ``backend`` is not a non-empty str.
    """
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a backend name such as 'gloo', got {backend!r}")
    os.environ[BACKEND_ENV] = backend


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def init_process_group_from_backend(backend: str | dist.Backend | None = None) -> None:
    """Create torch.distributed's default group for this process, then warm it up.

    The rank, world size and ``init_method`` are those :func:`init_dist`
    recorded, else ``RANK``, ``WORLD_SIZE`` and ``INIT_METHOD`` from the
    environment (``env://`` by default). With CUDA, the device is
    ``local_rank % device_count``. A one-element all-reduce checks that
    every rank is reachable before returning.

    Raises:
        RuntimeError: the default group already exists, or it could not be
            created (torch's error, e.g. a rendezvous timeout).
        ValueError: a rank variable in the environment is not an integer.
    """
    backend = str(backend or get_distributed_backend())
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process; call "
            "torch.distributed.destroy_process_group() before initializing it again"
        )
    if _info is not None:
        rank, local_rank, world_size = _info.rank, _info.local_rank, _info.world_size
        init_method = _info.init_method
    else:
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", rank)
        world_size = _env_int("WORLD_SIZE", 1)
        init_method = os.environ.get("INIT_METHOD") or "env://"
    logger.info(
        "rank %d of %d: initializing the %s process group (%s)",
        rank,
        world_size,
        backend,
        init_method,
    )
    dist.init_process_group(
        backend=backend, init_method=init_method, world_size=world_size, rank=rank
    )
    use_cuda = torch.cuda.is_available() and "nccl" in backend
    if use_cuda:
        torch.cuda.set_device(max(local_rank, 0) % torch.cuda.device_count())
    dist.all_reduce(torch.zeros(1, device="cuda" if use_cuda else "cpu"))
    logger.debug("rank %d: warm-up all-reduce succeeded", rank)


def init_dist(
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    master_addr: str,
    master_port: int,
    init_method: str,
    backend: str | dist.Backend | None = None,
) -> None:
    """Record this process's place in the job, export it, and create the default group.

    Args:
        rank: the rank of this process.
        local_rank: its rank on this machine.
        world_size: processes in the job.
        local_world_size: processes per machine.
        master_addr: the rendezvous host.
        master_port: the rendezvous port.
        init_method: ``init_process_group``'s ``init_method`` (``env://``
            reads the two above from the environment this sets).
        backend: the backend; None means :func:`get_distributed_backend`.

    Raises:
        TypeError: a rank, size or port is not an int.
        ValueError: ``rank`` is outside ``range(world_size)``.
        RuntimeError: the default group exists already, or could not be created.
    """
    global _info
    for name, value in (
        ("rank", rank),
        ("local_rank", local_rank),
        ("world_size", world_size),
        ("local_world_size", local_world_size),
        ("master_port", master_port),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    _info = DistInfo(
        rank, local_rank, world_size, local_world_size, master_addr, master_port, init_method
    )
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "INIT_METHOD": init_method,
        }
    )
    init_process_group_from_backend(backend)


__all__ = [
    "DistInfo",
    "default_backend",
    "dist_info",
    "forget_dist_info",
    "get_distributed_backend",
    "init_dist",
    "init_process_group_from_backend",
    "set_distributed_backend",
]
