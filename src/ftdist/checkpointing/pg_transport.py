"""
Process-group checkpoint transport
==================================

Sends the state over the replica process group itself (which the Manager has
just reconfigured to include the recovering replica), as the same stream the
HTTP transport writes (:mod:`._wire`), one message per part: the 32-byte
prefix, the plain-data header, each tensor's bytes, and the trailer. Every
message is a tensor on the transport's device, so NCCL can carry it.

Tensors are received in place into the recovering replica's own tensors when
it provides them (``state_dict=``) and they match (same path, dtype, shape,
strides and device type; for a DTensor, its local tensor). The header's
CRC-32 is checked before it is decoded, the step before any tensor is
received, and the whole stream's CRC-32 at the end.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from ftdist.checkpointing import _dtensor, _wire
from ftdist.checkpointing._codec import LeafMeta
from ftdist.checkpointing.transport import CheckpointTransport, TransferStats
from ftdist.errors import CollectiveTimeoutError

T = TypeVar("T")

_TAG_PREFIX, _TAG_HEADER, _TAG_TRAILER, _TAG_TENSOR = 1, 2, 3, 16


def _on(device: torch.device, data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _targets(state: Any) -> dict[tuple[Any, ...], torch.Tensor]:
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


class PGTransport(CheckpointTransport[T]):
    """Moves the state dict with send/recv on a process group.

    Args:
        pg: the group shared with the peers (replica ranks are its ranks).
        timeout: default timeout of each send and receive; an explicit
            per-call ``timeout`` wins (``timedelta(0)`` means the group's own).
        device: where tensors travel (``cpu`` for Gloo, ``cuda`` for NCCL).
        state_dict: optional; returns the receiver's current state, whose
            tensors are overwritten in place when they match.

    Raises:
        TypeError: ``timeout`` is not a timedelta.
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        device: torch.device | str = "cpu",
        state_dict: Callable[[], object] | None = None,
    ) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict
        self.last_transfer: TransferStats | None = None
        # A transfer that timed out left the group mid-message: it is
        # aborted, and later transfers fail at once until it is reconfigured.
        self._timed_out = False

    def metadata(self) -> str:
        """Not needed: peers meet on the process group."""
        return "<n/a>"

    def _wait(self, work: Any, timeout: timedelta | None, what: str) -> None:
        limit = self._timeout if timeout is None else timeout
        try:
            work.wait(limit)
        except TimeoutError as exc:
            self._timed_out = True
            abort = getattr(self._pg, "abort", None)
            if callable(abort):
                abort()
            # torchft's callers look for "timed out" in the message.
            raise CollectiveTimeoutError(
                f"checkpoint {what} timed out after {limit.total_seconds()} s: {exc}"
            ) from exc

    def _check_usable(self, what: str) -> None:
        errored = getattr(self._pg, "errored", None)
        if self._timed_out and callable(errored) and errored() is not None:
            raise CollectiveTimeoutError(
                f"checkpoint {what}: an earlier transfer on this group timed out and the "
                "group was aborted; reconfigure it first"
            )
        self._timed_out = False

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Send ``state_dict`` of ``step`` to every rank in ``dst_ranks``; blocks.

        Raises:
            TypeError: the state holds a leaf no transport can carry (the
                message names it).
            ValueError: the state has too many leaves for one header.
            CommunicationError: a send failed or timed out (a timeout aborts
                the group: later transfers fail at once until it is reconfigured).
        """
        self._check_usable(f"send to ranks {dst_ranks}")
        start = time.perf_counter()
        stream = _wire.plan(state_dict, step)[0]
        prefix = _on(self._device, stream.head[: _wire.PREFIX_BYTES])
        header = _on(self._device, stream.head[_wire.PREFIX_BYTES :])
        # The CRC is folded in while each tensor goes to the first peer (no
        # separate pass over the state); later peers reuse the trailer.
        crc, total = zlib.crc32(stream.head), len(stream.head)
        trailer: torch.Tensor | None = None
        for dst in dst_ranks:
            what = f"send to rank {dst}"
            self._wait(self._pg.send([prefix], dst, _TAG_PREFIX), timeout, what)
            self._wait(self._pg.send([header], dst, _TAG_HEADER), timeout, what)
            for i, t in enumerate(stream.tensors):
                flat = _wire.flat_bytes(t)
                if not flat.numel():
                    continue
                wire = flat.to(self._device)
                work = self._pg.send([wire], dst, _TAG_TENSOR + i)
                if trailer is None:
                    # Checksum a host copy if there is one: a device tensor
                    # would be copied to the host again for it.
                    crc = _wire.crc_flat(crc, wire if wire.device.type == "cpu" else flat)
                    total += flat.numel()
                self._wait(work, timeout, what)
            if trailer is None:
                trailer = _on(self._device, _wire.trailer_bytes(total, crc))
            self._wait(self._pg.send([trailer], dst, _TAG_TRAILER), timeout, what)
        self.last_transfer = TransferStats(total * len(dst_ranks), time.perf_counter() - start)

    def _recv_bytes(self, n: int, src: int, tag: int, timeout: timedelta | None) -> bytes:
        buf = torch.empty(n, dtype=torch.uint8, device=self._device)
        self._wait(self._pg.recv([buf], src, tag), timeout, f"receive from rank {src}")
        return bytes(_wire.host_view(buf.cpu()))

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None
    ) -> T:
        """Receive the state of ``step`` from ``src_rank``.

        Raises:
            CheckpointError: wrong step, a malformed header, or data that
                does not match its CRC.
            CommunicationError: a receive failed or timed out (a timeout aborts
                the group: later transfers fail at once until it is reconfigured).
        """
        self._check_usable(f"receive from rank {src_rank}")
        start = time.perf_counter()
        what = f"rank {src_rank}"
        prefix = self._recv_bytes(_wire.PREFIX_BYTES, src_rank, _TAG_PREFIX, timeout)
        header_len, body_len, header_crc = _wire.parse_prefix(prefix, what)
        raw = self._recv_bytes(header_len, src_rank, _TAG_HEADER, timeout)
        header = _wire.parse_header(raw, header_crc, body_len, what)
        _wire.check_step(header, step, what)
        targets = self._in_place_targets(header)
        tensors: dict[int, torch.Tensor] = {}
        crc, total = zlib.crc32(prefix + raw), len(prefix) + len(raw)
        for i, index in enumerate(header.carried):
            meta = header.leaves[index]
            dst = targets.get(index)
            if dst is None:
                dst = _wire.allocate(meta, self._device)
            flat = _wire.flat_bytes(dst)
            if flat.numel():
                work = self._pg.recv([flat], src_rank, _TAG_TENSOR + i)
                self._wait(work, timeout, f"receive from {what}")
                crc = _wire.crc_flat(crc, flat)
                total += flat.numel()
            tensors[index] = dst
        trailer = self._recv_bytes(_wire.TRAILER_BYTES, src_rank, _TAG_TRAILER, timeout)
        _wire.check_trailer(trailer, total, crc, what)
        self.last_transfer = TransferStats(total, time.perf_counter() - start)
        return cast(T, _wire.assemble(header, tensors))

    def _in_place_targets(self, header: _wire.Header) -> dict[int, torch.Tensor]:
        if self._state_dict is None:
            return {}
        mine = _targets(self._state_dict())
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
            if _fits(target, meta, self._device):
                targets[index] = target
        return targets


def _fits(t: torch.Tensor, meta: LeafMeta, device: torch.device) -> bool:
    """Whether ``t`` can receive ``meta``'s bytes in place, as laid out."""
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        return False
    if t.device.type != device.type or t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
        return False
    # Strides of size-1 dimensions do not change the layout.
    return all(
        sz == 1 or a == b for sz, a, b in zip(meta.shape, t.stride(), meta.stride, strict=True)
    )
