"""
Tensor dictionaries on the wire: metadata once, tensors raw
===========================================================

``broadcast_tensor_dict`` and ``send_tensor_dict`` split a dict into one
picklable *metadata list* and the tensors themselves. The metadata (keys,
plain values, and each tensor's device type, dtype and shape) travels as one
object; the receiver allocates every tensor from it and the tensors travel
as raw collectives. One exception: when the header of a broadcast goes
through the coordinator's shared-memory queue, CPU tensors ride inside it as
raw bytes (:class:`CpuTensorData`), which costs a copy through shared memory
instead of a Gloo broadcast per tensor.

The transport itself (:func:`broadcast`, :func:`send`, :func:`recv`) runs
for a :class:`~ftdist.coordinator.GroupCoordinator`, which has checked the
arguments: CPU tensors travel over its CPU group and device tensors over
its device group.

Invariants: both sides walk the keys in the dict's insertion order, which
the metadata list preserves; a tensor's device is sent as its *type*
(``"cuda"``, never ``"cuda:3"``), so the receiver allocates on its own
current device; empty tensors are never sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class TensorMetadata(NamedTuple):
    """What a receiver needs to allocate a tensor: device type, dtype and size."""

    device: str
    dtype: torch.dtype
    size: torch.Size


class CpuTensorData(NamedTuple):
    """A CPU tensor carried inside the header itself (its bytes as a numpy array).

    Used when the header goes through a shared-memory queue: the bytes then
    cost one copy through shared memory instead of a Gloo broadcast each.
    Any dtype travels, as raw bytes.
    """

    dtype: torch.dtype
    size: torch.Size
    data: Any  # numpy.ndarray of uint8

    @staticmethod
    def of(tensor: torch.Tensor) -> CpuTensorData:
        """Wrap a CPU tensor's bytes (a copy only if it is not contiguous)."""
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        return CpuTensorData(tensor.dtype, tensor.size(), flat.numpy())

    def to_tensor(self) -> torch.Tensor:
        """The tensor again, sharing the received (writable) bytes."""
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.size)


def split_tensor_dict(
    tensor_dict: Mapping[Any, Any],
) -> tuple[list[tuple[Any, Any]], list[torch.Tensor]]:
    """Split a dict into ``(metadata_list, tensor_list)``.

    ``metadata_list`` has one ``(key, value)`` per entry, in order, where a
    tensor's value is replaced by its :class:`TensorMetadata`;
    ``tensor_list`` holds the tensors in the same order.

    Raises:
        TypeError: ``tensor_dict`` is not a dict.
    """
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"Expecting a dictionary, got {type(tensor_dict).__name__}")
    metadata_list: list[tuple[Any, Any]] = []
    tensor_list: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            metadata_list.append(
                (key, TensorMetadata(value.device.type, value.dtype, value.size()))
            )
            tensor_list.append(value)
        else:
            metadata_list.append((key, value))
    return metadata_list, tensor_list


def check_metadata_list(metadata_list: Any, source: str) -> list[tuple[Any, Any]]:
    """Check that what arrived as a tensor-dict header is one.

    Raises:
        RuntimeError: it is not a list of ``(key, value)`` pairs, i.e. the
            two sides are out of step (one sent something else first).
    """
    if not isinstance(metadata_list, list) or not all(
        isinstance(e, tuple) and len(e) == 2 for e in metadata_list
    ):
        raise RuntimeError(
            f"expected a tensor-dict header from {source}, got {type(metadata_list).__name__}; "
            "the ranks called different operations in different orders"
        )
    return metadata_list


def uses_all_gather(
    key: Any,
    tensor: torch.Tensor,
    all_gather_size: int,
    all_gather_tensors: Mapping[Any, bool] | None,
    enabled: bool,
) -> bool:
    """Whether ``tensor`` travels as a ``1/all_gather_size`` slice plus an all-gather.

    By default a tensor does when an all-gather group is given and its
    element count divides by the group's size; ``all_gather_tensors[key]``
    overrides that per key (turn it off for tensors that are not the same on
    every rank of the group, e.g. a sequence-parallel residual). Sender and
    receiver must pass the same group size and overrides.
    """
    default = enabled and tensor.numel() % all_gather_size == 0
    if not all_gather_tensors:
        return default
    return bool(all_gather_tensors.get(key, default))


def slice_for(tensor: torch.Tensor, all_gather_size: int, all_gather_rank: int) -> torch.Tensor:
    """This rank's contiguous ``1/all_gather_size`` part of ``tensor`` (flattened)."""
    return tensor.reshape(all_gather_size, -1)[all_gather_rank]


def _group_for(g: Any, tensor: torch.Tensor) -> Any:
    return g.cpu_group if tensor.is_cpu else g.device_group


def broadcast(g: Any, tensor_dict: Any, src: int) -> dict[Any, Any]:
    """``g.broadcast_tensor_dict`` for a group of two or more (arguments checked).

    When the header goes through ``g``'s shared-memory queue (``src == 0``),
    CPU tensors ride inside it (:class:`CpuTensorData`); otherwise, and for
    device tensors always, each non-empty tensor is broadcast raw over its
    group, all posted at once.

    Raises:
        TypeError: this rank is ``src`` and ``tensor_dict`` is not a dict.
    """
    inline_cpu = g.mq_broadcaster is not None and src == 0
    works = []
    if g.rank_in_group == src:
        if not isinstance(tensor_dict, dict):
            raise TypeError(f"Expecting a dictionary, got {type(tensor_dict).__name__}")
        header: list[tuple[Any, Any]] = []
        raw: list[torch.Tensor] = []
        for key, value in tensor_dict.items():
            if not isinstance(value, torch.Tensor):
                header.append((key, value))
            elif inline_cpu and value.is_cpu:
                header.append((key, CpuTensorData.of(value)))
            else:
                header.append((key, TensorMetadata(value.device.type, value.dtype, value.size())))
                raw.append(value)
        g.broadcast_object(header, src=src)
        for tensor in raw:
            if tensor.numel():
                works.append(
                    dist.broadcast(
                        tensor.contiguous(),
                        group=_group_for(g, tensor),
                        group_src=src,
                        async_op=True,
                    )
                )
        for work in works:
            work.wait()
        return tensor_dict
    metadata_list = check_metadata_list(g.broadcast_object(None, src=src), f"rank {src}")
    out: dict[Any, Any] = {}
    for key, value in metadata_list:
        if isinstance(value, TensorMetadata):
            tensor = torch.empty(value.size, dtype=value.dtype, device=value.device)
            if tensor.numel():
                works.append(
                    dist.broadcast(
                        tensor, group=_group_for(g, tensor), group_src=src, async_op=True
                    )
                )
            out[key] = tensor
        elif isinstance(value, CpuTensorData):
            out[key] = value.to_tensor()
        else:
            out[key] = value
    for work in works:
        work.wait()
    return out


def send(
    g: Any,
    tensor_dict: Any,
    dst: int,
    all_gather: tuple[int, int] | None,
    all_gather_tensors: Mapping[Any, bool] | None,
) -> None:
    """``g.send_tensor_dict`` for a group of two or more (arguments checked).

    ``all_gather`` is the all-gather group's ``(world_size, rank_in_group)``.

    Raises:
        TypeError: ``tensor_dict`` is not a dict.
    """
    ag_size, ag_rank = all_gather or (1, 0)
    metadata_list, tensor_list = split_tensor_dict(tensor_dict)
    g.send_object(metadata_list, dst=dst)
    tensors = iter(tensor_list)
    for key, value in metadata_list:
        if not isinstance(value, TensorMetadata):
            continue
        tensor = next(tensors)
        if tensor.numel() == 0:
            continue
        if uses_all_gather(key, tensor, ag_size, all_gather_tensors, all_gather is not None):
            tensor = slice_for(tensor, ag_size, ag_rank)
        dist.send(tensor.contiguous(), group=_group_for(g, tensor), group_dst=dst)


def recv(
    g: Any, src: int, all_gather_group: Any, all_gather_tensors: Mapping[Any, bool] | None
) -> dict[Any, Any]:
    """``g.recv_tensor_dict`` for a group of two or more (arguments checked)."""
    ag_size = all_gather_group.world_size if all_gather_group is not None else 1
    ag_rank = all_gather_group.rank_in_group if all_gather_group is not None else 0
    metadata_list = check_metadata_list(g.recv_object(src=src), f"rank {src}")
    out: dict[Any, Any] = {}
    for key, value in metadata_list:
        if not isinstance(value, TensorMetadata):
            out[key] = value
            continue
        tensor = torch.empty(value.size, dtype=value.dtype, device=value.device)
        if tensor.numel() == 0:
            out[key] = tensor
            continue
        group = _group_for(g, tensor)
        if uses_all_gather(key, tensor, ag_size, all_gather_tensors, all_gather_group is not None):
            part = slice_for(tensor, ag_size, ag_rank)  # a view: received in place
            dist.recv(part, group=group, group_src=src)
            tensor = all_gather_group.all_gather(part, dim=0).reshape(value.size)
        else:
            dist.recv(tensor, group=group, group_src=src)
        out[key] = tensor
    return out


__all__ = [
    "CpuTensorData",
    "TensorMetadata",
    "broadcast",
    "check_metadata_list",
    "recv",
    "send",
    "slice_for",
    "split_tensor_dict",
    "uses_all_gather",
]
