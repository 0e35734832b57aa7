"""
GroupCoordinator: all the communication of one parallel group
==============================================================

A :class:`GroupCoordinator` owns a group's communication on CPU and device,
with vLLM's API and semantics: tensor collectives, object broadcast,
point-to-point, tensor dictionaries and the shared-memory broadcaster.
Built over ftdist groups (:class:`~ftdist.coordinator.FtBackend`) it also
survives a member's death: operations in flight fail with ftdist's errors
and :meth:`GroupCoordinator.reconfigure` rebuilds it for the survivors.

Invariants:

- ``ranks`` lists the group's global ranks; a rank's position in it is its
  ``rank_in_group``, and every ``src``/``dst`` argument is such a position.
- Every method is a collective (or a matched send/receive): all members
  call it, in the same order.
- A group of one returns its inputs as vLLM does (``all_reduce``,
  ``all_gather``, ``reduce_scatter``, ``gather``, ``broadcast``,
  ``broadcast_object``, ``broadcast_object_list``, ``broadcast_tensor_dict``
  and ``send_tensor_dict`` return them; ``recv_tensor_dict`` returns None);
  the operations that need a device communicator (``all_gatherv``,
  ``reduce_scatterv``, ``send``, ``recv``, the ``_*_out_place`` methods)
  raise ``ValueError`` without one, as in vLLM.
- Bad arguments raise ``TypeError``/``ValueError`` before any communication.

This module has the construction, the tensor collectives and the lifetime;
objects, point-to-point and tensor dictionaries are in ``group_messages.py``,
membership and shared checks in ``group_core.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from ftdist.coordinator import failures, ops
from ftdist.coordinator.communicator import (
    DeviceCommunicator,
    check_tensor,
    normalize_dim,
)
from ftdist.coordinator.group_core import MQ_CHUNK_BYTES, MQ_CHUNKS, reports_failures
from ftdist.coordinator.group_messages import GroupMessaging
from ftdist.coordinator.groups import (
    FtBackend,
    check_group_ranks,
    configure_ft_groups,
    new_ft_groups,
    new_torch_groups,
    own_group,
    require_torch_distributed,
)
from ftdist.coordinator.message_queue import MessageQueue


@dataclass
class GraphCaptureContext:
    """The stream a CUDA graph is captured on; ``stream`` is None without CUDA."""

    stream: Any


def _device_for(backend: str, local_rank: int) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class GroupCoordinator(GroupMessaging):
    """The communication of one group of processes, on CPU and device.

    Args:
        group_ranks: every group of this kind, as lists of global ranks
            (e.g. all tensor-parallel groups ``[[0, 1], [2, 3]]``); this
            process joins the one that holds its rank.
        local_rank: the device index on this host (``cuda:{local_rank}``).
        torch_distributed_backend: ``"gloo"``/``"nccl"`` for groups made with
            ``dist.new_group`` (needs an initialized default group; every
            process builds every group, in the same order), or an
            :class:`FtBackend` for ftdist reconfigurable groups (only members
            take part; :meth:`reconfigure` works).
        use_device_communicator: build the device communicator, which the
            tensor collectives need (vLLM's world group has none).
        use_message_queue_broadcaster: broadcast objects from rank 0 through
            a shared-memory :class:`MessageQueue` (collective at construction).
        group_name: base of :attr:`unique_name` (``"tp"`` gives ``"tp:0"``).
        timeout: collective timeout of torch.distributed groups (ftdist groups
            take theirs from the :class:`FtBackend`); also bounds waits on the
            message queue.

    Raises:
        TypeError: malformed ``group_ranks``, ``local_rank`` or backend.
        ValueError: this rank is in no group (or ranks repeat); a torch group
            is not sorted.
        RuntimeError: a torch backend without an initialized default group,
            or groups that could not be built.
    """

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str | FtBackend,
        use_device_communicator: bool,
        use_message_queue_broadcaster: bool = False,
        group_name: str | None = None,
        *,
        timeout: timedelta | None = None,
    ) -> None:
        group_ranks = check_group_ranks(group_ranks)
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
            raise TypeError(f"local_rank must be a non-negative int, got {local_rank!r}")
        if group_name is not None and (not isinstance(group_name, str) or not group_name):
            raise TypeError(f"group_name must be a non-empty str or None, got {group_name!r}")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
        self.unique_name = ops.get_unique_name(group_name or "anonymous")
        self.local_rank = local_rank
        self.destroyed = False
        self.use_device_communicator = bool(use_device_communicator)
        self.use_message_queue_broadcaster = bool(use_message_queue_broadcaster)
        # Custom ops are used when torch.compile traces a call (see ops.py);
        # eager calls skip the dispatcher.
        self.use_custom_op_call = True
        self.use_cpu_custom_send_recv = False
        self.device_communicator = None
        self.mq_broadcaster = None
        self._watch = None
        if isinstance(torch_distributed_backend, FtBackend):
            spec = torch_distributed_backend
            self._ft = spec
            self.rank = spec.rank
            self.backend = spec.device
            self.timeout = spec.timeout
            ranks = own_group(group_ranks, spec.rank)
            self.device_group, self.cpu_group = new_ft_groups(spec)
            try:
                configure_ft_groups(
                    self.device_group,
                    self.cpu_group,
                    spec.store_addr,
                    self.unique_name,
                    ranks,
                    spec.rank,
                )
            except BaseException:
                self.device_group.shutdown()
                self.cpu_group.shutdown()
                raise
            if spec.failure_news:
                self._watch = failures.watch(spec.store_addr, spec.timeout, self)
        elif isinstance(torch_distributed_backend, str):
            self._ft = None
            self.backend = str(torch_distributed_backend)
            self.timeout = timeout
            require_torch_distributed(self.backend)
            self.rank = dist.get_rank()
            ranks, self.device_group, self.cpu_group = new_torch_groups(
                group_ranks, self.rank, self.backend, timeout
            )
        else:
            raise TypeError(
                "torch_distributed_backend must be 'gloo', 'nccl' (torch.distributed "
                "groups) or an FtBackend (ftdist groups), got "
                f"{torch_distributed_backend!r}"
            )
        self._set_members(ranks)
        self.device = _device_for(self.backend, local_rank)
        self._build_communication()
        ops.register_group(self)

    def _build_communication(self) -> None:
        if self.use_device_communicator and self.world_size > 1:
            self.device_communicator = DeviceCommunicator(
                self.cpu_group,
                self.device,
                self.device_group,
                self.unique_name,
                self.rank_in_group,
                self.world_size,
            )
        if self.use_message_queue_broadcaster and self.world_size > 1:
            self.mq_broadcaster = MessageQueue.create_from_process_group(
                self.cpu_group, MQ_CHUNK_BYTES, MQ_CHUNKS, timeout=self._timeout_s() or 60.0
            )

    # -- tensor collectives ---------------------------------------------------------
    @reports_failures
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of ``input_`` over the group; use the return value.

        As in vLLM, callers must rely on neither ``input_`` being modified nor
        it staying the same: in eager mode the sum is computed in place in a
        contiguous ``input_`` (vLLM's CPU path does the same), and under
        ``torch.compile`` it runs as the out-of-place custom op
        ``torch.ops.ftdist.all_reduce``. A group of one returns ``input_``.

        Raises:
            TypeError: ``input_`` is not a tensor.
            ValueError: no device communicator (see the class docstring).
        """
        check_tensor(input_)
        if self.world_size == 1:
            return input_
        if torch.compiler.is_compiling():
            return cast(
                torch.Tensor, torch.ops.ftdist.all_reduce(input_, group_name=self.unique_name)
            )
        return self._communicator().all_reduce(input_)

    @reports_failures
    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum over the group as a new tensor; ``input_`` is left alone (what the op runs).

        Raises:
            ValueError: no device communicator.
        """
        return self._communicator().all_reduce(input_.clone())

    @reports_failures
    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim``, in rank order.

        Raises:
            TypeError: ``input_`` is not a tensor.
            ValueError: invalid ``dim``, or no device communicator.
        """
        check_tensor(input_)
        if self.world_size == 1:
            return input_
        normalize_dim(input_, dim)
        if torch.compiler.is_compiling():
            return cast(
                torch.Tensor,
                torch.ops.ftdist.all_gather(
                    input_, dim, self.world_size, group_name=self.unique_name
                ),
            )
        return self._all_gather_out_place(input_, dim)

    @reports_failures
    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather through the device communicator (what the custom op runs).

        Raises:
            ValueError: no device communicator, or invalid ``dim``.
        """
        return self._communicator().all_gather(input_, dim)

    @reports_failures
    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """All-gather where rank ``r`` contributes ``sizes[r]`` rows along ``dim``.

        ``sizes=None`` means equal sizes. ``input_`` may be a list of
        tensors (a list comes back). Any ``dim`` works (vLLM: only 0).

        Raises:
            ValueError: no device communicator (a group of one has none), a
                bad ``dim``, or ``sizes`` that do not match the inputs.
            TypeError: ``input_`` is not a tensor or list of tensors.
        """
        dc = self._communicator()
        if not isinstance(input_, (list, tuple)):
            check_tensor(input_)
        return dc.all_gatherv(input_, dim, sizes)

    @reports_failures
    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group and keep this rank's equal chunk along ``dim``.

        Raises:
            TypeError: ``input_`` is not a tensor.
            ValueError: invalid ``dim``, a size not divisible by the world
                size, or no device communicator.
        """
        check_tensor(input_)
        if self.world_size == 1:
            return input_
        d = normalize_dim(input_, dim)
        if input_.shape[d] % self.world_size:
            raise ValueError(
                f"reduce_scatter: dim {dim} has size {input_.shape[d]}, not "
                f"divisible by the world size {self.world_size}"
            )
        if torch.compiler.is_compiling():
            return cast(
                torch.Tensor,
                torch.ops.ftdist.reduce_scatter(
                    input_, dim, self.world_size, group_name=self.unique_name
                ),
            )
        return self._reduce_scatter_out_place(input_, dim)

    @reports_failures
    def _reduce_scatter_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        """Reduce-scatter through the device communicator (what the custom op runs).

        Raises:
            ValueError: no device communicator, or an invalid ``dim``.
        """
        return self._communicator().reduce_scatter(input_, dim)

    @reports_failures
    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        """Reduce-scatter where rank ``r`` keeps ``sizes[r]`` rows along ``dim``.

        Raises:
            ValueError: no device communicator, a bad ``dim`` or ``sizes``.
            TypeError: ``input_`` is not a tensor.
        """
        dc = self._communicator()
        return dc.reduce_scatterv(check_tensor(input_), dim, sizes)

    @reports_failures
    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``input_`` concatenated along ``dim`` on ``dst``; None on the others.

        ``dst`` is a rank in the group.

        Raises:
            TypeError: ``input_`` is not a tensor.
            ValueError: invalid ``dst`` or ``dim``, or no device communicator.
        """
        check_tensor(input_)
        self._src(dst, "dst")
        if self.world_size == 1:
            return input_
        normalize_dim(input_, dim)
        return self._communicator().gather(input_, dst, dim)

    @reports_failures
    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``input_`` in place from ``src`` (a rank in the group); returns it.

        Raises:
            TypeError: ``input_`` is not a tensor.
            ValueError: invalid ``src``.
        """
        check_tensor(input_)
        self._src(src)
        if self.world_size == 1:
            return input_
        dist.broadcast(input_, group=self.device_group, group_src=src)
        return input_

    @contextlib.contextmanager
    def graph_capture(
        self, graph_capture_context: GraphCaptureContext | None = None
    ) -> Iterator[GraphCaptureContext]:
        """A context for CUDA graph capture on a side stream; a no-op context without CUDA.

        Yields:
            The :class:`GraphCaptureContext` (``stream`` None without CUDA).
        """
        if graph_capture_context is None:
            use_cuda = torch.cuda.is_available() and self.device.type == "cuda"
            graph_capture_context = GraphCaptureContext(torch.cuda.Stream() if use_cuda else None)
        stream = graph_capture_context.stream
        if stream is None:
            yield graph_capture_context
            return
        current = torch.cuda.current_stream()
        if current != stream:
            # Work queued before capture (e.g. initialisation) must finish first.
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            yield graph_capture_context

    def prepare_communication_buffer_for_model(self, model: torch.nn.Module) -> None:
        """Let the device communicator register buffers for ``model`` (nothing to do here).

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if self.device_communicator is not None:
            self.device_communicator.prepare_communication_buffer_for_model(model)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ) -> Any:
        """Expert-parallel dispatch; without an all-to-all backend, the inputs unchanged.

        Returns:
            ``(hidden_states, router_logits)``, plus ``extra_tensors`` when given.
        """
        if self.device_communicator is not None:
            return self.device_communicator.dispatch(
                hidden_states, router_logits, is_sequence_parallel, extra_tensors
            )
        if extra_tensors is not None:
            return hidden_states, router_logits, extra_tensors
        return hidden_states, router_logits

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        """Expert-parallel combine; without an all-to-all backend, ``hidden_states`` unchanged."""
        if self.device_communicator is not None:
            return self.device_communicator.combine(hidden_states, is_sequence_parallel)
        return hidden_states

    # -- fault tolerance and lifetime ------------------------------------------------------
    def abort(self) -> None:
        """Fail every operation in flight on this coordinator now; safe from any thread.

        For ftdist groups, both groups are aborted (waiters raise
        :class:`~ftdist.ProcessGroupAbortedError`) until :meth:`reconfigure`.
        The message queue is shut down (a blocked call raises
        ``RuntimeError``). torch.distributed groups cannot be aborted; only
        the queue is shut down.
        """
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.shutdown()
        if self._ft is not None:
            self.device_group.abort()
            self.cpu_group.abort()

    def reconfigure(self, store_addr: str, ranks: list[int]) -> None:
        """Rebuild the coordinator for a new membership, in place (ftdist groups only).

        Every member of the new group calls it with the same ``store_addr``
        (a prefix never used before, as for any ftdist configure) and the
        same ``ranks`` (global ranks; a position is the new rank in group).
        The device group, the CPU group, the device communicator and the
        message queue are rebuilt; operations still in flight on the old
        groups fail with :class:`~ftdist.ProcessGroupAbortedError`. The
        process keeps its global rank.

        Raises:
            TypeError: the coordinator is built over torch.distributed groups,
                or ``ranks`` is not a list of ints.
            ValueError: ``ranks`` is empty, repeats a rank, or lacks this
                process's rank; a malformed ``store_addr``.
            RuntimeError: the coordinator is destroyed, or a member did not
                join within the timeout.
        """
        if self._ft is None:
            raise TypeError(
                f"group {self.unique_name} is built over torch.distributed groups, which cannot "
                "be rebuilt; build it with torch_distributed_backend=FtBackend(...) to reconfigure"
            )
        if self.destroyed:
            raise RuntimeError(f"group {self.unique_name} is destroyed")
        new_ranks = check_group_ranks([ranks])[0]
        own_group([new_ranks], self.rank)
        if self._watch is not None:
            # News of the failure being repaired must not abort the new groups.
            failures.unwatch(self._watch, self)
            self._watch = None
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.shutdown()
            self.mq_broadcaster = None
        if self.device_communicator is not None:
            self.device_communicator.destroy()
            self.device_communicator = None
        configure_ft_groups(
            self.device_group, self.cpu_group, store_addr, self.unique_name, new_ranks, self.rank
        )
        self._set_members(new_ranks)
        self._build_communication()
        if self._ft.failure_news:
            self._watch = failures.watch(store_addr, self._ft.timeout, self)

    def destroy(self) -> None:
        """Release the groups, the communicator and the queue; safe to call twice.

        Custom ops called with this coordinator's name raise ``ValueError``
        afterwards.
        """
        if self.destroyed:
            return
        self.destroyed = True
        if self._watch is not None:
            failures.unwatch(self._watch, self)
            self._watch = None
        if self.mq_broadcaster is not None:
            self.mq_broadcaster.shutdown()
            self.mq_broadcaster = None
        if self.device_communicator is not None:
            self.device_communicator.destroy()
            self.device_communicator = None
        for group in (self.device_group, self.cpu_group):
            if self._ft is not None:
                group.shutdown()
            elif dist.is_initialized():
                with contextlib.suppress(ValueError, RuntimeError):
                    dist.destroy_process_group(group)


__all__ = ["GraphCaptureContext", "GroupCoordinator"]
