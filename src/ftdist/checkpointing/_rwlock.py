"""A writer-preferring reader-writer lock with timeouts, guarding the state peers read while healing.

Readers are checkpoint transfers streaming the live state; the writer is the
training loop about to mutate it (the optimizer step). Once a writer waits,
new readers wait behind it, so a stream of requests (slow, hostile or just
many) can never starve the writer: it waits only for the readers already in
flight, and the transport decides what to do with those at its deadline.

The write side may be released by another thread than the one that took it
(the HTTP transport takes it in ``disallow_checkpoint`` on the training
thread and releases it in ``allow_checkpoint`` on the quorum thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class LockClosedError(TimeoutError):
    """The lock was closed (its server is shutting down) while waiting for it."""


class RWLock:
    """Many readers or one writer; every acquire has a timeout; writers go first.

    Args:
        timeout: seconds an acquire may wait; negative waits forever.
    """

    def __init__(self, timeout: float = -1) -> None:
        self._timeout = timeout
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._closed = False

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float | None) -> None:
        limit = self._timeout if timeout is None else timeout
        deadline = None if limit < 0 else time.monotonic() + limit
        while True:
            if self._closed:
                raise LockClosedError(f"the {what} is closed: its server is shutting down")
            if ready():
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"Timed out waiting for {what} after {limit} seconds")
            self._cond.wait(remaining)

    def r_acquire(self, timeout: float | None = None) -> None:
        """Acquire as a reader; waits while a writer holds the lock or waits for it.

        Args:
            timeout: seconds to wait (default: the lock's timeout).

        Raises:
            TimeoutError: a writer held or wanted the lock past the timeout
                (:class:`LockClosedError` when the lock was closed).
        """
        with self._cond:
            self._wait(lambda: not self._writer and not self._writers_waiting, "rlock", timeout)
            self._readers += 1

    def r_release(self) -> None:
        """Release a read hold."""
        with self._cond:
            self._readers -= 1
            if self._readers <= 0:
                self._readers = 0
                self._cond.notify_all()

    def w_acquire(self, timeout: float | None = None) -> None:
        """Acquire as the writer; new readers wait from now on.

        Args:
            timeout: seconds to wait (default: the lock's timeout).

        Raises:
            TimeoutError: readers or another writer held it past the timeout
                (:class:`LockClosedError` when the lock was closed).
        """
        with self._cond:
            self._writers_waiting += 1
            try:
                self._wait(lambda: not self._writer and self._readers == 0, "wlock", timeout)
            finally:
                self._writers_waiting -= 1
                if not self._writers_waiting:
                    # Readers held back by this writer may go (if it gave up).
                    self._cond.notify_all()
            self._writer = True

    def w_force(self) -> None:
        """Take the write side now, whatever readers remain.

        For a writer that has already cut the remaining readers off (their
        transfers are aborted and can never complete), so it must not wait
        for them to notice. Their later :meth:`r_release` is harmless.
        """
        with self._cond:
            self._writer = True

    def w_release(self) -> None:
        """Release the write hold."""
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    def w_locked(self) -> bool:
        """True while the writer or any reader holds the lock (torchft's meaning)."""
        return self._writer or self._readers > 0

    @property
    def readers(self) -> int:
        """Readers holding the lock now."""
        return self._readers

    def close(self) -> None:
        """Make every waiting and later acquire fail with :class:`LockClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @contextmanager
    def r_lock(self) -> Iterator[None]:
        """Context manager form of :meth:`r_acquire`.

        Raises:
            TimeoutError: as :meth:`r_acquire`.
        """
        self.r_acquire()
        try:
            yield
        finally:
            self.r_release()

    @contextmanager
    def w_lock(self) -> Iterator[None]:
        """Context manager form of :meth:`w_acquire`.

        Raises:
            TimeoutError: as :meth:`w_acquire`.
        """
        self.w_acquire()
        try:
            yield
        finally:
            self.w_release()
