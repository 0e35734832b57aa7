"""
Process-group checkpoint transport
==================================

Sends the state over the replica process group itself (which the Manager has
just reconfigured to include the recovering replica), one ``send`` per
tensor, received in place into the recovering replica's own tensors when it
can provide them. A CRC-32 over the header and every tensor's bytes is sent
last and checked, as with the HTTP transport.
"""

from __future__ import annotations

import pickle
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
from torch.utils._pytree import tree_flatten

from ftdist.checkpointing import _wire
from ftdist.checkpointing.transport import CheckpointTransport, TransferStats
from ftdist.errors import CheckpointError

T = TypeVar("T")

_TAG_LEN, _TAG_HEADER, _TAG_TRAILER, _TAG_TENSOR = 1, 2, 3, 16


class PGTransport(CheckpointTransport[T]):
    """Moves the state dict with send/recv on a process group.

    Args:
        pg: the group shared with the peers (replica ranks are its ranks).
        timeout: default timeout of each transfer.
        device: where tensors travel (``cpu`` for Gloo, ``cuda`` for NCCL).
        state_dict: optional; returns the receiver's current state, whose
            tensors are overwritten in place when shapes and dtypes match.

    Raises:
        TypeError: ``timeout`` is not a timedelta.
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        device: torch.device | str = "cpu",
        state_dict: Callable[[], T] | None = None,
    ) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict
        self.last_transfer: TransferStats | None = None

    def metadata(self) -> str:
        """Not needed: peers meet on the process group."""
        return "<n/a>"

    def _wait(self, work: Any, timeout: timedelta | None) -> None:
        work.wait(timeout or self._timeout)

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Send ``state_dict`` of ``step`` to every rank in ``dst_ranks``; blocks.

        Raises:
            CommunicationError: a send failed or timed out.
        """
        start = time.perf_counter()
        header, tensors = _wire.plan(state_dict, step)[0]
        prefix = _wire.stream_prefix(header) + header
        raw = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        for dst in dst_ranks:
            self._wait(
                self._pg.send([torch.tensor([raw.numel()], dtype=torch.int64)], dst, _TAG_LEN),
                timeout,
            )
            self._wait(self._pg.send([raw.to(self._device)], dst, _TAG_HEADER), timeout)
            # The CRC is folded in while each tensor is on the wire: no
            # separate pass over the state before sending.
            crc, total = zlib.crc32(prefix), len(prefix)
            for i, t in enumerate(tensors):
                wire = t.contiguous().reshape(-1).view(torch.uint8).to(self._device)
                work = self._pg.send([wire], dst, _TAG_TENSOR + i)
                crc = _wire.crc_update(crc, t)
                total += t.numel() * t.element_size()
                self._wait(work, timeout)
            self._wait(
                self._pg.send([torch.tensor([total, crc], dtype=torch.int64)], dst, _TAG_TRAILER),
                timeout,
            )
        self.last_transfer = TransferStats(total * len(dst_ranks), time.perf_counter() - start)

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None
    ) -> T:
        """Receive the state of ``step`` from ``src_rank``.

        Raises:
            CheckpointError: wrong step, or the data does not match its CRC.
            CommunicationError: a receive failed or timed out.
        """
        start = time.perf_counter()
        length = torch.zeros(1, dtype=torch.int64)
        self._wait(self._pg.recv([length], src_rank, _TAG_LEN), timeout)
        raw = torch.empty(int(length.item()), dtype=torch.uint8, device=self._device)
        self._wait(self._pg.recv([raw], src_rank, _TAG_HEADER), timeout)
        raw_bytes = raw.cpu().numpy().tobytes()
        crc = zlib.crc32(raw_bytes)
        header = pickle.loads(raw_bytes[len(_wire.stream_prefix(b"")) :])
        if header.step != step:
            raise CheckpointError(
                f"refusing checkpoint of step {header.step} from rank "
                f"{src_rank}: expected step {step}"
            )
        targets = self._in_place_targets(header)
        tensors: dict[int, torch.Tensor] = {}
        total = len(raw_bytes)
        for i, index in enumerate(header.carried):
            meta = header.leaves[index]
            target = targets.get(index)
            dst = (
                target
                if target is not None
                else torch.empty(meta.shape, dtype=meta.dtype, device=self._device)
            )
            wire = dst.reshape(-1).view(torch.uint8)
            self._wait(self._pg.recv([wire], src_rank, _TAG_TENSOR + i), timeout)
            crc = _wire.crc_update(crc, dst)
            total += meta.nbytes
            tensors[index] = dst
        trailer = torch.zeros(2, dtype=torch.int64)
        self._wait(self._pg.recv([trailer], src_rank, _TAG_TRAILER), timeout)
        sent_total, sent_crc = (int(v) for v in trailer.tolist())
        if (sent_total, sent_crc) != (total, crc):
            raise CheckpointError(
                f"checkpoint from rank {src_rank} is corrupt: received {total} bytes with "
                f"CRC-32 {crc:#010x}, sender wrote {sent_total} bytes with CRC-32 {sent_crc:#010x}"
            )
        self.last_transfer = TransferStats(total, time.perf_counter() - start)
        return cast(T, _wire.assemble(header, tensors))

    def _in_place_targets(self, header: _wire.Header) -> dict[int, torch.Tensor]:
        if self._state_dict is None:
            return {}
        leaves, _ = tree_flatten(self._state_dict())
        if len(leaves) != len(header.leaves):
            return {}
        targets = {}
        for index in header.carried:
            meta, mine = header.leaves[index], leaves[index]
            if (
                isinstance(mine, torch.Tensor)
                and tuple(mine.shape) == meta.shape
                and mine.dtype == meta.dtype
                and mine.is_contiguous()
                and mine.device.type == self._device.type
            ):
                targets[index] = mine.detach()
        return targets
