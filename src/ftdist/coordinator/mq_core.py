"""
The message queue's core: its handle, errors, wire format and waiting
=====================================================================

What both ends of a :class:`~ftdist.coordinator.MessageQueue` share: the
:class:`Handle` a reader joins with, the errors, how objects become frames
(pickle protocol 5, large buffers out of band), the ZeroMQ helpers, and
:class:`Waiter`, the wait loop that watches for shutdown and dead peers.
The writing end is :class:`~.mq_writer.QueueWriter`, a reading end
:class:`~.mq_reader.QueueReader`; ``message_queue.py`` holds the queue,
which owns one of them.

Invariants: a call waits in :meth:`Waiter.wait`, which checks for shutdown
and dead peers every few milliseconds and honours its deadline.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from ftdist.coordinator import config
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
    return config.host_ip()


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


class Waiter:
    """How a queue end waits, and the queue's shutdown flag it watches.

    A :class:`~ftdist.coordinator.MessageQueue` builds one and hands it to
    its end; :meth:`~ftdist.coordinator.MessageQueue.shutdown` sets
    :attr:`shutdown`, and a wait in another thread notices within a few
    milliseconds.

    Args:
        role: the end, as messages name it (``"writer rank 0"``).
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self.shutdown = threading.Event()

    def check_shutdown(self) -> None:
        """Raise if the queue was shut down.

        Raises:
            QueueShutdownError: it was.
        """
        if self.shutdown.is_set():
            raise QueueShutdownError(f"message queue ({self.role}) was shut down (cancelled)")

    def wait(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        describe: Callable[[], str],
        failure: Callable[[], Exception | None],
        quiet: bool = False,
    ) -> None:
        """Wait until ``ready()``: spin briefly, then sleep; check peers every few ms.

        Args:
            ready: the condition waited for.
            deadline: ``time.monotonic()`` to give up at (None: never).
            describe: what is waited for, for the timeout and the warnings.
            failure: the error a dead peer makes (None while all live).
            quiet: log no warning however long the wait.

        Raises:
            QueueShutdownError: the queue was shut down.
            CollectiveTimeoutError: ``deadline`` passed.
            Exception: what ``failure()`` returned, unless ``ready()`` by then.
        """
        if ready():
            return
        start = time.monotonic()
        next_check = start
        next_warn = start + WARN_INTERVAL_S
        while True:
            now = time.monotonic()
            if now >= next_check:
                self.check_shutdown()
                error = failure()
                if error is not None:
                    if ready():  # what the peer did before it went still counts
                        return
                    raise error
                next_check = now + CHECK_INTERVAL_S
            if deadline is not None and now >= deadline:
                raise CollectiveTimeoutError(
                    f"message queue ({self.role}): waited {now - start:.3f}s for {describe()}"
                )
            if not quiet and now >= next_warn:
                logger.warning(
                    "message queue (%s): still waiting after %.0f s for %s",
                    self.role,
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


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_READY_TIMEOUT_S",
    "Handle",
    "PeerGoneError",
    "QueueShutdownError",
    "Waiter",
    "default_ip",
]
