"""
Passing collective arguments to a Baby group's child process
=============================================================

Tensors cross by reference, not by value: a CPU tensor's storage is moved to
shared memory once (``share_memory_()``), its handle is sent to the child the
first time, and every later op sends only ``(key, offset, shape, stride,
dtype)``. A CUDA storage crosses once as a CUDA IPC handle. The child writes
results straight into the shared storage, so nothing is copied per op.

The parent remembers which storages the child holds by data pointer and a
weak reference; when a storage dies its key is retired and the child drops
its mapping, so a new storage reusing the address is re-sent.

Options objects and ``ReduceOp`` are not picklable, so they travel as plain
records and are rebuilt on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

# Importing torch.multiprocessing registers the reductions that let a
# multiprocessing Connection pickle shared storages and CUDA tensors.
import torch.multiprocessing
from torch.multiprocessing.reductions import StorageWeakRef

_OPTION_TYPES = {
    cls.__name__: cls
    for cls in (
        c10d.AllreduceOptions,
        c10d.AllreduceCoalescedOptions,
        c10d.BroadcastOptions,
        c10d.ReduceOptions,
        c10d.AllgatherOptions,
        c10d.GatherOptions,
        c10d.ScatterOptions,
        c10d.ReduceScatterOptions,
        c10d.AllToAllOptions,
        c10d.BarrierOptions,
    )
}
_EMPTY = -1


@dataclass(frozen=True)
class TensorRef:
    """A view into a storage the child already holds (``key``)."""

    key: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class OptionsRef:
    """A c10d options object as a record."""

    cls: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class ReduceOpRef:
    """A ``ReduceOp`` as its integer type."""

    value: int


def _red_op_value(op: Any) -> int:
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.PREMUL_SUM:
        raise ValueError("ReduceOp.PREMUL_SUM is not supported by Baby process groups")
    return int(kind.value)


class Exporter:
    """Parent side: turns collective arguments into references."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], tuple[int, StorageWeakRef, int]] = {}
        self._next_key = 0

    def encode(self, obj: Any, new: list[tuple[int, Any]]) -> Any:
        """Encode ``obj``; storages the child lacks are appended to ``new``."""
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, new)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.encode(o, new) for o in obj)
        if isinstance(obj, dist.ReduceOp) or isinstance(obj, dist.ReduceOp.RedOpType):
            return ReduceOpRef(_red_op_value(obj))
        name = type(obj).__name__
        if name in _OPTION_TYPES and isinstance(obj, _OPTION_TYPES[name]):
            fields = {}
            for attr in dir(obj):
                if attr.startswith("_"):
                    continue
                value = getattr(obj, attr)
                if callable(value):
                    continue
                fields[attr] = self.encode(value, new)
            return OptionsRef(name, fields)
        return obj

    def _tensor(self, t: torch.Tensor, new: list[tuple[int, Any]]) -> TensorRef:
        device = str(t.device)
        if t.device.type == "cpu" and not t.is_shared():
            t.share_memory_()
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return TensorRef(_EMPTY, 0, tuple(t.shape), tuple(t.stride()), t.dtype, device)
        ident = (device, storage.data_ptr())
        entry = self._known.get(ident)
        if entry is None or entry[1].expired() or entry[2] != nbytes:
            key = self._next_key
            self._next_key += 1
            self._known[ident] = (key, StorageWeakRef(storage), nbytes)
            if t.device.type == "cpu":
                new.append((key, storage))
            else:
                # CUDA storages only cross as tensors (CUDA IPC).
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                new.append((key, whole))
        else:
            key = entry[0]
        return TensorRef(
            key, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype, device
        )

    def retired(self) -> list[int]:
        """Keys of storages that died since the last call (the child may drop them)."""
        dead = [ident for ident, (_, ref, _) in self._known.items() if ref.expired()]
        return [self._known.pop(ident)[0] for ident in dead]


class Importer:
    """Child side: rebuilds arguments from references."""

    def __init__(self) -> None:
        self._storages: dict[int, Any] = {}

    def add(self, new: list[tuple[int, Any]]) -> None:
        """Take the storages (or CUDA tensors) the parent sent."""
        for key, value in new:
            self._storages[key] = value

    def drop(self, keys: list[int]) -> None:
        """Forget storages the parent no longer holds."""
        for key in keys:
            self._storages.pop(key, None)

    def decode(self, obj: Any) -> Any:
        """Decode what :meth:`Exporter.encode` produced."""
        if isinstance(obj, TensorRef):
            if obj.key == _EMPTY:
                return torch.empty_strided(
                    obj.shape, obj.stride, dtype=obj.dtype, device=obj.device
                )
            held = self._storages[obj.key]
            storage = held.untyped_storage() if isinstance(held, torch.Tensor) else held
            view = torch.empty(0, dtype=obj.dtype, device=obj.device)
            return view.set_(storage, obj.offset, obj.shape, obj.stride)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.decode(o) for o in obj)
        if isinstance(obj, ReduceOpRef):
            return dist.ReduceOp.RedOpType(obj.value)
        if isinstance(obj, OptionsRef):
            opts = _OPTION_TYPES[obj.cls]()
            for attr, value in obj.fields.items():
                try:
                    setattr(opts, attr, self.decode(value))
                except (AttributeError, TypeError):
                    pass  # read-only or version-specific field
            return opts
        return obj
