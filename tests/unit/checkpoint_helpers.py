"""Helpers shared by the checkpoint codec and wire tests: in-memory round trips, deep equality."""

from __future__ import annotations

import collections
import io
import math
from typing import Any

import numpy as np
import torch

from ftdist.checkpointing import _receive, _wire


def stream_bytes(state: Any, step: int = 1, num_chunks: int = 1) -> list[bytes]:
    """Every stream of ``state`` as bytes, as a server would write them."""
    return [
        b"".join(bytes(buf) for buf in _wire.chunks(s)) for s in _wire.plan(state, step, num_chunks)
    ]


def decode(data: bytes, step: int = 1) -> tuple[_wire.Header, dict[int, torch.Tensor]]:
    """Read one stream from bytes, as a client would."""
    reader = _wire.StreamReader(io.BytesIO(data).readinto, "test")
    return _receive.read_leaves(reader, step, size=len(data))


def round_trip(state: Any, step: int = 1, num_chunks: int = 1) -> Any:
    """``state`` through the wire format and back (all chunks merged)."""
    header, tensors = None, {}
    for data in stream_bytes(state, step, num_chunks):
        h, got = decode(data, step)
        if header is not None:
            _wire.same_state(header, h, "test")
        header = h
        tensors.update(got)
    assert header is not None
    return _receive.assemble(header, tensors)


def assert_identical(a: Any, b: Any, path: str = "state") -> None:
    """Equal values of the same types, tensors bit for bit with the same layout."""
    if isinstance(a, torch.Tensor):
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
        if type(a).__name__ == "DTensor":
            # A DTensor's fields, without importing torch.distributed.tensor.
            dt_a: Any = a
            dt_b: Any = b
            assert dt_a._spec == dt_b._spec, f"{path}: {dt_a._spec} != {dt_b._spec}"
            a, b = dt_a._local_tensor, dt_b._local_tensor
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert a.requires_grad == b.requires_grad, path
        if a.numel():  # the strides of size-1 dimensions carry no layout
            same = all(
                s == 1 or x == y for s, x, y in zip(a.shape, a.stride(), b.stride(), strict=True)
            )
            assert same, f"{path}: strides {a.stride()} != {b.stride()}"
        bits_a = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bits_b = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{path}: values differ"
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), path
        return
    if hasattr(type(a), "_fields"):  # a named tuple: same name and fields
        assert type(b).__name__ == type(a).__name__ and type(b)._fields == type(a)._fields, path
    elif not (isinstance(a, float) and math.isnan(a)):
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert_identical(a[k], b[k], f"{path}[{k!r}]")
        if isinstance(a, collections.OrderedDict):
            assert_identical(getattr(a, "_metadata", None), getattr(b, "_metadata", None), path)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    elif isinstance(a, np.generic):
        assert type(a) is type(b) and (a == b or (np.isnan(a) and np.isnan(b))), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
