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

The class is vLLM's one flat API, so it stays one class in one module; the
work behind its methods lives with collaborators: :class:`DeviceCommunicator`
moves device tensors, ``tensor_dict.py`` is the tensor-dictionary transport,
:class:`MessageQueue` the shared-memory broadcaster, ``groups.py`` builds the
process groups and ``failures.py`` carries failure news.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from ftdist.coordinator import failures, ops
from ftdist.coordinator import tensor_dict as tensor_dict_ops
from ftdist.coordinator.communicator import (
    DeviceCommunicator,
    check_group_rank,
    check_tensor,
    normalize_dim,
)
from ftdist.coordinator.failures import reports_failures
from ftdist.coordinator.groups import (
    FtBackend,
    check_group_ranks,
    configure_ft_groups,
    new_ft_groups,
    new_torch_groups,
    own_group,
    require_torch_distributed,
)
from ftdist.coordinator.message_queue import Handle, MessageQueue

# The coordinator's broadcasters: 4 MiB chunks, 6 of them (vLLM's choice).
MQ_CHUNK_BYTES = 1 << 22
MQ_CHUNKS = 6


@dataclass
class GraphCaptureContext:
    """The stream a CUDA graph is captured on; ``stream`` is None without CUDA."""

    stream: Any


def _device_for(backend: str, local_rank: int) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class GroupCoordinator:
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

    Attributes:
        unique_name: the coordinator's name in the custom-op registry (``"tp:0"``).
        rank: this process's global rank.
        ranks: the group's global ranks; a position is a rank in the group.
        world_size: the number of members.
        rank_in_group: this process's position in :attr:`ranks`.
        local_rank: the device index on this host.
        backend: ``"gloo"``, ``"nccl"``, or the ftdist device kind.
        device: the device tensors of the device group live on.
        device_group: the group device tensors travel over.
        cpu_group: the Gloo (or ftdist CPU) group objects and metadata travel over.
        device_communicator: the tensor collectives, or None.
        mq_broadcaster: the shared-memory broadcaster of rank 0, or None.
        timeout: the collective timeout, or None (torch's default).
        destroyed: True after ``destroy``.

    Raises:
        TypeError: malformed ``group_ranks``, ``local_rank`` or backend.
        ValueError: this rank is in no group (or ranks repeat); a torch group
            is not sorted.
        RuntimeError: a torch backend without an initialized default group,
            or groups that could not be built.
    """

    unique_name: str
    rank: int
    ranks: list[int]
    world_size: int
    rank_in_group: int
    local_rank: int
    backend: str
    device: torch.device
    device_group: Any
    cpu_group: Any
    device_communicator: DeviceCommunicator | None
    mq_broadcaster: MessageQueue | None
    timeout: timedelta | None
    destroyed: bool
    _watch: failures.FailureWatch | None
    _ft: FtBackend | None

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

    # -- membership and the checks every method shares ------------------------------
    def _set_members(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(self.rank)

    def _timeout_s(self) -> float | None:
        return None if self.timeout is None else self.timeout.total_seconds()

    @property
    def first_rank(self) -> int:
        """The global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """The global rank of the group's last member."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """True if this process is the group's first member."""
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        """True if this process is the group's last member."""
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        """The global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """The global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @property
    def is_reconfigurable(self) -> bool:
        """True when built over ftdist groups, so :meth:`reconfigure` works."""
        return self._ft is not None

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.unique_name!r}, ranks={self.ranks}, "
            f"rank_in_group={self.rank_in_group}, backend={self.backend!r})"
        )

    def _communicator(self) -> DeviceCommunicator:
        if self.destroyed:
            raise RuntimeError(f"group {self.unique_name} is destroyed")
        if self.device_communicator is None:
            why = (
                "the group has one rank"
                if self.world_size == 1
                else "it was built with use_device_communicator=False"
            )
            raise ValueError(f"No device communicator found for group {self.unique_name}: {why}")
        return self.device_communicator

    def _src(self, src: Any, what: str = "src") -> int:
        return check_group_rank(src, self.world_size, what)

    def _check_peer(self, peer: Any, what: str) -> int:
        self._src(peer, what)
        if peer == self.rank_in_group:
            raise ValueError(
                f"Invalid {what} rank ({peer}): {what} is the same as the current rank"
            )
        return int(peer)

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

    # -- graph capture and expert parallelism ---------------------------------------------
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

    # -- objects -------------------------------------------------------------------
    @reports_failures
    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any:
        """Broadcast a picklable object from ``src``; every rank returns it.

        With a message-queue broadcaster and ``src == 0`` it goes through
        shared memory; otherwise over the CPU group (vLLM refuses other
        sources when it has a broadcaster; here they take the CPU group).

        Raises:
            ValueError: invalid ``src``.
            CommunicationError: a peer died (ftdist groups and the queue).
        """
        self._src(src)
        if self.world_size == 1:
            return obj
        if self.mq_broadcaster is not None and src == 0:
            timeout = self._timeout_s()
            if self.rank_in_group == 0:
                self.mq_broadcaster.enqueue(obj, timeout=timeout)
                return obj
            return self.mq_broadcaster.dequeue(timeout=timeout)
        objs = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(objs, group=self.cpu_group, group_src=src)
        return objs[0]

    @reports_failures
    def broadcast_object_list(
        self, obj_list: list[Any], src: int = 0, group: Any = None
    ) -> list[Any]:
        """Fill ``obj_list`` in place with ``src``'s list (same length everywhere); returns it.

        ``group`` is ignored, as in vLLM. The objects travel over the CPU
        group (vLLM uses the device group, which with NCCL stages them on
        the GPU).

        Raises:
            TypeError: ``obj_list`` is not a list.
            ValueError: invalid ``src``.
        """
        if not isinstance(obj_list, list):
            raise TypeError(f"obj_list must be a list, got {type(obj_list).__name__}")
        self._src(src)
        if self.world_size == 1:
            return obj_list
        dist.broadcast_object_list(obj_list, group=self.cpu_group, group_src=src)
        return obj_list

    @reports_failures
    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object to ``dst`` (a rank in the group) over the CPU group.

        Raises:
            ValueError: ``dst`` is invalid or this rank.
        """
        self._check_peer(dst, "dst")
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
        dist.send(size, group=self.cpu_group, group_dst=dst)
        dist.send(payload, group=self.cpu_group, group_dst=dst)

    @reports_failures
    def recv_object(self, src: int) -> Any:
        """Receive an object sent with :meth:`send_object` by ``src``.

        Raises:
            ValueError: ``src`` is invalid or this rank.
            RuntimeError: the size and the payload came from different ranks.
        """
        self._check_peer(src, "src")
        size = torch.empty(1, dtype=torch.long)
        sender = dist.recv(size, group=self.cpu_group, group_src=src)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        sender2 = dist.recv(payload, group=self.cpu_group, group_src=src)
        if sender != sender2:
            raise RuntimeError("Received object sender rank does not match the size sender rank.")
        return pickle.loads(payload.numpy().tobytes())

    # -- point to point tensors ---------------------------------------------------------
    @reports_failures
    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to ``dst`` (default: the next rank in the group), blocking.

        Raises:
            ValueError: no device communicator, or ``dst`` invalid or this rank.
            TypeError: ``tensor`` is not a tensor.
        """
        dc = self._communicator()
        dc.send(check_tensor(tensor, "tensor"), dst)

    @reports_failures
    def recv(self, size: Any, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a tensor of ``size`` and ``dtype`` from ``src`` (default: the previous rank).

        Raises:
            ValueError: no device communicator, or ``src`` invalid or this rank.
        """
        return self._communicator().recv(size, dtype, src)

    # -- tensor dictionaries (the transport is in tensor_dict.py) ---------------------------
    @reports_failures
    def broadcast_tensor_dict(
        self,
        tensor_dict: dict[Any, Any] | None = None,
        src: int = 0,
        group: Any = None,
        metadata_group: Any = None,
    ) -> dict[Any, Any] | None:
        """Broadcast a dict of tensors and plain values from ``src``; every rank returns it.

        The metadata goes as one object; then every non-empty tensor is
        broadcast raw, all at once: CPU tensors over the CPU group, device
        tensors over the device group. When the metadata goes through the
        message queue (``src == 0`` on a coordinator with one), CPU tensors
        ride inside it instead, as raw bytes through shared memory.
        ``group`` and ``metadata_group`` are ignored, as in vLLM.

        Raises:
            ValueError: invalid ``src``.
            TypeError: ``src`` passes something other than a dict.
        """
        self._src(src)
        if self.world_size == 1 or (self._ft is None and not dist.is_initialized()):
            return tensor_dict
        return tensor_dict_ops.broadcast(self, tensor_dict, src)

    @reports_failures
    def send_tensor_dict(
        self,
        tensor_dict: dict[Any, Any],
        dst: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> dict[Any, Any] | None:
        """Send a dict of tensors and plain values to ``dst`` (default: the next rank).

        With ``all_gather_group`` (typically the tensor-parallel group), each
        tensor whose element count divides by that group's size is sent as
        this rank's ``1/size`` slice only, and the receiver rebuilds it with
        an all-gather; ``all_gather_tensors={key: False}`` turns that off for
        tensors that differ across the group. Both sides must pass the same.

        Returns:
            None; a group of one returns ``tensor_dict``.

        Raises:
            TypeError: ``tensor_dict`` is not a dict, or ``all_gather_group``
                not a coordinator.
            ValueError: ``dst`` is invalid or this rank.
        """
        if self.world_size == 1 or (self._ft is None and not dist.is_initialized()):
            return tensor_dict
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self._check_peer(dst, "dst")
        tensor_dict_ops.send(
            self, tensor_dict, dst, self._all_gather_args(all_gather_group), all_gather_tensors
        )
        return None

    @reports_failures
    def recv_tensor_dict(
        self,
        src: int | None = None,
        all_gather_group: GroupCoordinator | None = None,
        all_gather_tensors: Mapping[Any, bool] | None = None,
    ) -> dict[Any, Any] | None:
        """Receive a dict sent with :meth:`send_tensor_dict` by ``src`` (default: the previous rank).

        Returns:
            The dict, keys in the sender's order; None for a group of one.

        Raises:
            ValueError: ``src`` is invalid or this rank.
            TypeError: ``all_gather_group`` is not a coordinator.
        """
        if self.world_size == 1 or (self._ft is None and not dist.is_initialized()):
            return None
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        self._check_peer(src, "src")
        self._all_gather_args(all_gather_group)
        return tensor_dict_ops.recv(self, src, all_gather_group, all_gather_tensors)

    def _all_gather_args(self, all_gather_group: Any) -> tuple[int, int] | None:
        if all_gather_group is None:
            return None
        if not isinstance(all_gather_group, GroupCoordinator):
            raise TypeError(
                "all_gather_group must be a GroupCoordinator (e.g. get_tp_group()), "
                f"got {type(all_gather_group).__name__}"
            )
        return all_gather_group.world_size, all_gather_group.rank_in_group

    # -- synchronisation and broadcasters -------------------------------------------------
    @reports_failures
    def barrier(self) -> None:
        """Wait until every member arrives (on the CPU group, never the device group)."""
        dist.barrier(group=self.cpu_group)

    def create_mq_broadcaster(
        self,
        writer_rank: int = 0,
        external_writer_handle: Handle | None = None,
        blocking: bool = True,
    ) -> MessageQueue:
        """A new :class:`MessageQueue` over the CPU group, written by ``writer_rank`` (collective).

        Raises:
            ValueError: ``writer_rank`` is not a rank in the group.
            CommunicationError: the handshake failed or timed out.
        """
        self._src(writer_rank, "writer")
        return MessageQueue.create_from_process_group(
            self.cpu_group,
            MQ_CHUNK_BYTES,
            MQ_CHUNKS,
            writer_rank=writer_rank,
            external_writer_handle=external_writer_handle,
            blocking=blocking,
            timeout=self._timeout_s() or 60.0,
        )

    def create_single_reader_mq_broadcasters(
        self, reader_rank_in_group: int = 0, blocking: bool = False
    ) -> tuple[MessageQueue | None, list[Handle]]:
        """Every rank writes its own queue read by ``reader_rank_in_group`` (collective).

        Returns:
            ``(queue, handles)``: ``handles`` (every rank's, on the reader
            only) is what the reader joins with
            ``MessageQueue.create_from_handle(h, reader_rank_in_group)``.
            A group of one returns ``(None, [])``.

        Raises:
            ValueError: ``reader_rank_in_group`` is not a rank in the group.
        """
        self._src(reader_rank_in_group, "reader")
        if self.world_size == 1:
            return None, []
        return MessageQueue.create_from_process_group_single_reader(
            self.cpu_group,
            MQ_CHUNK_BYTES,
            MQ_CHUNKS,
            reader_rank=reader_rank_in_group,
            blocking=blocking,
            timeout=self._timeout_s() or 60.0,
        )

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


__all__ = ["MQ_CHUNKS", "MQ_CHUNK_BYTES", "GraphCaptureContext", "GroupCoordinator"]
