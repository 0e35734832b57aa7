"""
Coordinators by name, and the custom ops that reach them
========================================================

``torch.compile`` cannot pass a Python object such as a
:class:`~ftdist.coordinator.GroupCoordinator` into a graph, but it can pass a
string. So every coordinator registers itself under its unique name
(``"tp:0"``, ``"world:0"``, ...), and three custom ops find it by that name:

- ``torch.ops.ftdist.all_reduce(tensor, group_name) -> Tensor``
- ``torch.ops.ftdist.all_gather(tensor, dim, world_size, group_name) -> Tensor``
- ``torch.ops.ftdist.reduce_scatter(tensor, dim, world_size, group_name) -> Tensor``

They mirror vLLM's ``torch.ops.vllm.*`` ops. Each is out of place (a custom
op may not both mutate and return), and has a fake implementation that
gives the output's shape, so a compiled graph traces through them.

Invariants: a name is never reused within a process (a counter per base
name); the registry holds weak references, so it never keeps a coordinator
alive; an op on a destroyed or collected coordinator raises ``ValueError``.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Protocol

import torch
from torch.library import custom_op


class RegisteredGroup(Protocol):
    """What the ops need of a coordinator: its name, liveness and out-of-place collectives."""

    unique_name: str
    destroyed: bool

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor: ...
    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor: ...
    def _reduce_scatter_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor: ...


_lock = threading.Lock()
_name_counters: defaultdict[str, int] = defaultdict(int)
_groups: dict[str, weakref.ReferenceType[RegisteredGroup]] = {}


def get_unique_name(name: str) -> str:
    """``name`` with this process's next counter for it: ``"tp:0"``, then ``"tp:1"``, ...

    Coordinators built in the same order on every rank get the same names.
    """
    with _lock:
        n = _name_counters[name]
        _name_counters[name] = n + 1
    return f"{name}:{n}"


def register_group(group: RegisteredGroup) -> None:
    """Make ``group`` findable by its ``unique_name`` (a weak reference)."""
    with _lock:
        _groups[group.unique_name] = weakref.ref(group)


def lookup_group(group_name: str) -> RegisteredGroup:
    """The live coordinator registered as ``group_name``.

    Raises:
        TypeError: ``group_name`` is not a str.
        ValueError: no coordinator has that name (the message lists the
            names known), or it was destroyed or garbage-collected.
    """
    if not isinstance(group_name, str):
        raise TypeError(f"group_name must be a str, got {group_name!r}")
    with _lock:
        ref = _groups.get(group_name)
        known = sorted(_groups)
    if ref is None:
        raise ValueError(f"Group {group_name} is not found; known groups: {known}")
    group = ref()
    if group is None or getattr(group, "destroyed", False):
        raise ValueError(f"Group {group_name} is destroyed.")
    return group


def _shape_with(tensor: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(tensor.shape)
    if dim < 0:
        dim += len(shape)
    shape[dim] = size
    return shape


@custom_op("ftdist::all_reduce", mutates_args=())
def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``tensor`` over the coordinator ``group_name``; a new tensor."""
    return lookup_group(group_name)._all_reduce_out_place(tensor)


@all_reduce.register_fake
def _all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


@custom_op("ftdist::all_gather", mutates_args=())
def all_gather(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` over ``group_name``."""
    return lookup_group(group_name)._all_gather_out_place(tensor, dim)


@all_gather.register_fake
def _all_gather_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    d = dim + tensor.dim() if dim < 0 else dim
    return tensor.new_empty(_shape_with(tensor, d, tensor.shape[d] * world_size))


@custom_op("ftdist::reduce_scatter", mutates_args=())
def reduce_scatter(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    """Sum over ``group_name`` and keep this rank's ``1/world_size`` slice along ``dim``."""
    return lookup_group(group_name)._reduce_scatter_out_place(tensor, dim)


@reduce_scatter.register_fake
def _reduce_scatter_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    d = dim + tensor.dim() if dim < 0 else dim
    return tensor.new_empty(_shape_with(tensor, d, tensor.shape[d] // world_size))


__all__ = [
    "RegisteredGroup",
    "all_gather",
    "all_reduce",
    "get_unique_name",
    "lookup_group",
    "reduce_scatter",
    "register_group",
]
