"""
Receiving a stream into tensors
===============================

The receiving end of :mod:`._wire`'s streams: each carried tensor gets the
tensor that will hold it (the receiver's own, received in place, or a fresh
one on the host, out of a populated reserve or populated ahead of the bytes
by :class:`~._prefault.Prefaulter`), its bytes come from the stream or from a
direct read of the source's memory (:class:`BodySource`), and the state is
rebuilt from the header's tree (:func:`assemble`).

Tensors below :data:`~._wire.SMALL_TENSOR_BYTES` are received in batches of up
to :data:`~._wire.BATCH_BYTES` (:func:`~._wire.runs`): one read (or one
``process_vm_readv``) per batch instead of one per tensor. A state of 3000 16 KiB tensors (50 MB) took 0.6-0.9
s to receive one at a time between two processes here, against 27 ms for the
same bytes in 12 tensors: the per-tensor layers (the HTTP response's reads,
a system call, two hand-offs to the summing thread) cost more than the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from ftdist._gcpause import gc_paused
from ftdist.checkpointing import _codec, _dtensor
from ftdist.checkpointing._checksum import SegmentSum
from ftdist.checkpointing._codec import LeafMeta, where
from ftdist.checkpointing._prefault import Prefaulter, ReceiveReserve, allocate
from ftdist.checkpointing._wire import (
    SMALL_TENSOR_BYTES,
    Header,
    StreamReader,
    check_step,
    flat_bytes,
    runs,
)
from ftdist.errors import CheckpointError


class BodySource(Protocol):
    """Where a stream's tensor bytes come from when not from the stream itself."""

    def fill(self, batch: list[tuple[int, torch.Tensor]], progress: Callable[[int], None]) -> None:
        """Fill carried tensors, each given as (position among the carried,
        1-D uint8 CPU tensor), in stream order: one tensor, or a batch of
        small ones. Their bytes are accounted for in the reader, one segment
        each; ``progress`` is told each piece's size.
        """

    def finish(self) -> None:
        """Every tensor is filled; the trailer comes next."""


@gc_paused()
def read_leaves(
    reader: StreamReader,
    step: int,
    device: Callable[[LeafMeta], torch.device] | None = None,
    size: int | None = None,
    targets: Callable[[Header], Mapping[int, torch.Tensor]] | None = None,
    progress: Callable[[int], None] | None = None,
    body: Callable[[Header], BodySource | None] | None = None,
    reserve: ReceiveReserve | None = None,
    sums: dict[int, SegmentSum] | None = None,
) -> tuple[Header, dict[int, torch.Tensor]]:
    """Read one stream: the header and {leaf index: tensor}.

    Args:
        reader: the stream.
        step: the step the caller expects; any other is refused.
        device: where each fresh tensor lands (default: CPU). Tensors are
            received on the host and then moved.
        size: the stream's length when known.
        targets: given the checked header, the CPU tensors to receive into
            in place, by leaf index (see :mod:`._targets`); the other leaves
            get fresh tensors.
        progress: told the size of each piece of tensor data received.
        body: given the checked header, where the tensor bytes come from
            instead of the stream (a direct memory read), or None for the
            stream.
        reserve: populated memory for the fresh tensors that land on the host.
        sums: filled with each received tensor's word sums, by leaf index,
            once the trailer has vouched for them.

    Raises:
        CheckpointError: wrong step, malformed, truncated or corrupted stream.
    """
    try:
        header, got = _read_leaves(reader, step, device, size, targets, progress, body, reserve)
    finally:
        reader.close()
    if sums is not None:
        sums.update(zip(header.carried, reader.tensor_sums(), strict=True))
    return header, got


def _read_leaves(
    reader: StreamReader,
    step: int,
    device: Callable[[LeafMeta], torch.device] | None,
    size: int | None,
    targets: Callable[[Header], Mapping[int, torch.Tensor]] | None,
    progress: Callable[[int], None] | None,
    body: Callable[[Header], BodySource | None] | None,
    reserve: ReceiveReserve | None,
) -> tuple[Header, dict[int, torch.Tensor]]:
    header = reader.read_header(size)
    check_step(header, step, reader.what)
    source = body(header) if body is not None else None
    own = targets(header) if targets is not None else {}
    cpu = torch.device("cpu")
    got: dict[int, torch.Tensor] = {}
    leaves = header.leaves

    def place(index: int) -> torch.device:
        meta = leaves[index]
        return cpu if index in own or device is None or meta.kind == "ndarray" else device(meta)

    with Prefaulter() as prefault:
        # Fresh leaves land on the host, then move to their device.
        advance = prefault.advance

        if progress is not None:

            def advance(nbytes: int) -> None:
                prefault.advance(nbytes)
                progress(nbytes)

        def receive(batch: list[tuple[int, int, torch.Tensor]]) -> None:
            flats = [(pos, flat_bytes(t)) for pos, _, t in batch]
            if source is not None:
                source.fill(flats, advance)
            elif len(flats) == 1 and flats[0][1].numel() >= SMALL_TENSOR_BYTES:
                reader.read_into(flats[0][1], advance)
            else:
                reader.read_batch([flat for _, flat in flats], advance)
            for _, index, t in batch:
                to = place(index)
                got[index] = t if to.type == "cpu" else t.to(to)

        # Only leaves that stay on the host are carved out of the reserve: a
        # dropped staging copy would keep the reserve's mapping resident.
        on_host = (lambda index: place(index).type == "cpu") if reserve is not None else None
        for batch in staged_runs(header, own, cpu, prefault, reserve, on_host):
            receive(batch)
    if source is not None:
        source.finish()
    reader.read_trailer()
    return header, got


def staged_leaves(
    header: Header,
    own: Mapping[int, torch.Tensor],
    device: torch.device,
    prefault: Prefaulter,
    reserve: ReceiveReserve | None = None,
    on_host: Callable[[int], bool] | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """A stream's leaves in order: (position, leaf index, tensor that receives it).

    The tensor is the receiver's own (``own``, by leaf index) or a fresh one
    on ``device`` (out of ``reserve`` while it has room, for the leaves that
    ``on_host`` says stay there, by leaf index: all if None), allocated when its
    turn comes or when the prefault window reaches it, so that its pages are
    populated ahead of the bytes; a peer that announces a large state makes
    the receiver hold no more than the window beyond what it sent.
    """
    if reserve is not None:
        # The receive's own helper populates from here on, in stream order.
        reserve.stop()
    carried = header.carried
    staged: dict[int, torch.Tensor] = {}
    ahead = 0  # the next leaf to allocate
    for pos, index in enumerate(carried):
        while ahead <= pos or (ahead < len(carried) and prefault.wants_more()):
            leaf_index = carried[ahead]
            t = own.get(leaf_index)
            if t is None:
                keep = on_host is None or on_host(leaf_index)
                t = allocate(header.leaves[leaf_index], device, reserve if keep else None)
                prefault.add(t, fresh=True)
            else:
                prefault.add(t, fresh=False)
            staged[leaf_index] = t
            ahead += 1
        yield pos, index, staged.pop(index)


def staged_runs(
    header: Header,
    own: Mapping[int, torch.Tensor],
    device: torch.device,
    prefault: Prefaulter,
    reserve: ReceiveReserve | None = None,
    on_host: Callable[[int], bool] | None = None,
    lengths: Iterable[int] | None = None,
) -> Iterator[list[tuple[int, int, torch.Tensor]]]:
    """:func:`staged_leaves` grouped as they travel: one large tensor, or a
    batch of small ones (:func:`~._wire.runs`; ``lengths`` gives other runs).
    """
    sizes = iter(
        runs([header.leaves[i].nbytes for i in header.carried]) if lengths is None else lengths
    )
    batch: list[tuple[int, int, torch.Tensor]] = []
    want = 0
    for item in staged_leaves(header, own, device, prefault, reserve, on_host):
        if not batch:
            want = next(sizes)
        batch.append(item)
        if len(batch) == want:
            yield batch
            batch = []


def leaf(meta: LeafMeta, t: torch.Tensor) -> Any:
    """The state's leaf for tensor ``t`` received as ``meta`` (Parameter, DTensor, array...).

    Raises:
        CheckpointError: it cannot be rebuilt here.
    """
    try:
        if meta.kind == "ndarray":
            return t.cpu().numpy()
        if meta.kind == "dtensor" and meta.spec is not None:
            return _dtensor.build(t, meta.spec, meta.grad, meta.param, where(meta.path))
        if meta.kind == "parameter":
            return torch.nn.Parameter(t, requires_grad=meta.grad)
        return t.requires_grad_(True) if meta.grad else t
    except RuntimeError as exc:
        raise CheckpointError(f"cannot rebuild {where(meta.path)}: {exc}") from exc


def assemble(header: Header, tensors: dict[int, torch.Tensor]) -> Any:
    """Rebuild the state dict from a header and every chunk's tensors.

    Raises:
        CheckpointError: a tensor leaf is missing or cannot be rebuilt.
    """
    missing = [i for i in range(len(header.leaves)) if i not in tensors]
    if missing:
        raise CheckpointError(
            f"checkpoint is missing tensor leaf {where(header.leaves[missing[0]].path)}"
        )
    return _codec.build(header.tree, lambda i: leaf(header.leaves[i], tensors[i]))
