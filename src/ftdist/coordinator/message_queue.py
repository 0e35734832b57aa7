"""
The broadcast message queue
===========================

:class:`MessageQueue` sends Python objects from one writer to a fixed set of
readers, much faster than a pickled broadcast over a process group: readers
on the writer's host read them from a :class:`~.shm_ring.ShmRingBuffer`, and
readers on other hosts receive them from a ZeroMQ ``XPUB`` socket over TCP.

Invariants:

- **Order.** Every reader sees every message, in the order it was enqueued.
  Messages larger than a chunk still take their turn in the ring (a marker
  chunk) and travel through the writer's local socket.
- **Back-pressure.** The writer blocks when ``max_chunks`` messages are
  unread by some local reader, or when a remote reader's socket queue is
  full; it never drops a message.
- **Readiness.** :meth:`MessageQueue.wait_until_ready` is a handshake: the
  writer waits until every reader has subscribed, then sends ``READY``. No
  message can be lost to a reader that joined late.
- **Dead peers are errors, not hangs.** Each reader subscribes with a topic
  of its own (a per-queue secret plus its rank); when its process dies its
  socket closes and the writer receives the matching unsubscription, so a
  writer waiting on that reader raises :class:`PeerGoneError` naming the
  rank. A reader watches its connection to the writer and raises the same
  when it drops. A peer that stops without dying (SIGSTOP) is caught by the
  ``timeout`` of the call.
- **Trust.** Objects are pickled: the queue is for the ranks of one job.
  The TCP socket uses CurveZMQ, and a reader needs the writer's public key
  (in the :class:`Handle`, which travels over the job's own process group)
  to connect; the local socket lives in a directory only this user can
  enter. Inbound messages are bounded (``max_message_bytes`` for readers, a
  few kilobytes for what the writer receives: subscriptions and handshakes).

Ranks are ranks in the process group the queue was built over.

The shared state and wire format are in ``mq_core.py``, the writer in
``mq_writer.py``, the readers in ``mq_reader.py``; this module joins them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ftdist.coordinator.mq_core import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_READY_TIMEOUT_S,
    Handle,
    PeerGoneError,
    QueueShutdownError,
    _int_arg,
    _timeout_arg,
    default_ip,
)
from ftdist.coordinator.mq_reader import QueueReader
from ftdist.coordinator.mq_writer import QueueWriter


class MessageQueue(QueueWriter, QueueReader):
    """A one-writer, many-reader queue of Python objects (see the module docstring).

    The constructor builds the writer; readers come from
    :meth:`create_from_handle`. Most code calls
    :meth:`create_from_process_group`, which does both, collectively.

    Args:
        n_reader: readers in total.
        n_local_reader: readers on this host (they read shared memory).
        local_reader_ranks: the local readers' ranks; default
            ``range(n_local_reader)``.
        max_chunk_bytes: bytes per shared-memory chunk.
        max_chunks: chunks in the ring (messages in flight).
        connect_ip: address remote readers connect to; default
            :func:`default_ip`.
        writer_rank: the writer's rank, for error messages.
        max_message_bytes: the largest frame (pickle or out-of-band buffer)
            a message may have.

    Raises:
        TypeError, ValueError: a count or size of the wrong type or range,
            or ``local_reader_ranks`` of the wrong length or with duplicates.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: Sequence[int] | None = None,
        max_chunk_bytes: int = 24 * (1 << 20),
        max_chunks: int = 10,
        connect_ip: str | None = None,
        *,
        writer_rank: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._start_writer(
            n_reader,
            n_local_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            writer_rank,
            max_message_bytes,
        )

    # -- readers ---------------------------------------------------------------
    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        """Join the queue of ``handle`` as the reader of rank ``rank``.

        A rank listed in ``handle.local_reader_ranks`` reads shared memory;
        any other reads the TCP socket.

        Raises:
            TypeError: ``handle`` is not a :class:`Handle` or ``rank`` not an int.
            ValueError: ``rank`` is the writer's, or a remote reader's handle
                has no remote address.
            FileNotFoundError: a local reader cannot see the writer's
                shared memory (it is on another host).
        """
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be a MessageQueue Handle, got {type(handle).__name__}")
        _int_arg("rank", rank, 0)
        self = MessageQueue.__new__(MessageQueue)
        self._init_common()
        self._join(handle, rank)
        return self

    # -- readiness ---------------------------------------------------------------
    def wait_until_ready(self, timeout: float | None = DEFAULT_READY_TIMEOUT_S) -> None:
        """The readiness handshake; the writer and every reader call it.

        Args:
            timeout: seconds to wait for the other side (None: no limit).

        Raises:
            CollectiveTimeoutError: not every reader subscribed (writer; the
                message names the missing ranks) or no ``READY`` came
                (reader) within ``timeout``.
            PeerGoneError: a peer disconnected during the handshake.
            RuntimeError: the queue was shut down, or an unexpected first
                message arrived.
        """
        timeout = _timeout_arg(timeout)
        with self._op():
            if self._is_writer:
                self._writer_handshake(timeout)
            else:
                self._reader_handshake(timeout)

    # -- helpers ---------------------------------------------------------------------
    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer enqueues ``obj`` and returns it; a reader returns what it dequeues.

        Raises:
            See :meth:`enqueue` and :meth:`dequeue`.
        """
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def export_handle(self) -> Handle:
        """The :class:`Handle` readers join with (writer only).

        Raises:
            RuntimeError: called on a reader.
        """
        if not self._is_writer:
            raise RuntimeError("only the writer has a handle to export")
        return self.handle

    # -- collective construction ---------------------------------------------------------
    @staticmethod
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

        vLLM's name for :func:`ftdist.coordinator.mq_group.create_from_process_group`,
        which documents the arguments.

        Raises:
            ValueError: ``writer_rank`` is not a rank of ``pg``.
            TypeError: ``pg`` is not a process group.
            CollectiveTimeoutError, PeerGoneError: from the handshake.
        """
        from ftdist.coordinator.mq_group import create_from_process_group

        return create_from_process_group(
            pg,
            max_chunk_bytes,
            max_chunks,
            writer_rank,
            external_writer_handle,
            blocking,
            remote_reader_ranks=remote_reader_ranks,
            connect_ip=connect_ip,
            timeout=timeout,
        )

    @staticmethod
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
            with ``blocking=False`` both sides then call :meth:`wait_until_ready`.

        Raises:
            ValueError: ``reader_rank`` is not a rank of ``pg``.
            CollectiveTimeoutError: from the handshake (``blocking=True``).
        """
        from ftdist.coordinator.mq_group import create_from_process_group_single_reader

        return create_from_process_group_single_reader(
            pg, max_chunk_bytes, max_chunks, reader_rank, blocking, timeout=timeout
        )


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Handle",
    "MessageQueue",
    "PeerGoneError",
    "QueueShutdownError",
    "default_ip",
]
