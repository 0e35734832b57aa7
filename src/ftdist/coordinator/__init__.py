"""
Group coordinators
==================

vLLM's ``GroupCoordinator`` over ftdist: one object owns all the
communication of a parallel group (tensor-, pipeline-, data-parallel),
on CPU and device, with vLLM's method names, signatures and return
conventions; plus vLLM's module functions (``init_distributed_environment``,
``initialize_model_parallel``, ``get_tp_group``, ...), the custom ops
``torch.ops.ftdist.*`` for compiled code, and the shared-memory
:class:`MessageQueue`.

A coordinator is built over either torch.distributed groups
(``"gloo"``/``"nccl"``, exactly as vLLM) or ftdist reconfigurable groups
(:class:`FtBackend`), and then it survives a member's death: operations in
flight fail promptly with :class:`~ftdist.CommunicationError` subclasses,
and :meth:`GroupCoordinator.reconfigure` rebuilds it for the survivors.

Invariants:

- **Collective calls.** Constructing a coordinator and every method of it
  is collective over its group (torch.distributed groups: over the whole
  world), called by every member in the same order.
- **Group ranks.** ``src``/``dst`` arguments are ranks within the group
  (0..world_size-1); ``ranks``, ``first_rank``, ``next_rank``, ... are
  global ranks.
- **Use the return value.** ``all_gather``, ``reduce_scatter`` and their
  ``v`` forms return new tensors; ``all_reduce`` may reduce in place (as
  vLLM's CPU path does) and returns the result; the custom ops, which
  compiled code runs, are out of place.
- **No silent hangs.** Misuse raises ``TypeError``/``ValueError`` before
  any communication; a dead peer makes a waiting call raise (ftdist groups
  and the message queue detect it; torch groups time out).

Example::

    from ftdist.coordinator import (get_tp_group, init_distributed_environment,
                                    initialize_model_parallel)

    init_distributed_environment(world_size=4, rank=rank,
                                 distributed_init_method="tcp://127.0.0.1:29500",
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    y = get_tp_group().all_reduce(x)
"""

from __future__ import annotations

from ftdist.coordinator.communicator import DeviceCommunicator
from ftdist.coordinator.group import GraphCaptureContext, GroupCoordinator
from ftdist.coordinator.groups import FtBackend
from ftdist.coordinator.message_queue import (
    Handle,
    MessageQueue,
    PeerGoneError,
    QueueShutdownError,
)
from ftdist.coordinator.mq_group import in_the_same_node_as
from ftdist.coordinator.ops import lookup_group
from ftdist.coordinator.parallel_state import (
    broadcast_tensor_dict,
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    graph_capture,
    init_distributed_environment,
    init_model_parallel_group,
    init_world_group,
    initialize_model_parallel,
    model_parallel_is_initialized,
    model_parallel_layout,
    reconfigure_model_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
    tensor_model_parallel_reduce_scatter,
)
from ftdist.coordinator.shm_ring import ShmRingBuffer
from ftdist.coordinator.tensor_dict import TensorMetadata

__all__ = [
    "DeviceCommunicator",
    "FtBackend",
    "GraphCaptureContext",
    "GroupCoordinator",
    "Handle",
    "MessageQueue",
    "PeerGoneError",
    "QueueShutdownError",
    "ShmRingBuffer",
    "TensorMetadata",
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
    "in_the_same_node_as",
    "init_distributed_environment",
    "init_model_parallel_group",
    "init_world_group",
    "initialize_model_parallel",
    "lookup_group",
    "model_parallel_is_initialized",
    "model_parallel_layout",
    "reconfigure_model_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter",
]
