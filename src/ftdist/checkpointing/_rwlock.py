"""A reader-writer lock with timeouts, guarding state that peers read while healing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RWLock:
    """Many readers or one writer; every acquire has a timeout.

    Readers are checkpoint transfers streaming the live state; the writer is
    the training loop about to mutate it (the optimizer step). A writer
    waits for in-flight readers to finish, so a peer never receives a state
    torn between two steps.

    Args:
        timeout: seconds an acquire may wait; negative waits forever.
    """

    def __init__(self, timeout: float = -1) -> None:
        self._timeout = timeout
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def _wait(self, ready: object, what: str) -> None:
        timeout = None if self._timeout < 0 else self._timeout
        if not self._cond.wait_for(ready, timeout):  # type: ignore[arg-type]
            raise TimeoutError(f"timed out after {self._timeout}s waiting for the {what} lock")

    def r_acquire(self) -> None:
        """Acquire as a reader.

        Raises:
            TimeoutError: a writer held the lock past the timeout.
        """
        with self._cond:
            self._wait(lambda: not self._writer, "read")
            self._readers += 1

    def r_release(self) -> None:
        """Release a read hold."""
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def w_acquire(self) -> None:
        """Acquire as the writer.

        Raises:
            TimeoutError: readers or another writer held it past the timeout.
        """
        with self._cond:
            self._wait(lambda: not self._writer and self._readers == 0, "write")
            self._writer = True

    def w_release(self) -> None:
        """Release the write hold."""
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    def w_locked(self) -> bool:
        """True while the writer holds the lock."""
        return self._writer

    @contextmanager
    def r_lock(self) -> Iterator[None]:
        """Context manager form of :meth:`r_acquire`."""
        self.r_acquire()
        try:
            yield
        finally:
            self.r_release()

    @contextmanager
    def w_lock(self) -> Iterator[None]:
        """Context manager form of :meth:`w_acquire`."""
        self.w_acquire()
        try:
            yield
        finally:
            self.w_release()
