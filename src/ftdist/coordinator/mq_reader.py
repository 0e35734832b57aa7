"""
The message queue's readers
===========================

:class:`QueueReader` is a reading end of a
:class:`~ftdist.coordinator.MessageQueue`, which owns it and calls it one
call at a time (the queue holds the lock and the shutdown flag). A reader
on the writer's host reads the shared-memory ring (and the writer's local
socket for messages larger than a chunk); a reader elsewhere receives every
message from the writer's CurveZMQ TCP socket. Each subscribes under a
topic of its own, so the writer can count it, and watches its connection
to learn of the writer's death.

Invariants: a reader releases a chunk only after unpickling it (the objects
copy what they read, out-of-band buffers are copied out); a reader that
loses an overflow message stays unusable, since the stream cannot resume.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ftdist.coordinator.mq_core import (
    _READY,
    Handle,
    PeerGoneError,
    Waiter,
    _deserialize,
    _events,
    _topic,
    _zmq,
)
from ftdist.coordinator.shm_ring import INLINE, ShmRingBuffer, chunk_kind, read_frames
from ftdist.errors import CollectiveTimeoutError


class QueueReader:
    """A reading end of a queue: joins the queue of ``handle`` as rank ``rank``.

    Args:
        handle: the writer's :class:`~.mq_core.Handle`.
        rank: this reader's rank; a rank in ``handle.local_reader_ranks``
            reads shared memory, any other the TCP socket.
        waiter: the queue's shutdown flag and wait loop.

    Attributes:
        handle: the handle joined.
        writer_rank, max_message_bytes: the handle's.
        rank: this reader's rank.
        local_reader_rank: its index among the local readers; -1 for a remote reader.
        buffer: the writer's ring (a local reader), or None.
        current_idx: the ring chunk read next.
        broken: the error that made the queue unusable (an overflow message
            lost), or None.

    Raises:
        ValueError: a remote reader's handle has no remote address.
        FileNotFoundError: a local reader cannot see the writer's shared memory.
    """

    def __init__(self, handle: Handle, rank: int, waiter: Waiter) -> None:
        self._waiter = waiter
        self.handle = handle
        self.writer_rank = handle.writer_rank
        self.max_message_bytes = handle.max_message_bytes
        self.rank = rank
        self.local_reader_rank = -1
        self.is_local = False
        self.buffer: ShmRingBuffer | None = None
        self.current_idx = 0
        self.broken: Exception | None = None
        self._closed = False
        self._sub: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._writer_gone: str | None = None
        try:
            sock = _zmq().socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, handle.max_message_bytes)
            sock.setsockopt(zmq.RCVHWM, 0)
            self._sub = sock
            self._monitor = sock.get_monitor_socket()
            if rank in handle.local_reader_ranks:
                assert handle.buffer_handle is not None and handle.local_subscribe_addr
                self.buffer = ShmRingBuffer(*handle.buffer_handle)
                self.local_reader_rank = handle.local_reader_ranks.index(rank)
                self.is_local = True
                addr = handle.local_subscribe_addr
            else:
                if handle.remote_subscribe_addr is None or handle.server_public_key is None:
                    raise ValueError(
                        f"rank {rank} is not a local reader of this queue and the queue has no "
                        "remote socket; it was built for different readers"
                    )
                if handle.remote_addr_ipv6:
                    sock.setsockopt(zmq.IPV6, 1)
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey = handle.server_public_key
                sock.curve_publickey = public
                sock.curve_secretkey = secret
                addr = handle.remote_subscribe_addr
            # "" first: the writer counts a reader once its own topic
            # arrives, and by then the catch-all subscription is in place.
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.SUBSCRIBE, _topic(handle.token, rank))
            sock.connect(addr)
        except BaseException:
            self.close()
            raise

    def handshake(self, timeout: float | None) -> None:
        """Wait for the writer's ``READY``.

        Raises:
            CollectiveTimeoutError: no ``READY`` within ``timeout``.
            PeerGoneError: the writer is gone.
            QueueShutdownError: the queue was shut down.
            RuntimeError: the first message was something else.
        """
        frames = self._recv(timeout, "the READY message of the handshake")
        if len(frames) != 1 or bytes(frames[0]) != _READY:
            raise RuntimeError("message queue handshake: the first message was not READY")

    # -- reading ---------------------------------------------------------------------
    def read(self, timeout: float | None, indefinite: bool) -> Any:
        """The next object; ``indefinite``: log no warning however long it takes.

        Raises:
            QueueShutdownError: the queue was (or got) shut down.
            CollectiveTimeoutError: nothing arrived within ``timeout``.
            PeerGoneError: the writer is gone.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.is_local:
            found, obj = self._read_chunk(deadline, indefinite)
            if found:
                return obj
            # The chunk was an overflow marker and is released: the
            # stream cannot resume if its message does not arrive.
            try:
                frames = self._recv(
                    None if deadline is None else max(0.0, deadline - time.monotonic()),
                    "an overflow message",
                    indefinite,
                )
            except Exception as exc:
                self.broken = exc
                raise
        else:
            frames = self._recv(timeout, "the next message", indefinite)
        return _deserialize(frames)

    def _read_chunk(self, deadline: float | None, quiet: bool) -> tuple[bool, Any]:
        """``(True, obj)`` for an inline chunk; ``(False, None)`` for an overflow marker."""
        buf, reader, idx = self.buffer, self.local_reader_rank, self.current_idx
        assert buf is not None
        self._waiter.wait(
            lambda: buf.readable(idx, reader),
            deadline,
            lambda: "the next message",
            self._writer_failure,
            quiet,
        )
        chunk = buf.data(idx)
        try:
            if chunk_kind(chunk) != INLINE:
                found, obj = False, None
            else:
                # Unpickled straight from shared memory (it copies what it
                # reads) before the chunk is released; only out-of-band
                # buffers, which objects would alias, are copied out.
                frames = read_frames(chunk, copy_first=False)
                try:
                    found, obj = True, _deserialize(frames)
                finally:
                    frames[0].release()
                    del frames
        finally:
            chunk.release()
        buf.mark_read(idx, reader)
        self.current_idx = (idx + 1) % buf.max_chunks
        return found, obj

    def _recv(self, timeout: float | None, what: str, quiet: bool = False) -> list[Any]:
        sock = self._sub
        assert sock is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while not sock.poll(0):
            self._waiter.check_shutdown()
            error = self._writer_failure()
            if error is not None and not sock.poll(0):
                raise error
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CollectiveTimeoutError(
                    f"message queue reader (rank {self.rank}): no {what} from writer rank "
                    f"{self.writer_rank} within {timeout:.3f}s"
                )
            slice_ms = 50 if remaining is None else max(0, min(50, int(remaining * 1000)))
            sock.poll(slice_ms)
        frames = sock.recv_multipart(copy=False)
        # Out-of-band buffers become writable arrays on this side.
        return [frames[0].buffer, *(bytearray(f.buffer) for f in frames[1:])]

    def _writer_failure(self) -> Exception | None:
        monitor = self._monitor
        if monitor is not None and self._writer_gone is None:
            while _events(monitor) & zmq.POLLIN:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
                kind = event["event"]
                if kind == zmq.EVENT_DISCONNECTED:
                    self._writer_gone = "its connection closed (the writer died or shut down)"
                elif kind in (
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                ):
                    self._writer_gone = "the CurveZMQ handshake failed (wrong handle?)"
        if self._writer_gone is None:
            return None
        return PeerGoneError(
            f"message queue reader (rank {self.rank}): writer rank {self.writer_rank} is gone: "
            f"{self._writer_gone}",
            [self.writer_rank],
        )

    # -- closing -------------------------------------------------------------------
    def close(self) -> None:
        """Release the socket, its monitor and the ring mapping; only the first call acts."""
        if self._closed:
            return
        self._closed = True
        sub = self._sub
        if sub is not None and self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
        for sock in (self._monitor, sub):
            if sock is not None:
                sock.close(linger=0)
        if self.buffer is not None:
            self.buffer.close()


__all__ = ["QueueReader"]
