"""
The message queue's writer
==========================

:class:`QueueWriter` is the writing end of a
:class:`~ftdist.coordinator.MessageQueue`, which owns it and calls it one
call at a time (the queue holds the lock and the shutdown flag). It owns the
shared-memory ring
(for readers on this host) and two ZeroMQ ``XPUB`` sockets (a local one for
messages larger than a chunk, a CurveZMQ TCP one for readers elsewhere),
counts its readers by their subscriptions, and learns of a dead reader from
its unsubscription.

Invariants: a message is published to the ring before its overflow frames
go to the local socket, so every reader sees one order; the writer waits
for room and never drops a message; once a reader is gone the queue stays
unusable (:class:`~.mq_core.PeerGoneError`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import zmq

from ftdist.coordinator.mq_core import (
    _READY,
    _TOPIC_MARK,
    Handle,
    PeerGoneError,
    Waiter,
    _events,
    _int_arg,
    _serialize,
    _zmq,
    default_ip,
)
from ftdist.coordinator.shm_ring import ShmRingBuffer, frames_size, mark_overflow, write_frames
from ftdist.errors import CollectiveTimeoutError


class QueueWriter:
    """The writing end of a queue (see the module docstring).

    Args:
        n_reader, n_local_reader, local_reader_ranks, max_chunk_bytes,
            max_chunks, connect_ip, writer_rank, max_message_bytes: as for
            :class:`~ftdist.coordinator.MessageQueue`.
        waiter: the queue's shutdown flag and wait loop.

    Attributes:
        handle: what readers join with.
        writer_rank, n_reader, n_local_reader, local_reader_ranks,
            max_message_bytes: as given (``local_reader_ranks`` filled in).
        n_remote_reader: the readers served over TCP.
        buffer: the ring of the local readers, or None without any.
        local_socket: the ``ipc://`` socket of overflow messages, or None.
        remote_socket: the CurveZMQ TCP socket of remote readers, or None.
        current_idx: the ring chunk the next message goes to.
        broken: the error that made the queue unusable (a reader is gone), or None.

    Raises:
        TypeError, ValueError: a count or size of the wrong type or range,
            or ``local_reader_ranks`` of the wrong length or with duplicates.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: Sequence[int] | None,
        max_chunk_bytes: int,
        max_chunks: int,
        connect_ip: str | None,
        writer_rank: int,
        max_message_bytes: int,
        waiter: Waiter,
    ) -> None:
        _int_arg("n_reader", n_reader, 0)
        _int_arg("n_local_reader", n_local_reader, 0)
        _int_arg("max_chunk_bytes", max_chunk_bytes, 64)
        _int_arg("max_chunks", max_chunks, 1)
        _int_arg("max_message_bytes", max_message_bytes, 1)
        if n_local_reader > n_reader:
            raise ValueError(f"n_local_reader ({n_local_reader}) exceeds n_reader ({n_reader})")
        ranks = (
            list(range(n_local_reader)) if local_reader_ranks is None else list(local_reader_ranks)
        )
        if len(ranks) != n_local_reader or len(set(ranks)) != len(ranks):
            raise ValueError(f"local_reader_ranks {ranks} must be {n_local_reader} distinct ranks")
        self._waiter = waiter
        self.writer_rank = writer_rank
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self.local_reader_ranks = ranks
        self.max_message_bytes = max_message_bytes
        self.buffer: ShmRingBuffer | None = None
        self.local_socket: zmq.Socket[Any] | None = None
        self.remote_socket: zmq.Socket[Any] | None = None
        self.current_idx = 0
        self.broken: Exception | None = None
        self._closed = False
        self._token = os.urandom(16)
        self._subscribed: dict[str, set[int]] = {"local": set(), "remote": set()}
        self._gone: dict[int, str] = {}
        self._ipc_dir: str | None = None
        handle = Handle(
            local_reader_ranks=ranks,
            writer_rank=writer_rank,
            token=self._token,
            max_message_bytes=max_message_bytes,
        )
        try:
            if n_local_reader:
                self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
                handle.buffer_handle = self.buffer.handle()
                self._ipc_dir = tempfile.mkdtemp(prefix="ftdist-mq-")  # mode 0700
                self.local_socket = self._writer_socket()
                handle.local_subscribe_addr = f"ipc://{self._ipc_dir}/s"
                self.local_socket.bind(handle.local_subscribe_addr)
            if self.n_remote_reader:
                ip = connect_ip or default_ip()
                public, secret = zmq.curve_keypair()
                sock = self._writer_socket()
                sock.curve_server = True
                sock.curve_secretkey = secret
                sock.curve_publickey = public
                ipv6 = ":" in ip
                if ipv6:
                    sock.setsockopt(zmq.IPV6, 1)
                host = f"[{ip}]" if ipv6 else ip
                port = sock.bind_to_random_port(f"tcp://{host}")
                self.remote_socket = sock
                handle.remote_subscribe_addr = f"tcp://{host}:{port}"
                handle.remote_addr_ipv6 = ipv6
                handle.server_public_key = public
        except BaseException:
            self.close()
            raise
        self.handle = handle

    def _writer_socket(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = _zmq().socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        # Never drop: a full queue makes send fail with EAGAIN, which the
        # writer turns into waiting (back-pressure), like a full ring.
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.setsockopt(zmq.SNDHWM, 1000)
        # What a writer receives is only subscriptions: bound them.
        sock.setsockopt(zmq.MAXMSGSIZE, 4096)
        return sock

    def handshake(self, timeout: float | None) -> None:
        """Wait until every reader subscribed, then send them ``READY``.

        Raises:
            CollectiveTimeoutError: not every reader subscribed within
                ``timeout``; the message names the missing ranks.
            PeerGoneError: a reader disconnected meanwhile.
            QueueShutdownError: the queue was shut down.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = zmq.Poller()
        for sock in (self.local_socket, self.remote_socket):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while not self._all_subscribed():
            self._drain_subscriptions()
            if self._gone:
                raise self._gone_error("during the readiness handshake")
            if self._all_subscribed():
                break
            self._waiter.check_shutdown()
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(self.local_reader_ranks) - self._subscribed["local"])
                raise CollectiveTimeoutError(
                    f"message queue writer (rank {self.writer_rank}) waited {timeout:.1f}s for "
                    f"its readers: local ranks {missing} and "
                    f"{self.n_remote_reader - len(self._subscribed['remote'])} of "
                    f"{self.n_remote_reader} remote readers never connected"
                )
            poller.poll(50)
        for sock in (self.local_socket, self.remote_socket):
            if sock is not None:
                self._send(sock, [_READY], deadline)
        # Every local reader has mapped the ring and connected: the names can
        # go, so a crash from here on leaves nothing in /dev/shm or /tmp.
        if self.buffer is not None:
            self.buffer.unlink()
        self._remove_ipc_dir()

    def _all_subscribed(self) -> bool:
        return (
            set(self.local_reader_ranks) <= self._subscribed["local"]
            and len(self._subscribed["remote"]) >= self.n_remote_reader
        )

    def _drain_subscriptions(self) -> None:
        prefix = _TOPIC_MARK + self._token
        for kind, sock in (("local", self.local_socket), ("remote", self.remote_socket)):
            if sock is None:
                continue
            while _events(sock) & zmq.POLLIN:
                try:
                    msg = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(msg) < 1 or not msg[1:].startswith(prefix):
                    continue  # the catch-all "" subscription, or not one of ours
                try:
                    rank = int(msg[1 + len(prefix) :])
                except ValueError:
                    continue
                if msg[:1] == b"\x01":
                    if kind == "local" and rank not in self.local_reader_ranks:
                        continue
                    self._subscribed[kind].add(rank)
                elif rank in self._subscribed[kind]:
                    self._gone[rank] = kind

    def _gone_error(self, when: str) -> PeerGoneError:
        ranks = sorted(self._gone)
        return PeerGoneError(
            f"message queue writer (rank {self.writer_rank}): reader rank(s) {ranks} "
            f"disconnected {when} (the process died or shut its queue down)",
            ranks,
        )

    # -- writing -------------------------------------------------------------------
    def frames(self, obj: Any) -> list[Any]:
        """``obj`` pickled into frames (the pickle, then its large buffers).

        Raises:
            ValueError: a frame exceeds ``max_message_bytes``.
        """
        frames = _serialize(obj)
        for f in frames:
            n = memoryview(f).nbytes
            if n > self.max_message_bytes:
                raise ValueError(
                    f"a frame of {n} bytes exceeds max_message_bytes ({self.max_message_bytes}); "
                    "raise max_message_bytes or send the data in parts"
                )
        return frames

    def write(self, frames: Sequence[Any], timeout: float | None) -> None:
        """Send ``frames`` to every reader: through the ring, the sockets, or both.

        Raises:
            QueueShutdownError: the queue was shut down.
            PeerGoneError: a reader is gone; :attr:`broken` is set.
            CollectiveTimeoutError: no room within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._raise_if_readers_gone()
        buf = self.buffer
        if buf is not None:
            idx = self.current_idx
            self._waiter.wait(
                lambda: buf.writable(idx),
                deadline,
                lambda: self._behind(idx),
                self._reader_failure,
            )
            buf.begin_write(idx)
            chunk = buf.data(idx)
            overflow = frames_size(frames) > buf.max_chunk_bytes
            if overflow:
                mark_overflow(chunk)
            else:
                write_frames(chunk, frames)
            del chunk
            buf.publish(idx)
            self.current_idx = (idx + 1) % buf.max_chunks
            if overflow:
                assert self.local_socket is not None
                self._send(self.local_socket, frames, deadline)
        if self.remote_socket is not None:
            self._send(self.remote_socket, frames, deadline)

    def _behind(self, idx: int) -> str:
        assert self.buffer is not None
        ranks = [self.local_reader_ranks[i] for i in self.buffer.unread_by(idx)]
        return f"room in the ring: local reader rank(s) {ranks} have not read chunk {idx}"

    def _raise_if_readers_gone(self) -> None:
        self._drain_subscriptions()
        if self._gone:
            self.broken = self._gone_error("")
            raise self.broken

    def _reader_failure(self) -> Exception | None:
        self._drain_subscriptions()
        return self._gone_error("while the writer waited for them") if self._gone else None

    def _send(self, sock: zmq.Socket[Any], frames: Sequence[Any], deadline: float | None) -> None:
        # Copied into zmq messages: out-of-band buffers are the caller's memory,
        # which may change once enqueue returns, and zero-copy sends would
        # start pyzmq's process-wide garbage-collector thread.
        parts = [zmq.Frame(f, copy=True) for f in frames]
        while True:
            try:
                sock.send_multipart(parts, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            self._waiter.wait(
                lambda: bool(_events(sock) & zmq.POLLOUT),
                deadline,
                lambda: "a reader to drain the socket",
                self._reader_failure,
            )

    # -- closing -------------------------------------------------------------------
    def close(self) -> None:
        """Release the sockets, the ring and the socket directory; only the first call acts."""
        if self._closed:
            return
        self._closed = True
        for sock in (self.local_socket, self.remote_socket):
            if sock is not None:
                # Messages still queued for live remote readers get a moment
                # to leave (in zmq's I/O thread; close itself does not block).
                sock.close(linger=1000)
        if self.buffer is not None:
            self.buffer.close()
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None


__all__ = ["QueueWriter"]
