"""
Building message queues over a process group
============================================

The collective constructors behind ``MessageQueue.create_from_process_group``
and ``create_from_process_group_single_reader``, and the same-host probe
they use. Every rank of the group calls them, in the same order; the
writer's :class:`~.message_queue.Handle` travels over the group itself, so
only its members learn the queue's addresses and key.
"""

from __future__ import annotations

from collections.abc import Collection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
import torch.distributed as dist

from ftdist.coordinator.message_queue import (
    DEFAULT_READY_TIMEOUT_S,
    Handle,
    MessageQueue,
    _int_arg,
)
from ftdist.coordinator.shm_ring import attach_shm


def create_from_process_group(
    pg: Any,
    max_chunk_bytes: int,
    max_chunks: int,
    writer_rank: int = 0,
    external_writer_handle: Handle | None = None,
    blocking: bool = True,
    *,
    remote_reader_ranks: Collection[int] = (),
    connect_ip: str | None = None,
    timeout: float = DEFAULT_READY_TIMEOUT_S,
) -> MessageQueue:
    """Build a queue over ``pg`` (collective): ``writer_rank`` writes, the others read.

    Readers on the writer's host (found with :func:`in_the_same_node_as`)
    read shared memory; the others use the TCP socket.

    Args:
        pg: a CPU process group (Gloo, or an ftdist group); ranks are its ranks.
        max_chunk_bytes: bytes per chunk.
        max_chunks: chunks in the ring.
        writer_rank: the writing rank.
        external_writer_handle: a queue written by a process outside
            ``pg``: ``writer_rank`` passes its handle and every rank of
            ``pg`` (``writer_rank`` too) becomes a reader.
        blocking: run :meth:`MessageQueue.wait_until_ready` before returning.
        remote_reader_ranks: ranks to serve over TCP even on the
            writer's host (what a reader on another host gets).
        connect_ip: address remote readers connect to.
        timeout: seconds for the handshake.

    Returns:
        The writer's or this reader's end of the queue.

    Raises:
        ValueError: ``writer_rank`` is not a rank of ``pg``.
        TypeError: ``pg`` is not a process group.
        CollectiveTimeoutError, PeerGoneError: from the handshake.
    """
    rank, size = group_rank_and_size(pg)
    _int_arg("writer_rank", writer_rank, 0)
    if writer_rank >= size:
        raise ValueError(f"writer_rank ({writer_rank}) is not a rank of a group of size {size}")
    if external_writer_handle is not None and not isinstance(external_writer_handle, Handle):
        raise TypeError(
            "external_writer_handle must be a MessageQueue Handle, got "
            f"{type(external_writer_handle).__name__}"
        )
    forced = set(remote_reader_ranks)
    # Only the writer rank knows whether the writer is external, so every
    # rank takes the same steps and learns it with the handle.
    same_node = in_the_same_node_as(pg, source_rank=writer_rank)
    objs: list[Any] = [None]
    mq: MessageQueue | None = None
    if rank == writer_rank:
        if external_writer_handle is not None:
            objs[0] = external_writer_handle
        else:
            local = [
                r for r in range(size) if r != writer_rank and same_node[r] and r not in forced
            ]
            mq = MessageQueue(
                size - 1,
                len(local),
                local,
                max_chunk_bytes,
                max_chunks,
                connect_ip,
                writer_rank=writer_rank,
            )
            objs[0] = mq.export_handle()
    try:
        dist.broadcast_object_list(objs, group=pg, group_src=writer_rank)
    except BaseException:
        if mq is not None:
            mq.shutdown()
        raise
    if mq is None:
        mq = MessageQueue.create_from_handle(objs[0], rank)
    if blocking:
        try:
            mq.wait_until_ready(timeout)
        except BaseException:
            mq.shutdown()
            raise
    return mq


def create_from_process_group_single_reader(
    pg: Any,
    max_chunk_bytes: int,
    max_chunks: int,
    reader_rank: int = 0,
    blocking: bool = False,
    *,
    timeout: float = DEFAULT_READY_TIMEOUT_S,
) -> tuple[MessageQueue, list[Handle]]:
    """Every rank of ``pg`` writes its own queue with one reader, ``reader_rank`` (collective).

    Returns:
        ``(queue, handles)``: this rank's writer, and on ``reader_rank``
        every rank's :class:`Handle` in rank order (empty elsewhere). The
        reader joins each with ``MessageQueue.create_from_handle(h, reader_rank)``;
        with ``blocking=False`` both sides then call :meth:`MessageQueue.wait_until_ready`.

    Raises:
        ValueError: ``reader_rank`` is not a rank of ``pg``.
        CollectiveTimeoutError: from the handshake (``blocking=True``).
    """
    rank, size = group_rank_and_size(pg)
    _int_arg("reader_rank", reader_rank, 0)
    if reader_rank >= size:
        raise ValueError(f"reader_rank ({reader_rank}) is not a rank of a group of size {size}")
    same_node = in_the_same_node_as(pg, source_rank=reader_rank)
    local = [reader_rank] if same_node[rank] else []
    mq = MessageQueue(1, len(local), local, max_chunk_bytes, max_chunks, writer_rank=rank)
    handles: list[Any] | None = [None] * size if rank == reader_rank else None
    try:
        dist.gather_object(mq.export_handle(), handles, group=pg, group_dst=reader_rank)
        if blocking:
            mq.wait_until_ready(timeout)
    except BaseException:
        mq.shutdown()
        raise
    return mq, list(handles or [])


def group_rank_and_size(pg: Any) -> tuple[int, int]:
    """This process's rank in ``pg`` and its size (works without a default group).

    Raises:
        TypeError: ``pg`` is not a ``torch.distributed.ProcessGroup``.
    """
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"expected a torch.distributed.ProcessGroup, got {type(pg).__name__}")
    return pg.rank(), pg.size()


def in_the_same_node_as(pg: Any, source_rank: int = 0) -> list[bool]:
    """Which ranks of ``pg`` share a host (shared memory) with ``source_rank`` (collective).

    The source creates a small shared-memory segment holding a magic string,
    the others try to open it, and the answers are all-reduced.

    Returns:
        One bool per rank of ``pg``, in rank order (``source_rank``'s is True).

    Raises:
        ValueError: ``source_rank`` is not a rank of ``pg``.
        TypeError: ``pg`` is not a process group.
    """
    rank, size = group_rank_and_size(pg)
    _int_arg("source_rank", source_rank, 0)
    if source_rank >= size:
        raise ValueError(f"source_rank ({source_rank}) is not a rank of a group of size {size}")
    magic = b"ftdist same-node probe"
    shm: SharedMemory | None = None
    objs: list[Any] = [None]
    if rank == source_rank:
        shm = SharedMemory(create=True, size=128)
        assert shm.buf is not None
        shm.buf[: len(magic)] = magic
        objs[0] = shm.name
    try:
        dist.broadcast_object_list(objs, group=pg, group_src=source_rank)
        same = rank == source_rank
        if not same:
            try:
                peer = attach_shm(objs[0])
            except OSError:
                pass  # not on this host
            else:
                same = peer[: len(magic)] == magic
                peer.close()
        # The source must not unlink before everyone has looked.
        dist.barrier(group=pg)
    finally:
        if shm is not None:
            shm.close()
            shm.unlink()
    flags = torch.zeros(size, dtype=torch.int32)
    flags[rank] = int(same)
    dist.all_reduce(flags, group=pg)
    return [bool(v) for v in flags.tolist()]


__all__ = [
    "create_from_process_group",
    "create_from_process_group_single_reader",
    "group_rank_and_size",
    "in_the_same_node_as",
]
