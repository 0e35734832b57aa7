"""
Tensor dictionaries on the wire: metadata once, tensors raw
===========================================================

``broadcast_tensor_dict`` and ``send_tensor_dict`` split a dict into one
picklable *metadata list* and the tensors themselves. The metadata (keys,
plain values, and each tensor's device type, dtype and shape) travels as one
object; the receiver allocates every tensor from it and the tensors travel
as raw collectives, never pickled.

Invariants: both sides walk the keys in the dict's insertion order, which
the metadata list preserves; a tensor's device is sent as its *type*
(``"cuda"``, never ``"cuda:3"``), so the receiver allocates on its own
current device; empty tensors are never sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch


class TensorMetadata(NamedTuple):
    """What a receiver needs to allocate a tensor: device type, dtype and size."""

    device: str
    dtype: torch.dtype
    size: torch.Size


def split_tensor_dict(tensor_dict: Mapping[Any, Any]
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
            metadata_list.append((key, TensorMetadata(value.device.type, value.dtype, value.size())))
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
            isinstance(e, tuple) and len(e) == 2 for e in metadata_list):
        raise RuntimeError(
            f"expected a tensor-dict header from {source}, got {type(metadata_list).__name__}; "
            "the ranks called different operations in different orders"
        )
    return metadata_list


def uses_all_gather(key: Any, tensor: torch.Tensor, all_gather_size: int,
                    all_gather_tensors: Mapping[Any, bool] | None, enabled: bool) -> bool:
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


__all__ = ["TensorMetadata", "check_metadata_list", "slice_for", "split_tensor_dict",
           "uses_all_gather"]
