"""
A group coordinator's messages: objects, point-to-point and tensor dictionaries
===============================================================================

:class:`GroupMessaging` is the part of
:class:`~ftdist.coordinator.GroupCoordinator` that moves Python objects and
dictionaries of tensors, and point-to-point tensors, with vLLM's semantics:
objects and metadata always travel over the CPU group (or rank 0's
shared-memory queue), tensors over the group their device calls for.

Invariants: ``src``/``dst`` are ranks in the group; a send is matched by a
receive on its peer; bad arguments raise before any communication.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ftdist.coordinator import tensor_dict as tensor_dict_ops
from ftdist.coordinator.communicator import check_tensor
from ftdist.coordinator.group_core import (
    MQ_CHUNK_BYTES,
    MQ_CHUNKS,
    GroupCore,
    reports_failures,
)
from ftdist.coordinator.message_queue import Handle, MessageQueue


class GroupMessaging(GroupCore):
    """Objects, point-to-point tensors, tensor dictionaries and broadcasters of a group."""

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
        all_gather_group: GroupCore | None = None,
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
        all_gather_group: GroupCore | None = None,
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
        if not isinstance(all_gather_group, GroupCore):
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


__all__ = ["GroupMessaging"]
