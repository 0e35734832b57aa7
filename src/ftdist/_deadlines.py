"""
Deadlines
=========

Every future ftdist hands out completes within a timeout, even when what it
waits for never does (a hung peer, a stopped child process). One timer
thread serves all of those deadlines: it sleeps until the nearest one, runs
its callback, and exits once it has had nothing to watch for a moment, so
an idle process (or a test that finished) keeps no thread around.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch

__all__ = ["DEADLINES", "Deadline", "Deadlines", "future_with_timeout", "when_done"]

T = TypeVar("T")

# How long the timer thread lingers with nothing to watch before it exits.
_IDLE_EXIT_S = 0.2


class Deadline:
    """A scheduled callback; :meth:`cancel` it when it is no longer needed."""

    __slots__ = ("_owner", "cancelled", "fn", "when")

    def __init__(self, owner: Deadlines, when: float, fn: Callable[[], None]) -> None:
        self._owner = owner
        self.when = when
        self.fn = fn
        self.cancelled = False

    def __lt__(self, other: Deadline) -> bool:
        return self.when < other.when

    def cancel(self) -> None:
        """Do not run the callback (a no-op once it ran)."""
        self._owner._cancel(self)


class Deadlines:
    """Runs callbacks at their deadlines on one thread that exits when idle.

    Args:
        name: the timer thread's name.
    """

    def __init__(self, name: str = "ftdist-deadlines") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> Deadline:
        """Run ``fn`` on the timer thread ``delay_s`` seconds from now.

        ``fn`` must be quick and must not raise; what it raises is dropped.
        """
        deadline = Deadline(self, time.monotonic() + max(0.0, delay_s), fn)
        with self._cond:
            heapq.heappush(self._heap, (deadline.when, next(self._seq), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            else:
                self._cond.notify()
        return deadline

    def _cancel(self, deadline: Deadline) -> None:
        with self._cond:
            if deadline.cancelled:
                return
            deadline.cancelled = True
            # Keep the heap small: a cancelled entry is what most deadlines
            # become (the future completed in time).
            self._heap = [e for e in self._heap if e[2] is not deadline]
            heapq.heapify(self._heap)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        self._cond.wait(_IDLE_EXIT_S)
                        if not self._heap:
                            self._thread = None
                            return
                        continue
                    when, _, deadline = self._heap[0]
                    now = time.monotonic()
                    if when <= now:
                        heapq.heappop(self._heap)
                        deadline.cancelled = True
                        break
                    self._cond.wait(when - now)
            try:
                deadline.fn()
            except Exception:  # a callback must not take the timer down
                pass

    def pending(self) -> int:
        """How many deadlines are waiting."""
        with self._cond:
            return len(self._heap)


DEADLINES = Deadlines()
"""The process's timer."""


def when_done(
    fut: torch.futures.Future[T],
    timeout: timedelta,
    callback: Callable[[T | None, BaseException | None], None],
) -> None:
    """Call ``callback(value, None)`` when ``fut`` completes, ``(None, error)``
    when it fails, or ``(None, TimeoutError)`` once ``timeout`` passed first.

    The callback runs exactly once, on the thread that completed ``fut`` or on
    the timer thread; it must not raise.
    """
    lock = threading.Lock()
    settled = [False]

    def settle(value: T | None, error: BaseException | None) -> None:
        with lock:
            if settled[0]:
                return
            settled[0] = True
        callback(value, error)

    deadline = DEADLINES.schedule(
        timeout.total_seconds(),
        lambda: settle(None, TimeoutError(f"future did not complete within {timeout}")),
    )

    def done(f: torch.futures.Future[T]) -> None:
        deadline.cancel()
        try:
            value = f.value()
        except Exception as exc:
            settle(None, exc)
        else:
            settle(value, None)

    fut.add_done_callback(done)


def future_with_timeout(
    fut: torch.futures.Future[T], timeout: timedelta
) -> torch.futures.Future[T]:
    """A future with ``fut``'s outcome, or a ``TimeoutError`` once ``timeout`` passed.

    Args:
        fut: the future to bound.
        timeout: how long to wait for it.

    Returns:
        A new future; ``fut`` itself is left as it is.
    """
    out: torch.futures.Future[T] = torch.futures.Future()

    def settle(value: T | None, error: BaseException | None) -> None:
        if error is not None:
            out.set_exception(error)  # type: ignore[arg-type]
        else:
            out.set_result(value)  # type: ignore[arg-type]

    when_done(fut, timeout, settle)
    return out
