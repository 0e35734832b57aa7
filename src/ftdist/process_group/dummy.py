"""A group of one that completes every collective without communicating."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ftdist.process_group.base import Post, ProcessGroup
from ftdist.process_group.work import CompletedWork


def _copy(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src.reshape(dst.shape) if src.numel() == dst.numel() else src)
        return
    for d, s in zip(dst, src, strict=False):
        _copy(d, s)


class ProcessGroupDummy(ProcessGroup):
    """Discards everything and reports success. World size 1 only.

    For the rare case where an operation must be swallowed without changing
    the library that issues it (DDP's initial parameter broadcast, say).
    Gathers and scatters copy the input to the output, which is what a real
    group of one would do.

    Args:
        rank: must be 0.
        world: must be 1.

    Raises:
        ValueError: ``rank != 0`` or ``world != 1``.
    """

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        if rank != 0 or world != 1:
            raise ValueError(
                f"ProcessGroupDummy supports only rank 0 of world size 1, got rank={rank}, "
                f"world={world}"
            )
        self._rank, self._world_size = 0, 1
        self.configure_count = 0
        self.reconfigure_count = 0

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Count the call; nothing to connect.

        Raises:
            ValueError: ``rank != 0`` or ``world_size != 1``.
        """
        if rank != 0 or world_size != 1:
            raise ValueError(
                f"ProcessGroupDummy supports only rank 0 of world size 1, got rank={rank}, "
                f"world_size={world_size}"
            )
        self.configure_count += 1

    def reconfigure(self, opts: Any) -> dist.Work:
        """Count the call (``reconfigure_count``); nothing to connect.

        Args:
            opts: ignored.

        Returns:
            A completed Work.
        """
        self.reconfigure_count += 1
        return CompletedWork(None)

    def getBackendName(self) -> str:
        """``"ftdist-dummy"``."""
        return "ftdist-dummy"

    def _collective(self, op: str, args: tuple[Any, ...], post: Post = None) -> dist.Work:
        if op in (
            "allgather",
            "all_gather_single",
            "allgather_coalesced",
            "gather",
            "scatter",
            "reduce_scatter",
            "reduce_scatter_single",
            "all_to_all_single",
            "alltoall",
        ):
            out, inp = args[0], args[1]
            if op == "reduce_scatter":
                inp = [lst[0] for lst in inp]
            elif op == "scatter":
                inp = inp[0] if inp else out
            elif op == "gather":
                out = out[0] if out else inp
            _copy(out, inp)
            return CompletedWork(out)
        if op in ("send", "recv", "recv_anysource", "barrier"):
            return CompletedWork(None)  # nothing to exchange in a group of one
        return CompletedWork(args[0] if args else None)

    def _collective_many(
        self, op: str, calls: list[tuple[Any, ...]], post: Post = None
    ) -> dist.Work:
        for args in calls:
            self._collective(op, args)
        return CompletedWork([c[0] for c in calls])
