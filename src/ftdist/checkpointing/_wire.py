"""
The checkpoint stream format
============================

A state dict crosses the wire as one stream, written straight from the live
tensors and read straight into the tensors that will hold the result: no
serialised copy of the whole state exists on either side.

::

    magic (8) | header length (8) | header (pickle) | tensor bytes ... | trailer (16)

The header holds the step, the pytree spec, the non-tensor leaves and each
tensor's dtype and shape. Tensor bytes are each tensor's contents in
row-major order. The trailer holds the number of bytes before it and their
CRC-32, so a truncated or corrupted stream is an error, never a silently
wrong model.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from ftdist.errors import CheckpointError

MAGIC = b"FTDSTCK1"
_LEN = struct.Struct("<Q")
_TRAILER = struct.Struct("<QQ")
# Device-to-host copies and socket writes go in pieces of this size, so a
# GPU state never needs a second full copy in host memory.
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver needs to allocate a tensor leaf."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int


@dataclass(frozen=True)
class Header:
    """The stream header.

    A stream may carry only some of the tensor leaves (one of several
    parallel chunks); ``carried`` lists their leaf indices, in stream order.
    """

    step: int
    spec: Any
    leaves: list[Any]  # TensorMeta for tensor leaves, the value otherwise
    carried: list[int]


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, flat.view(torch.uint8).numpy())).cast("B")


def plan(state_dict: Any, step: int, num_chunks: int = 1) -> list[tuple[bytes, list[torch.Tensor]]]:
    """Split a state dict into ``num_chunks`` streams: (encoded header, tensors) each.

    Tensor leaves are dealt round-robin across the chunks; every chunk's
    header describes all leaves, so each chunk decodes on its own.

    Raises:
        TypeError: a leaf is a tensor subclass (e.g. DTensor) or a sparse
            tensor, which this format does not carry.
    """
    leaves, spec = tree_flatten(state_dict)
    metas: list[Any] = []
    tensors: list[torch.Tensor] = []
    tensor_index: list[int] = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor and not isinstance(leaf, torch.nn.Parameter):
                raise TypeError(
                    f"cannot stream a {type(leaf).__name__} leaf; convert it to a "
                    "plain tensor (e.g. DTensor.to_local()) in the state_dict function"
                )
            if leaf.layout != torch.strided:
                raise TypeError(f"cannot stream a {leaf.layout} tensor; densify it first")
            t = leaf.detach()
            metas.append(
                TensorMeta(tuple(t.shape), t.dtype, str(t.device), t.numel() * t.element_size())
            )
            tensors.append(t)
            tensor_index.append(index)
        else:
            metas.append(leaf)
    try:
        # A TreeSpec pickles with version-specific classes; its JSON form is
        # stable across torch versions. Custom containers fall back to pickle.
        portable_spec: Any = treespec_dumps(spec)
    except Exception:
        portable_spec = spec
    streams = []
    for chunk in range(max(1, num_chunks)):
        carried = tensor_index[chunk :: max(1, num_chunks)]
        header = pickle.dumps(
            Header(step, portable_spec, metas, carried), protocol=pickle.HIGHEST_PROTOCOL
        )
        streams.append((header, tensors[chunk :: max(1, num_chunks)]))
    return streams


def stream_size(header: bytes, tensors: list[torch.Tensor]) -> int:
    """Total bytes of the stream for this plan (for Content-Length)."""
    body = sum(t.numel() * t.element_size() for t in tensors)
    return len(MAGIC) + _LEN.size + len(header) + body + _TRAILER.size


def chunks(header: bytes, tensors: list[torch.Tensor]) -> Iterator[memoryview | bytes]:
    """The stream as a sequence of buffers; the last one is the trailer.

    CPU tensors are yielded as views of their own memory (contiguous ones
    without any copy); CUDA tensors are copied to host :data:`CHUNK_BYTES` at
    a time.
    """
    crc = 0
    total = 0

    def emit(buf: memoryview | bytes) -> memoryview | bytes:
        nonlocal crc, total
        crc = zlib.crc32(buf, crc)
        total += len(buf)
        return buf

    yield emit(MAGIC + _LEN.pack(len(header)))
    yield emit(header)
    for t in tensors:
        if t.device.type == "cpu":
            view = _byte_view(t.contiguous())
            for start in range(0, len(view), CHUNK_BYTES):
                yield emit(view[start : start + CHUNK_BYTES])
        else:
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), CHUNK_BYTES):
                yield emit(_byte_view(flat[start : start + CHUNK_BYTES].cpu()))
    yield _TRAILER.pack(total, crc)


def crc_update(crc: int, t: torch.Tensor) -> int:
    """Fold the bytes of tensor ``t`` (any device) into ``crc``."""
    if t.device.type == "cpu":
        return zlib.crc32(_byte_view(t.contiguous()), crc)
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), CHUNK_BYTES):
        crc = zlib.crc32(_byte_view(flat[start : start + CHUNK_BYTES].cpu()), crc)
    return crc


def stream_prefix(header: bytes) -> bytes:
    """The bytes a stream starts with, before the header."""
    return MAGIC + _LEN.pack(len(header))


class StreamReader:
    """Reads a stream through ``readinto`` and checks it as it goes.

    Args:
        readinto: fills a memoryview, returning the number of bytes read
            (0 at end of stream), like ``io.RawIOBase.readinto``.
        what: names the source in error messages.
    """

    def __init__(self, readinto: Callable[[memoryview], int], what: str) -> None:
        self._readinto = readinto
        self._what = what
        self._crc = 0
        self._total = 0

    def _fill(self, view: memoryview, check: bool = True) -> None:
        got = 0
        while got < len(view):
            n = self._readinto(view[got:])
            if not n:
                raise CheckpointError(
                    f"checkpoint stream from {self._what} was truncated after "
                    f"{self._total + got} bytes"
                )
            got += n
        if check:
            self._crc = zlib.crc32(view, self._crc)
            self._total += len(view)

    def read_header(self) -> Header:
        """Read and decode the header.

        Raises:
            CheckpointError: not an ftdist checkpoint stream, or truncated.
        """
        prefix = bytearray(len(MAGIC) + _LEN.size)
        self._fill(memoryview(prefix))
        if bytes(prefix[: len(MAGIC)]) != MAGIC:
            raise CheckpointError(f"{self._what} did not send an ftdist checkpoint stream")
        (length,) = _LEN.unpack_from(prefix, len(MAGIC))
        raw = bytearray(length)
        self._fill(memoryview(raw))
        header = pickle.loads(bytes(raw))
        if not isinstance(header, Header):
            raise CheckpointError(f"{self._what} sent a malformed checkpoint header")
        return header

    def read_into(self, t: torch.Tensor) -> None:
        """Fill contiguous CPU tensor ``t`` from the stream."""
        view = _byte_view(t)
        for start in range(0, len(view), CHUNK_BYTES):
            self._fill(view[start : start + CHUNK_BYTES])

    def read_trailer(self) -> None:
        """Check the trailer against what was read.

        Raises:
            CheckpointError: the byte count or the CRC-32 differ.
        """
        raw = bytearray(_TRAILER.size)
        self._fill(memoryview(raw), check=False)
        total, crc = _TRAILER.unpack(raw)
        if total != self._total or crc != self._crc:
            raise CheckpointError(
                f"checkpoint stream from {self._what} is corrupt: received {self._total} bytes "
                f"with CRC-32 {self._crc:#010x}, sender wrote {total} bytes with CRC-32 {crc:#010x}"
            )


def read_leaves(
    reader: StreamReader, step: int, device: Callable[[TensorMeta], torch.device] | None = None
) -> tuple[Header, dict[int, torch.Tensor]]:
    """Read one stream into fresh tensors: the header and {leaf index: tensor}.

    Args:
        reader: the stream.
        step: the step the caller expects; any other is refused.
        device: where each tensor lands (default: CPU). Tensors are received
            on the host and then moved.

    Raises:
        CheckpointError: wrong step, truncated or corrupted stream.
    """
    header = reader.read_header()
    if header.step != step:
        raise CheckpointError(
            f"refusing checkpoint of step {header.step} from {reader._what}: expected step {step}"
        )
    got: dict[int, torch.Tensor] = {}
    for index in header.carried:
        meta = header.leaves[index]
        t = torch.empty(meta.shape, dtype=meta.dtype)
        reader.read_into(t)
        target = device(meta) if device is not None else torch.device("cpu")
        got[index] = t if target.type == "cpu" else t.to(target)
    reader.read_trailer()
    return header, got


def assemble(header: Header, tensors: dict[int, torch.Tensor]) -> Any:
    """Rebuild the state dict from a header and every chunk's tensors.

    Raises:
        CheckpointError: a tensor leaf is missing.
    """
    leaves = []
    for index, leaf in enumerate(header.leaves):
        if isinstance(leaf, TensorMeta):
            if index not in tensors:
                raise CheckpointError(f"checkpoint is missing tensor leaf {index}")
            leaves.append(tensors[index])
        else:
            leaves.append(leaf)
    spec = treespec_loads(header.spec) if isinstance(header.spec, str) else header.spec
    return tree_unflatten(leaves, spec)
