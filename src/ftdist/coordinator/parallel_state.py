"""
The process's parallel groups: world, tensor-parallel, pipeline-parallel
=======================================================================

vLLM-style module state: one world :class:`GroupCoordinator` and, once
:func:`initialize_model_parallel` ran, one tensor-parallel and one
pipeline-parallel coordinator per process, reached through
:func:`get_world_group`, :func:`get_tp_group` and :func:`get_pp_group`.

Layout (as vLLM's): with ``N`` ranks, tensor-parallel size ``T`` and
pipeline size ``P`` (``N`` divisible by ``T*P``; the rest is data
parallelism), tensor-parallel groups are runs of ``T`` consecutive ranks and
pipeline groups take every ``T``-th rank. Eight ranks with ``T=2, P=4``:
TP ``[0,1] [2,3] [4,5] [6,7]``, PP ``[0,2,4,6] [1,3,5,7]``.

Two ways to start:

- ``init_distributed_environment(world_size, rank, "tcp://host:port",
  local_rank, backend="gloo"|"nccl")`` initialises torch.distributed (as
  vLLM does; NCCL falls back to Gloo where it is unavailable).
- ``backend="ftdist-gloo"`` or ``"ftdist-nccl"`` with
  ``distributed_init_method="host:port/prefix"`` (a TCPStore that outlives
  every rank) builds every group as an ftdist reconfigurable group, without
  a torch.distributed default group. After a death the survivors call
  :func:`reconfigure_model_parallel` with the new membership and layout.

Invariant: every process calls these functions in the same order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftdist.coordinator import config
from ftdist.coordinator.group import GraphCaptureContext, GroupCoordinator
from ftdist.coordinator.groups import FT_DEVICE_BACKENDS, FtBackend, own_group

logger = logging.getLogger(__name__)

_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None

FT_BACKEND_PREFIX = "ftdist-"
DEFAULT_FT_TIMEOUT = timedelta(seconds=60)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def model_parallel_layout(
    ranks: list[int], tensor_model_parallel_size: int, pipeline_model_parallel_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The tensor- and pipeline-parallel groups over ``ranks`` (vLLM's layout).

    Positions in ``ranks`` are laid out as ``(data, pipeline, tensor)``; the
    groups hold the ranks at those positions.

    Returns:
        ``(tp_groups, pp_groups)``.

    Raises:
        TypeError, ValueError: a size is not a positive int, or
            ``len(ranks)`` is not divisible by ``tp * pp``.
    """
    tp = _positive("tensor_model_parallel_size", tensor_model_parallel_size)
    pp = _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    n = len(ranks)
    if n % (tp * pp):
        raise ValueError(
            f"world size ({n}) is not divisible by tensor_model_parallel_size "
            f"({tp}) x pipeline_model_parallel_size ({pp})"
        )
    grid = torch.arange(n).reshape(-1, pp, tp)
    tp_groups = [[ranks[i] for i in row] for row in grid.reshape(-1, tp).tolist()]
    pp_groups = [[ranks[i] for i in row] for row in grid.transpose(1, 2).reshape(-1, pp).tolist()]
    return tp_groups, pp_groups


# -- accessors ----------------------------------------------------------------------
def get_world_group() -> GroupCoordinator:
    """The world coordinator.

    Raises:
        RuntimeError: :func:`init_distributed_environment` was not called.
    """
    if _WORLD is None:
        raise RuntimeError("world group is not initialized; call init_distributed_environment()")
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel coordinator.

    Raises:
        RuntimeError: :func:`initialize_model_parallel` was not called.
    """
    if _TP is None:
        raise RuntimeError(
            "tensor model parallel group is not initialized; call initialize_model_parallel()"
        )
    return _TP


def get_pp_group() -> GroupCoordinator:
    """This process's pipeline-parallel coordinator.

    Raises:
        RuntimeError: :func:`initialize_model_parallel` was not called.
    """
    if _PP is None:
        raise RuntimeError(
            "pipeline model parallel group is not initialized; call initialize_model_parallel()"
        )
    return _PP


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel group's size.

    Raises:
        RuntimeError: not initialized.
    """
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in its tensor-parallel group.

    Raises:
        RuntimeError: not initialized.
    """
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    """The pipeline group's size.

    Raises:
        RuntimeError: not initialized.
    """
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    """This process's stage in its pipeline group.

    Raises:
        RuntimeError: not initialized.
    """
    return get_pp_group().rank_in_group


def model_parallel_is_initialized() -> bool:
    """True once the tensor- and pipeline-parallel groups exist."""
    return _TP is not None and _PP is not None


# -- construction -------------------------------------------------------------------
def init_world_group(
    ranks: list[int], local_rank: int, backend: str | FtBackend
) -> GroupCoordinator:
    """The world coordinator over ``ranks`` (no device communicator, as in vLLM).

    Raises:
        See :class:`GroupCoordinator`.
    """
    return GroupCoordinator(
        [ranks], local_rank, backend, use_device_communicator=False, group_name="world"
    )


def init_model_parallel_group(
    group_ranks: list[list[int]],
    local_rank: int,
    backend: str | FtBackend,
    use_message_queue_broadcaster: bool = False,
    group_name: str | None = None,
    use_device_communicator: bool = True,
) -> GroupCoordinator:
    """A model-parallel coordinator (with a device communicator).

    Raises:
        See :class:`GroupCoordinator`.
    """
    return GroupCoordinator(
        group_ranks,
        local_rank,
        backend,
        use_device_communicator,
        use_message_queue_broadcaster,
        group_name,
    )


def _ft_store_addr(distributed_init_method: Any) -> str:
    if not isinstance(distributed_init_method, str):
        raise ValueError(
            "an ftdist backend needs distributed_init_method='host:port/prefix' (a "
            f"TCPStore that outlives the ranks), got {distributed_init_method!r}"
        )
    for scheme in ("ftdist://", "tcp://"):
        if distributed_init_method.startswith(scheme):
            return distributed_init_method[len(scheme) :]
    return distributed_init_method


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str | None = "env://",
    local_rank: int = -1,
    backend: str = "nccl",
    timeout: timedelta | None = None,
) -> None:
    """Initialise the world: torch.distributed (or ftdist groups) and the world coordinator.

    Args:
        world_size: number of processes (-1: from the init method/environment).
        rank: this process's rank (-1: from the init method/environment).
        distributed_init_method: torch's init method (``"env://"``,
            ``"tcp://host:port"``), or ``"host:port/prefix"`` for an ftdist
            backend.
        local_rank: device index on this host; -1 takes ``$LOCAL_RANK`` with
            ``env://`` and ``rank`` otherwise.
        backend: ``"nccl"`` (Gloo where NCCL is unavailable), ``"gloo"``, or
            ``"ftdist-gloo"``/``"ftdist-nccl"`` for reconfigurable groups.
        timeout: the collective timeout (ftdist default: 60 s).

    Raises:
        TypeError: ``backend`` is not a str.
        ValueError: a missing init method, an unknown ftdist backend, or an
            ftdist backend without an explicit ``world_size`` and ``rank``;
            a world of another size already initialised.
        RuntimeError: the process group could not be initialised.
    """
    global _WORLD
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {backend!r}")
    if backend.startswith(FT_BACKEND_PREFIX):
        device = backend[len(FT_BACKEND_PREFIX) :]
        if device not in FT_DEVICE_BACKENDS:
            raise ValueError(
                f"unknown ftdist backend {backend!r}; use one of "
                f"{[FT_BACKEND_PREFIX + d for d in sorted(FT_DEVICE_BACKENDS)]}"
            )
        _positive("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, {world_size}) with an ftdist backend, got {rank!r}"
            )
        spec = FtBackend(
            _ft_store_addr(distributed_init_method), rank, device, timeout or DEFAULT_FT_TIMEOUT
        )
        if local_rank == -1:
            local_rank = rank
        if _WORLD is None:
            _WORLD = init_world_group(list(range(world_size)), local_rank, spec)
        elif _WORLD.world_size != world_size:
            raise ValueError(
                f"world group already initialized with a different world size "
                f"({_WORLD.world_size}, not {world_size})"
            )
        return
    if not dist.is_initialized():
        if distributed_init_method is None:
            raise ValueError(
                "distributed_init_method must be given to initialise "
                "torch.distributed, e.g. 'env://' or 'tcp://host:port'"
            )
        if not dist.is_backend_available(backend):
            logger.warning("distributed backend %s is not available; falling back to gloo", backend)
            backend = "gloo"
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            **kwargs,
        )
    if local_rank == -1:
        if distributed_init_method == "env://":
            local_rank = config.local_rank()
        else:
            local_rank = dist.get_rank()
    if _WORLD is None:
        _WORLD = init_world_group(
            list(range(dist.get_world_size())), local_rank, str(dist.get_backend())
        )
    elif _WORLD.world_size != dist.get_world_size():
        raise ValueError("world group already initialized with a different world size")


def _model_parallel_backend(world: GroupCoordinator, backend: str | None) -> str | FtBackend:
    spec = world._ft
    if spec is None:
        return backend or str(dist.get_backend(world.device_group))
    if backend is None:
        return spec
    device = backend[len(FT_BACKEND_PREFIX) :] if backend.startswith(FT_BACKEND_PREFIX) else backend
    return replace(spec, device=device)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    backend: str | None = None,
) -> None:
    """Build the tensor- and pipeline-parallel coordinators (collective).

    The tensor-parallel coordinator gets a message-queue broadcaster (its
    ``broadcast_object`` from rank 0 goes through shared memory).

    Args:
        tensor_model_parallel_size: ranks per tensor-parallel group.
        pipeline_model_parallel_size: stages per pipeline.
        backend: the device backend; default: the world's.

    Raises:
        RuntimeError: the world is not initialised, or the groups already are.
        ValueError: the world size is not divisible by ``tp * pp``.
    """
    global _TP, _PP
    world = get_world_group()
    if _TP is not None:
        raise RuntimeError("tensor model parallel group is already initialized")
    if _PP is not None:
        raise RuntimeError("pipeline model parallel group is already initialized")
    tp_groups, pp_groups = model_parallel_layout(
        world.ranks, tensor_model_parallel_size, pipeline_model_parallel_size
    )
    chosen = _model_parallel_backend(world, backend)
    _TP = init_model_parallel_group(
        tp_groups, world.local_rank, chosen, use_message_queue_broadcaster=True, group_name="tp"
    )
    _PP = init_model_parallel_group(pp_groups, world.local_rank, chosen, group_name="pp")


def ensure_model_parallel_initialized(
    tensor_model_parallel_size: int, pipeline_model_parallel_size: int, backend: str | None = None
) -> None:
    """:func:`initialize_model_parallel` unless done; then check the sizes.

    Raises:
        ValueError: the groups exist with other sizes.
    """
    if not model_parallel_is_initialized():
        initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, backend)
        return
    if get_tensor_model_parallel_world_size() != tensor_model_parallel_size:
        raise ValueError(
            f"tensor parallel group already initialized, but of unexpected size: "
            f"{get_tensor_model_parallel_world_size()} vs. "
            f"{tensor_model_parallel_size}"
        )
    if get_pipeline_model_parallel_world_size() != pipeline_model_parallel_size:
        raise ValueError(
            f"pipeline parallel group already initialized, but of unexpected size: "
            f"{get_pipeline_model_parallel_world_size()} vs. "
            f"{pipeline_model_parallel_size}"
        )


def reconfigure_model_parallel(
    store_addr: str,
    ranks: list[int],
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
) -> None:
    """Rebuild the world, TP and PP coordinators for the survivors ``ranks`` (ftdist only).

    Every process in ``ranks`` calls it with the same arguments; the
    coordinators are the same objects, rebuilt in place, with the new
    layout over ``ranks`` (in their order).

    Raises:
        TypeError: the groups were not built with an ftdist backend.
        RuntimeError: :func:`initialize_model_parallel` was not called.
        ValueError: ``ranks`` lacks this process, or its length is not
            divisible by ``tp * pp``.
    """
    world = get_world_group()
    tp_group, pp_group = get_tp_group(), get_pp_group()
    if not world.is_reconfigurable:
        raise TypeError(
            "reconfigure_model_parallel needs groups built with an ftdist backend "
            "(init_distributed_environment(..., backend='ftdist-gloo'))"
        )
    tp_groups, pp_groups = model_parallel_layout(
        list(ranks), tensor_model_parallel_size, pipeline_model_parallel_size
    )
    own_group([list(ranks)], world.rank)
    world.reconfigure(store_addr, list(ranks))
    tp_group.reconfigure(store_addr, own_group(tp_groups, world.rank))
    pp_group.reconfigure(store_addr, own_group(pp_groups, world.rank))


# -- teardown -------------------------------------------------------------------------
def destroy_model_parallel() -> None:
    """Destroy the tensor- and pipeline-parallel coordinators."""
    global _TP, _PP
    for group in (_TP, _PP):
        if group is not None:
            group.destroy()
    _TP = _PP = None


def destroy_distributed_environment() -> None:
    """Destroy the world coordinator and torch.distributed's default group."""
    global _WORLD
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def graph_capture(device: torch.device) -> Iterator[GraphCaptureContext]:
    """Capture CUDA graphs for the TP and PP groups on one stream; a no-op without CUDA.

    Yields:
        The shared :class:`GraphCaptureContext`.

    Raises:
        RuntimeError: the model-parallel groups are not initialised.
    """
    use_cuda = torch.cuda.is_available() and torch.device(device).type == "cuda"
    context = GraphCaptureContext(torch.cuda.Stream(device=device) if use_cuda else None)
    with get_tp_group().graph_capture(context), get_pp_group().graph_capture(context):
        yield context


# -- vLLM's communication_op wrappers ------------------------------------------------------
def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """``get_tp_group().all_reduce(input_)``.

    Raises:
        RuntimeError: not initialised.
    """
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``get_tp_group().all_gather(input_, dim)``.

    Raises:
        RuntimeError: not initialised.
    """
    return get_tp_group().all_gather(input_, dim)


def tensor_model_parallel_reduce_scatter(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``get_tp_group().reduce_scatter(input_, dim)``.

    Raises:
        RuntimeError: not initialised.
    """
    return get_tp_group().reduce_scatter(input_, dim)


def tensor_model_parallel_gather(
    input_: torch.Tensor, dst: int = 0, dim: int = -1
) -> torch.Tensor | None:
    """``get_tp_group().gather(input_, dst, dim)``.

    Raises:
        RuntimeError: not initialised.
    """
    return get_tp_group().gather(input_, dst, dim)


def broadcast_tensor_dict(
    tensor_dict: dict[Any, Any] | None = None, src: int = 0
) -> dict[Any, Any] | None:
    """``get_tp_group().broadcast_tensor_dict``; the dict itself without torch.distributed.

    Raises:
        RuntimeError: torch.distributed is initialised but the groups are not.
    """
    if _TP is None and not dist.is_initialized():
        return tensor_dict
    return get_tp_group().broadcast_tensor_dict(tensor_dict, src)


__all__ = [
    "broadcast_tensor_dict",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "ensure_model_parallel_initialized",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "graph_capture",
    "init_distributed_environment",
    "init_model_parallel_group",
    "init_world_group",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "model_parallel_layout",
    "reconfigure_model_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter",
]
