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
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import socket as _socket
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ftdist.coordinator.shm_ring import (
    INLINE,
    ShmRingBuffer,
    chunk_kind,
    frames_size,
    mark_overflow,
    read_frames,
    write_frames,
)
from ftdist.errors import CollectiveTimeoutError, CommunicationError

logger = logging.getLogger(__name__)

# Out-of-band pickle buffers at least this large (numpy/tensor storage) are
# sent as frames of their own instead of being copied into the pickle.
OOB_THRESHOLD = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 1 << 32
# How often a blocked call looks for dead peers and shutdown.
CHECK_INTERVAL_S = 0.01
# How long a blocked call spins (yielding the CPU) before it starts to sleep.
SPIN_S = 0.002
# A call blocked this long logs a warning (then again after as long).
WARN_INTERVAL_S = 60.0
DEFAULT_READY_TIMEOUT_S = 60.0
# Environment variable: the address remote readers reach this host's writer at.
HOST_IP_ENV = "FTDIST_HOST_IP"

_READY = b"READY"
_TOPIC_MARK = b"\xff"


class PeerGoneError(CommunicationError):
    """A message queue's writer or reader process is gone (died or closed its end).

    Attributes:
        ranks: the ranks (in the queue's group) that are gone.
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class QueueShutdownError(CommunicationError):
    """The queue was shut down (by :meth:`MessageQueue.shutdown` or an abort).

    A ``RuntimeError``, as vLLM's "cancelled" error is.
    """


@dataclass
class Handle:
    """What a reader needs to join a queue; picklable, sent over the job's process group.

    Attributes:
        local_reader_ranks: ranks that read through shared memory.
        buffer_handle: the ring's ``(n_reader, max_chunk_bytes, max_chunks,
            name)``, or None without local readers.
        local_subscribe_addr: ``ipc://`` address of the local socket.
        remote_subscribe_addr: ``tcp://host:port`` of the remote socket.
        remote_addr_ipv6: the remote address is IPv6.
        writer_rank: the writer's rank, for error messages.
        token: per-queue secret in every reader's subscription topic.
        server_public_key: CurveZMQ key a remote reader must know to connect.
        max_message_bytes: the largest frame a reader accepts.
    """

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    writer_rank: int = 0
    token: bytes = b""
    server_public_key: bytes | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


def _int_arg(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _timeout_arg(timeout: float | None, name: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name} must be seconds (a float) or None, got {timeout!r}")
    if timeout < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {timeout}")
    return float(timeout)


def default_ip() -> str:
    """The address this host's writers advertise to remote readers.

    ``$FTDIST_HOST_IP`` if set, else what the host name resolves to.
    """
    ip = os.environ.get(HOST_IP_ENV)
    if ip:
        return ip
    try:
        return _socket.gethostbyname(_socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _serialize(obj: Any) -> list[Any]:
    buffers: list[Any] = []

    def oob(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < OOB_THRESHOLD:
            return True  # small: pickled in-band
        buffers.append(raw)
        return False

    main = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=oob)
    return [main, *buffers]


def _deserialize(frames: Sequence[Any]) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


def _zmq() -> zmq.Context[Any]:
    # One context per process; pyzmq makes a fresh one after a fork.
    return zmq.Context.instance()


def _events(sock: zmq.Socket[Any]) -> int:
    return int(sock.getsockopt(zmq.EVENTS))  # type: ignore[arg-type]


def _topic(token: bytes, rank: int) -> bytes:
    return _TOPIC_MARK + token + str(rank).encode()


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

    buffer: ShmRingBuffer | None
    local_socket: zmq.Socket[Any] | None
    remote_socket: zmq.Socket[Any] | None

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
        self._init_common()
        self._is_writer = True
        self.writer_rank = writer_rank
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self.local_reader_ranks = ranks
        self.max_message_bytes = max_message_bytes
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
            self._close_resources()
            raise
        self.handle = handle

    def _init_common(self) -> None:
        self._is_writer = False
        self._is_local_reader = False
        self._is_remote_reader = False
        self.buffer = None
        self.local_socket = None
        self.remote_socket = None
        self._sub: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._ipc_dir = None
        self.current_idx = 0
        self._shutdown = threading.Event()
        self._closed = False
        self._broken: Exception | None = None
        self._op_lock = threading.Lock()
        self.rank = -1  # a reader's rank
        self.local_reader_rank = -1  # a local reader's index among the local readers
        self._writer_gone: str | None = None

    def _writer_socket(self) -> zmq.Socket[Any]:
        sock = _zmq().socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        # Never drop: a full queue makes send fail with EAGAIN, which the
        # writer turns into waiting (back-pressure), like a full ring.
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.setsockopt(zmq.SNDHWM, 1000)
        # What a writer receives is only subscriptions: bound them.
        sock.setsockopt(zmq.MAXMSGSIZE, 4096)
        return sock

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
                frames = self._recv(timeout, "the READY message of the handshake")
                if len(frames) != 1 or bytes(frames[0]) != _READY:
                    raise RuntimeError("message queue handshake: the first message was not READY")

    def _writer_handshake(self, timeout: float | None) -> None:
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
            self._check_shutdown()
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
        if not self._is_writer:
            raise RuntimeError("Only the writer can enqueue")
        timeout = _timeout_arg(timeout)
        frames = _serialize(obj)
        for f in frames:
            n = memoryview(f).nbytes
            if n > self.max_message_bytes:
                raise ValueError(
                    f"a frame of {n} bytes exceeds max_message_bytes ({self.max_message_bytes}); "
                    "raise max_message_bytes or send the data in parts"
                )
        with self._op():
            deadline = None if timeout is None else time.monotonic() + timeout
            self._raise_if_readers_gone()
            buf = self.buffer
            if buf is not None:
                idx = self.current_idx
                self._wait(
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
            self._broken = self._gone_error("")
            raise self._broken

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
            self._wait(
                lambda: bool(_events(sock) & zmq.POLLOUT),
                deadline,
                lambda: "a reader to drain the socket",
                self._reader_failure,
            )

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

    # -- waiting -----------------------------------------------------------------------
    def _wait(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        failure: Callable[[], Exception | None],
        quiet: bool = False,
    ) -> None:
        """Wait until ``ready()``: spin briefly, then sleep; check peers every few ms."""
        if ready():
            return
        start = time.monotonic()
        next_check = start
        next_warn = start + WARN_INTERVAL_S
        while True:
            now = time.monotonic()
            if now >= next_check:
                self._check_shutdown()
                error = failure()
                if error is not None:
                    if ready():  # what the peer did before it went still counts
                        return
                    raise error
                next_check = now + CHECK_INTERVAL_S
            if deadline is not None and now >= deadline:
                raise CollectiveTimeoutError(
                    f"message queue ({self._role()}): waited {now - start:.3f}s for {describe()}"
                )
            if not quiet and now >= next_warn:
                logger.warning(
                    "message queue (%s): still waiting after %.0f s for %s",
                    self._role(),
                    now - start,
                    describe(),
                )
                next_warn += WARN_INTERVAL_S
            idle = now - start
            if idle < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(5e-5 if idle < 0.05 else 5e-4)
            if ready():
                return

    def _role(self) -> str:
        if self._is_writer:
            return f"writer rank {self.writer_rank}"
        return f"reader rank {self.rank} of writer rank {self.writer_rank}"

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

    @property
    def shutting_down(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._shutdown.is_set()

    @property
    def is_writer(self) -> bool:
        """True for the writer."""
        return self._is_writer

    def _check_shutdown(self) -> None:
        if self._shutdown.is_set():
            raise QueueShutdownError(f"message queue ({self._role()}) was shut down (cancelled)")

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        self._check_shutdown()
        if self._broken is not None:
            raise RuntimeError(
                f"message queue ({self._role()}) is unusable after an earlier "
                f"failure: {self._broken}"
            ) from self._broken
        if not self._op_lock.acquire(blocking=False):
            raise RuntimeError(
                "a MessageQueue is used by one thread at a time; another call is in progress"
            )
        try:
            yield
        finally:
            self._op_lock.release()
            if self._shutdown.is_set():
                self._close_resources()

    def shutdown(self) -> None:
        """Stop the queue; safe from any thread, and more than once.

        A call blocked in another thread raises ``RuntimeError`` within a few
        milliseconds; sockets and shared memory are released by whichever
        thread finishes last.
        """
        self._shutdown.set()
        if self._op_lock.acquire(blocking=False):
            try:
                self._close_resources()
            finally:
                self._op_lock.release()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def _close_resources(self) -> None:
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
        for sock in (self.local_socket, self.remote_socket):
            if sock is not None:
                # Messages still queued for live remote readers get a moment
                # to leave (in zmq's I/O thread; close itself does not block).
                sock.close(linger=1000)
        if self.buffer is not None:
            self.buffer.close()
        self._remove_ipc_dir()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._shutdown.set()
            self._close_resources()

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
            blocking: run :meth:`wait_until_ready` before returning.
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
