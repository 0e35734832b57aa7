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

A queue is either the writer or a reader, and it owns that end: a
:class:`~.mq_writer.QueueWriter` or a :class:`~.mq_reader.QueueReader`,
which do the ring and socket work. :class:`MessageQueue` itself keeps the
API and the lifetime both share: one call at a time, shutdown from any
thread, and resources released once. The handle, errors, wire format and
wait loop are in ``mq_core.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import zmq

from ftdist.coordinator.mq_core import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_READY_TIMEOUT_S,
    Handle,
    PeerGoneError,
    QueueShutdownError,
    Waiter,
    _int_arg,
    _timeout_arg,
    default_ip,
)
from ftdist.coordinator.mq_reader import QueueReader
from ftdist.coordinator.mq_writer import QueueWriter
from ftdist.coordinator.shm_ring import ShmRingBuffer


class MessageQueue:
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

    _end: QueueWriter | QueueReader
    _waiter: Waiter
    _op_lock: threading.Lock

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
        self._init_lifetime(f"writer rank {writer_rank}")
        self._end = QueueWriter(
            n_reader,
            n_local_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            writer_rank,
            max_message_bytes,
            self._waiter,
        )

    def _init_lifetime(self, role: str) -> None:
        self._waiter = Waiter(role)
        # One call at a time; shutdown() closes only when no call holds it.
        self._op_lock = threading.Lock()

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
        self._init_lifetime(f"reader rank {rank} of writer rank {handle.writer_rank}")
        self._end = QueueReader(handle, rank, self._waiter)
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
            self._end.handshake(timeout)

    # -- writing and reading ---------------------------------------------------------
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send ``obj`` to every reader (writer only).

        Args:
            obj: any picklable object.
            timeout: seconds to wait for room (None: no limit; a reader that
                dies is still detected).

        Raises:
            RuntimeError: not the writer.
            QueueShutdownError: the queue was shut down (a ``RuntimeError``).
            ValueError: a frame of the pickled object exceeds ``max_message_bytes``.
            PeerGoneError: a reader is gone; the queue stays unusable.
            CollectiveTimeoutError: no room within ``timeout`` (a reader is
                stuck); the message names the readers behind.
        """
        writer = self._end
        if not isinstance(writer, QueueWriter):
            raise RuntimeError("Only the writer can enqueue")
        timeout = _timeout_arg(timeout)
        frames = writer.frames(obj)
        with self._op():
            writer.write(frames, timeout)

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Receive the next object (readers only).

        Args:
            timeout: seconds to wait (None: until a message, the writer's
                death, or :meth:`shutdown`).
            indefinite: accepted for vLLM compatibility: no warning is
                logged however long the call waits.

        Raises:
            RuntimeError: not a reader.
            QueueShutdownError: the queue was (or got) shut down (a ``RuntimeError``).
            CollectiveTimeoutError: nothing arrived within ``timeout`` (a
                ``TimeoutError``); the queue stays usable.
            PeerGoneError: the writer is gone.
        """
        reader = self._end
        if not isinstance(reader, QueueReader):
            raise RuntimeError("Only readers can dequeue")
        timeout = _timeout_arg(timeout)
        with self._op():
            return reader.read(timeout, indefinite)

    # -- helpers ---------------------------------------------------------------------
    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer enqueues ``obj`` and returns it; a reader returns what it dequeues.

        Raises:
            See :meth:`enqueue` and :meth:`dequeue`.
        """
        if self.is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def export_handle(self) -> Handle:
        """The :class:`Handle` readers join with (writer only).

        Raises:
            RuntimeError: called on a reader.
        """
        if not self.is_writer:
            raise RuntimeError("only the writer has a handle to export")
        return self.handle

    # -- lifetime --------------------------------------------------------------------
    @property
    def shutting_down(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._waiter.shutdown.is_set()

    def shutdown(self) -> None:
        """Stop the queue; safe from any thread, and more than once.

        A call blocked in another thread raises ``RuntimeError`` within a few
        milliseconds; sockets and shared memory are released by whichever
        thread finishes last.
        """
        self._waiter.shutdown.set()
        if self._op_lock.acquire(blocking=False):
            try:
                self._end.close()
            finally:
                self._op_lock.release()

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        self._waiter.check_shutdown()
        broken = self._end.broken
        if broken is not None:
            raise RuntimeError(
                f"message queue ({self._waiter.role}) is unusable after an earlier "
                f"failure: {broken}"
            ) from broken
        if not self._op_lock.acquire(blocking=False):
            raise RuntimeError(
                "a MessageQueue is used by one thread at a time; another call is in progress"
            )
        try:
            yield
        finally:
            self._op_lock.release()
            if self._waiter.shutdown.is_set():
                self._end.close()

    def __del__(self) -> None:
        # A construction that failed has no end (it closed what it opened).
        with contextlib.suppress(Exception):
            self._waiter.shutdown.set()
            self._end.close()

    # -- the end's state, under vLLM's attribute names ---------------------------------
    @property
    def is_writer(self) -> bool:
        """True for the writer."""
        return isinstance(self._end, QueueWriter)

    @property
    def handle(self) -> Handle:
        """The writer's :class:`Handle` (a reader: the one it joined)."""
        return self._end.handle

    @property
    def writer_rank(self) -> int:
        """The writer's rank."""
        return self._end.writer_rank

    @property
    def max_message_bytes(self) -> int:
        """The largest frame a message may have."""
        return self._end.max_message_bytes

    @property
    def buffer(self) -> ShmRingBuffer | None:
        """The shared-memory ring (the writer with local readers, a local reader), or None."""
        return self._end.buffer

    @property
    def current_idx(self) -> int:
        """The ring chunk written or read next."""
        return self._end.current_idx

    @property
    def rank(self) -> int:
        """A reader's rank; -1 on the writer."""
        return self._end.rank if isinstance(self._end, QueueReader) else -1

    @property
    def local_reader_rank(self) -> int:
        """A local reader's index among the local readers; -1 otherwise."""
        return self._end.local_reader_rank if isinstance(self._end, QueueReader) else -1

    @property
    def n_reader(self) -> int:
        """The writer's readers in total; 0 on a reader."""
        return self._end.n_reader if isinstance(self._end, QueueWriter) else 0

    @property
    def local_socket(self) -> zmq.Socket[Any] | None:
        """The writer's ``ipc://`` socket of overflow messages; None on a reader."""
        return self._end.local_socket if isinstance(self._end, QueueWriter) else None

    @property
    def remote_socket(self) -> zmq.Socket[Any] | None:
        """The writer's TCP socket for remote readers; None on a reader."""
        return self._end.remote_socket if isinstance(self._end, QueueWriter) else None

    @property
    def n_local_reader(self) -> int:
        """The writer's readers on this host.

        Raises:
            AttributeError: on a reader.
        """
        return self._writer("n_local_reader").n_local_reader

    @property
    def n_remote_reader(self) -> int:
        """The writer's readers on other hosts (or forced onto TCP).

        Raises:
            AttributeError: on a reader.
        """
        return self._writer("n_remote_reader").n_remote_reader

    @property
    def local_reader_ranks(self) -> list[int]:
        """The ranks of the writer's local readers.

        Raises:
            AttributeError: on a reader.
        """
        return self._writer("local_reader_ranks").local_reader_ranks

    def _writer(self, attribute: str) -> QueueWriter:
        if not isinstance(self._end, QueueWriter):
            raise AttributeError(f"a MessageQueue reader has no {attribute} (the writer's)")
        return self._end

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
