"""
The message queue's readers
===========================

:class:`QueueReader` is a reading end of a
:class:`~ftdist.coordinator.MessageQueue`. A reader on the writer's host
reads the shared-memory ring (and the writer's local socket for messages
larger than a chunk); a reader elsewhere receives every message from the
writer's CurveZMQ TCP socket. Each subscribes under a topic of its own, so
the writer can count it, and watches its connection to learn of the
writer's death.

Invariants: a reader releases a chunk only after unpickling it (the objects
copy what they read, out-of-band buffers are copied out); a reader that
loses an overflow message stays unusable, since the stream cannot resume.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ftdist.coordinator.mq_core import (
    _READY,
    Handle,
    PeerGoneError,
    QueueCore,
    _deserialize,
    _events,
    _timeout_arg,
    _topic,
    _zmq,
)
from ftdist.coordinator.shm_ring import INLINE, ShmRingBuffer, chunk_kind, read_frames
from ftdist.errors import CollectiveTimeoutError


class QueueReader(QueueCore):
    """A reading end of a queue (see the module docstring)."""

    def _join(self, handle: Handle, rank: int) -> None:
        """Connect as the reader of rank ``rank`` (``MessageQueue.create_from_handle``).

        Raises:
            ValueError: a remote reader's handle has no remote address.
            FileNotFoundError: a local reader cannot see the writer's shared memory.
        """
        self.writer_rank = handle.writer_rank
        self.handle = handle
        self.max_message_bytes = handle.max_message_bytes
        self.n_reader = 0
        self.rank = rank
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
                self._is_local_reader = True
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
                self._is_remote_reader = True
                addr = handle.remote_subscribe_addr
            # "" first: the writer counts a reader once its own topic
            # arrives, and by then the catch-all subscription is in place.
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.SUBSCRIBE, _topic(handle.token, rank))
            sock.connect(addr)
        except BaseException:
            self._close_resources()
            raise

    def _reader_handshake(self, timeout: float | None) -> None:
        frames = self._recv(timeout, "the READY message of the handshake")
        if len(frames) != 1 or bytes(frames[0]) != _READY:
            raise RuntimeError("message queue handshake: the first message was not READY")

    # -- reading ---------------------------------------------------------------------
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
        if not (self._is_local_reader or self._is_remote_reader):
            raise RuntimeError("Only readers can dequeue")
        timeout = _timeout_arg(timeout)
        with self._op():
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._is_local_reader:
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
                    self._broken = exc
                    raise
            else:
                frames = self._recv(timeout, "the next message", indefinite)
            return _deserialize(frames)

    def _read_chunk(self, deadline: float | None, quiet: bool) -> tuple[bool, Any]:
        """``(True, obj)`` for an inline chunk; ``(False, None)`` for an overflow marker."""
        buf, reader, idx = self.buffer, self.local_reader_rank, self.current_idx
        assert buf is not None
        self._wait(
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
            self._check_shutdown()
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


__all__ = ["QueueReader"]
