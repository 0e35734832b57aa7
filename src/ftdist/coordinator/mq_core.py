"""
The message queue's core: its handle, errors, wire format and shared state
==========================================================================

What both ends of a :class:`~ftdist.coordinator.MessageQueue` share: the
:class:`Handle` a reader joins with, the errors, how objects become frames
(pickle protocol 5, large buffers out of band), the ZeroMQ helpers, and
:class:`QueueCore`, the state and the waiting, shutdown and cleanup logic
every queue end runs. The writer's side is in ``mq_writer.py``, the
reader's in ``mq_reader.py``; ``message_queue.py`` joins them.

Invariants: a call waits in :meth:`QueueCore._wait`, which checks for
shutdown and dead peers every few milliseconds and honours its deadline;
one thread at a time uses a queue end; resources are released exactly once,
by whichever thread finishes last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import socket as _socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from ftdist.coordinator.shm_ring import ShmRingBuffer
from ftdist.errors import CollectiveTimeoutError, CommunicationError

logger = logging.getLogger("ftdist.coordinator.message_queue")

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
    return int(sock.getsockopt(zmq.EVENTS))


def _topic(token: bytes, rank: int) -> bytes:
    return _TOPIC_MARK + token + str(rank).encode()


class QueueCore:
    """The state and the waiting, shutdown and cleanup logic of a queue end.

    Not built directly; see :class:`~ftdist.coordinator.MessageQueue`.
    """

    buffer: ShmRingBuffer | None
    local_socket: zmq.Socket[Any] | None
    remote_socket: zmq.Socket[Any] | None
    handle: Handle
    writer_rank: int
    n_reader: int
    max_message_bytes: int

    def _init_common(self) -> None:
        self._is_writer = False
        self._is_local_reader = False
        self._is_remote_reader = False
        self.buffer = None
        self.local_socket = None
        self.remote_socket = None
        self._sub: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._ipc_dir: str | None = None
        self.current_idx = 0
        self._shutdown = threading.Event()
        self._closed = False
        self._broken: Exception | None = None
        self._op_lock = threading.Lock()
        self.rank = -1  # a reader's rank
        self.local_reader_rank = -1  # a local reader's index among the local readers
        self._writer_gone: str | None = None

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


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_READY_TIMEOUT_S",
    "Handle",
    "PeerGoneError",
    "QueueCore",
    "QueueShutdownError",
    "default_ip",
]
