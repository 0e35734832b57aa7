"""
Receiving in place
==================

A receiver that already holds a state of the same shape (the recovering
replica's own model and optimizer) can have the bytes written straight into
its tensors: no fresh memory to fault in, no copy when the state is loaded.
Both transports accept a ``state_dict`` callable for that. A leaf is received
in place when the receiver's state has a tensor at the same path (dicts,
lists and tuples are walked) with the same dtype, shape, strides and device
type; for a DTensor, its local tensor. Every other leaf gets a fresh tensor.

In place means a transfer that fails half-way leaves the receiver's tensors
half overwritten: the caller must not count on their old values after a
failed receive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ftdist.checkpointing import _dtensor
from ftdist.checkpointing._codec import LeafMeta

if TYPE_CHECKING:
    from ftdist.checkpointing._wire import Header


def tensors_by_path(state: Any) -> dict[tuple[Any, ...], torch.Tensor]:
    """The tensors of a receiver's own state, by path (only dicts, lists and tuples are walked)."""
    found: dict[tuple[Any, ...], torch.Tensor] = {}
    stack: list[tuple[tuple[Any, ...], Any]] = [((), state)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            found[path] = obj
        elif isinstance(obj, dict):
            stack.extend(((*path, k), v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)) and len(path) < 100:
            stack.extend(((*path, i), v) for i, v in enumerate(obj))
    return found


def fits(t: torch.Tensor, meta: LeafMeta, device: torch.device) -> bool:
    """Whether ``t`` can receive ``meta``'s bytes in place, as laid out."""
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        return False
    if t.device.type != device.type or t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
        return False
    # Strides of size-1 dimensions do not change the layout.
    return all(
        sz == 1 or a == b for sz, a, b in zip(meta.shape, t.stride(), meta.stride, strict=True)
    )


def own_state(
    fixed: Callable[[], object] | None, receive_into: Callable[[], object] | None
) -> object:
    """The receiver's own state for one receive: from the transport's own
    ``state_dict=`` when it has one, else from the ``receive_into`` hook the
    Manager sets; None receives into fresh memory.
    """
    source = fixed if fixed is not None else receive_into
    return None if source is None else source()


def in_place_targets(
    state: object, header: Header, device: torch.device
) -> dict[int, torch.Tensor]:
    """The receiver's tensors that fit the stream's leaves, by leaf index.

    Args:
        state: the receiver's current state (:func:`own_state`; None:
            nothing is received in place).
        header: the stream's checked header.
        device: the device type the bytes land on.
    """
    if state is None:
        return {}
    mine = tensors_by_path(state)
    _dtensor.remember_targets(list(mine.values()))
    targets = {}
    for index in header.carried:
        meta = header.leaves[index]
        target = mine.get(meta.path)
        if target is None:
            continue
        if _dtensor.is_dtensor(target):
            target = _dtensor.local_tensor(target)
        target = target.detach()
        if fits(target, meta, device):
            targets[index] = target
    return targets
