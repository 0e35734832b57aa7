"""
Timeouts for futures, code blocks and accelerator streams
=========================================================

torchft's ``torchft.futures``, both generations:

* :func:`future_timeout`: a future that fails with ``TimeoutError`` if the
  given one has not completed in time.
* :func:`future_wait`: wait for a future, at most so long.
* :func:`context_timeout`: run a callback if a ``with`` block has not exited
  in time (e.g. abort a process group stuck in a collective).
* :func:`stream_timeout`: run a callback if the work queued so far on the
  current accelerator stream has not finished in time.

One timer thread serves every timeout of the process. Unlike torchft's, it
exists only while a timer is pending (it exits after a short idle linger and
is started again on the next timer), so no thread outlives the work it
times; :meth:`_TimeoutManager.shutdown` stops it at once. Callbacks run on
the timer thread and must not block: every other timeout waits for them. A
watchdog thread, alive alongside the timer thread, treats a callback that
runs longer than ``FTDIST_WATCHDOG_TIMEOUT_SEC`` (or torchft's
``TORCHFT_WATCHDOG_TIMEOUT_SEC``; default 30 s, read when the timer thread
first starts) as a stuck process: with
timeouts no longer firing, a fault could hang the job, so it prints
``TimeoutManager is stuck. Exiting.`` and exits with status 1, as torchft's
does.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.futures import Future

from ftdist._accelerator import get_stream_context
from ftdist._durations import as_timedelta

logger = logging.getLogger(__name__)

T = TypeVar("T")

WATCHDOG_TIMEOUT_SEC = "TORCHFT_WATCHDOG_TIMEOUT_SEC"
_WATCHDOG_VARS = ("FTDIST_WATCHDOG_TIMEOUT_SEC", WATCHDOG_TIMEOUT_SEC)
_DEFAULT_WATCHDOG = timedelta(seconds=30)
# How long the timer thread waits for a new timer before it exits.
_IDLE_LINGER_S = 0.5


def _watchdog_interval() -> timedelta:
    for name in _WATCHDOG_VARS:
        value = os.environ.get(name)
        if value is not None:
            try:
                return as_timedelta(float(value), name)
            except ValueError:
                logger.warning("ignoring %s=%r: not a positive number of seconds", name, value)
    return _DEFAULT_WATCHDOG


class _Timer:
    """One scheduled callback; ``cancelled`` is read by the timer thread."""

    __slots__ = ("callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], object]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False


def _nothing() -> None:
    return None


# The heap is rebuilt once more than this many of its timers, and more than
# half of them, are cancelled.
_COMPACT_AT = 256


class _TimerHandle:
    """Cancels one timer; it may be cancelled before the timer is attached.

    ``cancel`` may be called once (a second call raises ``AssertionError``,
    as torchft's does: it means a completion callback ran twice).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timer: Any = None
        self._cancelled = False

    def set_timer_handle(self, timer: Any) -> None:
        """Attach the timer this handle cancels (cancelled at once if already cancelled).

        Args:
            timer: anything with a ``cancel()`` method.
        """
        with self._lock:
            if self._cancelled:
                timer.cancel()
            else:
                self._timer = timer

    set_timer = set_timer_handle  # torchft's early-2025 name

    def cancel(self) -> None:
        """Cancel the timer (or the timer yet to be attached).

        Raises:
            AssertionError: the handle was already cancelled.
        """
        with self._lock:
            assert not self._cancelled, "timer can only be cancelled once"
            self._cancelled = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()


class _ScheduledTimer:
    """What :class:`_TimerHandle` holds: cancels a :class:`_Timer` in its manager."""

    def __init__(self, manager: _TimeoutManager, timer: _Timer) -> None:
        self._manager = manager
        self._timer = timer

    def cancel(self) -> None:
        self._manager._cancel(self._timer)


class _TimeoutManager:
    """The process's timer thread and its watchdog (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Timer]] = []
        self._cancelled = 0  # cancelled timers still in the heap
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._watchdog_thread: threading.Thread | None = None
        self._thread_done = threading.Event()
        self._stopping = False
        # monotonic start of the callback running now, for the watchdog
        self._running_since: float | None = None
        # Read from the environment when the threads first start, not at
        # import: a process forked from a fork server that imported this
        # module (ftdist._forkserver) sets its own environment after the fork.
        self._watchdog_interval: timedelta | None = None
        # Accelerator events are destroyed on a caller's thread, never on the
        # timer thread: destroying one can block while the device queue is full.
        self._del_queue: queue.SimpleQueue[object] = queue.SimpleQueue()

    # -- scheduling ----------------------------------------------------------
    def _schedule(self, callback: Callable[[], object], timeout: timedelta) -> _ScheduledTimer:
        timer = _Timer(time.monotonic() + timeout.total_seconds(), callback)
        with self._cond:
            heapq.heappush(self._heap, (timer.deadline, next(self._seq), timer))
            self._start_locked()
            self._cond.notify()
        return _ScheduledTimer(self, timer)

    def _cancel(self, timer: _Timer) -> None:
        with self._cond:
            if not timer.cancelled:
                timer.cancelled = True
                # A cancelled timer stays in the heap until it reaches the
                # top (its deadline, the Manager's timeout: a minute by
                # default). Its callback reaches what the caller's future
                # held (a reduced tensor, the Manager, its model); dropped
                # here, none of that outlives the completion.
                timer.callback = _nothing
                self._cancelled += 1
                if self._cancelled > _COMPACT_AT and 2 * self._cancelled > len(self._heap):
                    # Most entries dead (a step's buckets, each completed
                    # well before its timeout): rebuild instead of letting
                    # thousands of shells wait for their deadlines.
                    self._heap = [entry for entry in self._heap if not entry[2].cancelled]
                    heapq.heapify(self._heap)
                    self._cancelled = 0
                self._cond.notify()

    def _start_locked(self) -> None:
        # A timer scheduled during shutdown() keeps the thread serving.
        self._stopping = False
        if self._thread is not None:
            return
        if self._watchdog_interval is None:
            self._watchdog_interval = _watchdog_interval()
        self._thread_done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ftdist-timeout-manager", daemon=True
        )
        self._watchdog_thread = threading.Thread(
            target=self._watchdog_loop,
            args=(self._thread_done,),
            name="ftdist-timeout-watchdog",
            daemon=True,
        )
        self._thread.start()
        self._watchdog_thread.start()

    def _next_due(self) -> _Timer | None:
        """Pop the next due timer, or wait; None means: exit the thread. Holds the lock."""
        idle_since: float | None = None
        while True:
            while self._heap and self._heap[0][2].cancelled:
                heapq.heappop(self._heap)
                self._cancelled = max(0, self._cancelled - 1)
            if self._stopping:
                return None
            now = time.monotonic()
            if not self._heap:
                idle_since = now if idle_since is None else idle_since
                remaining = _IDLE_LINGER_S - (now - idle_since)
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
                continue
            idle_since = None
            deadline, _, timer = self._heap[0]
            if deadline > now:
                self._cond.wait(deadline - now)
                continue
            heapq.heappop(self._heap)
            timer.cancelled = True
            self._running_since = now
            return timer

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    timer = self._next_due()
                    if timer is None:
                        self._thread = None
                        return
                try:
                    timer.callback()
                except Exception:
                    logger.exception("a timeout callback failed")
                finally:
                    with self._cond:
                        self._running_since = None
        finally:
            self._thread_done.set()

    def _watchdog_interval_s(self) -> float:
        # Set before the thread starts; None again only if a caller resets
        # it while the thread still runs (a test's monkeypatch undone first).
        interval = self._watchdog_interval
        return (interval or _DEFAULT_WATCHDOG).total_seconds()

    def _watchdog_loop(self, done: threading.Event) -> None:
        while not done.wait(self._watchdog_interval_s() / 2):
            interval = self._watchdog_interval_s()
            with self._cond:
                since = self._running_since
            if since is not None and time.monotonic() - since > interval:
                print("TimeoutManager is stuck. Exiting.", file=sys.stderr, flush=True)
                try:
                    sys.exit(1)
                except SystemExit:
                    # sys.exit in a thread only ends the thread; the process
                    # must go, or faults may hang it with no timeout left.
                    os._exit(1)
                return

    def shutdown(self) -> None:
        """Cancel every pending timer and join the timer and watchdog threads.

        The next timer starts them again.
        """
        with self._cond:
            for _, _, timer in self._heap:
                timer.cancelled = True
            self._heap.clear()
            self._cancelled = 0
            self._stopping = True
            self._cond.notify_all()
            thread, watchdog = self._thread, self._watchdog_thread
        for t in (thread, watchdog):
            if t is not None and t is not threading.current_thread():
                t.join()

    # -- torchft's entry points ----------------------------------------------
    def register(self, fut: Future[T], timeout: timedelta) -> Future[T]:
        """See :func:`future_timeout`."""
        if type(fut).__module__ == "unittest.mock":
            return fut  # torchft passes mocks through untouched
        timeout = as_timedelta(timeout, "timeout", allow_zero=True)
        self._clear_del_queue()
        timed: Future[T] = Future()

        def expire() -> None:
            try:
                error = TimeoutError(f"future did not complete within {timeout}")
                timed.set_exception(error)  # type: ignore[arg-type]
            except RuntimeError:
                pass  # completed meanwhile

        handle = _TimerHandle()
        handle.set_timer_handle(self._schedule(expire, timeout))
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None

        def complete(done: Future[T]) -> None:
            with get_stream_context(stream):
                handle.cancel()
                try:
                    value = done.wait()
                except Exception as exc:
                    try:
                        timed.set_exception(exc)  # type: ignore[arg-type]
                    except RuntimeError:
                        pass  # timed out already
                    return
                try:
                    timed.set_result(value)
                except RuntimeError:
                    pass  # timed out already

        fut.add_done_callback(complete)
        return timed

    @contextmanager
    def context_timeout(self, callback: Callable[[], object], timeout: timedelta) -> Iterator[None]:
        """See :func:`context_timeout`."""
        timeout = as_timedelta(timeout, "timeout", allow_zero=True)
        self._clear_del_queue()
        handle = _TimerHandle()
        handle.set_timer_handle(self._schedule(callback, timeout))
        try:
            yield
        finally:
            handle.cancel()

    def stream_timeout(self, callback: Callable[[], object], timeout: timedelta) -> None:
        """See :func:`stream_timeout`."""
        timeout = as_timedelta(timeout, "timeout", allow_zero=True)
        self._clear_del_queue()
        if not torch.accelerator.is_available():
            return  # no accelerator stream: nothing queued can be late
        event = torch.Event()
        event.record()
        box: list[object] = [event]
        del event

        def check() -> None:
            late = not box[0].query()  # type: ignore[attr-defined]
            self._del_queue.put(box.pop())
            if late:
                callback()

        self._schedule(check, timeout)

    def _clear_del_queue(self) -> int:
        """Drop the events the timer thread finished with; returns how many."""
        count = 0
        while True:
            try:
                self._del_queue.get_nowait()
            except queue.Empty:
                return count
            count += 1


_TIMEOUT_MANAGER = _TimeoutManager()


def future_timeout(fut: Future[T], timeout: timedelta) -> Future[T]:
    """A future with ``fut``'s outcome, or ``TimeoutError`` if ``fut`` is late.

    Args:
        fut: the future to bound.
        timeout: how long ``fut`` may take (a timedelta or seconds).

    Returns:
        A new future: ``fut``'s result or exception once ``fut`` completes, or
        ``TimeoutError("future did not complete within <timeout>")`` if it has
        not completed within ``timeout``. ``fut`` itself is not cancelled.

    Raises:
        TypeError: ``timeout`` is not a duration.
        ValueError: ``timeout`` is negative.
    """
    return _TIMEOUT_MANAGER.register(fut, timeout)


def when_done(
    fut: Future[T],
    timeout: timedelta,
    callback: Callable[[T | None, BaseException | None], None],
) -> None:
    """Call ``callback(value, None)`` when ``fut`` completes, ``(None, error)``
    when it fails, or ``(None, TimeoutError)`` once ``timeout`` passed first.

    Like :func:`future_timeout` without the intermediate future: the Manager
    bounds every bucket of every step with it. The callback runs exactly
    once, on the thread that completed ``fut`` or on the timer thread; it
    must not raise or block.

    Raises:
        TypeError: ``timeout`` is not a duration.
        ValueError: ``timeout`` is negative.
    """
    timeout = as_timedelta(timeout, "timeout", allow_zero=True)
    if fut.done():
        # Already complete (a dummy group's work, say): no timer to arm.
        try:
            result = fut.value()
        except Exception as exc:
            callback(None, exc)
        else:
            callback(result, None)
        return
    lock = threading.Lock()
    settled = [False]

    def settle(value: T | None, error: BaseException | None) -> None:
        with lock:
            if settled[0]:
                return
            settled[0] = True
        callback(value, error)

    timer = _TIMEOUT_MANAGER._schedule(
        lambda: settle(None, TimeoutError(f"future did not complete within {timeout}")), timeout
    )

    def done(f: Future[T]) -> None:
        timer.cancel()
        try:
            value = f.value()
        except Exception as exc:
            settle(None, exc)
        else:
            settle(value, None)

    fut.add_done_callback(done)


def future_wait(fut: Future[T], timeout: timedelta) -> T:
    """Wait for ``fut`` at most ``timeout`` and return its result.

    Args:
        fut: the future to wait for.
        timeout: how long to wait (a timedelta or seconds).

    Returns:
        The future's result.

    Raises:
        TimeoutError: ``fut`` did not complete within ``timeout``.
        Exception: the future's own exception, if it failed.
    """
    timeout = as_timedelta(timeout, "timeout", allow_zero=True)
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(timeout.total_seconds()):
        raise TimeoutError(f"future did not complete within {timeout}")
    return fut.wait()


@contextmanager
def context_timeout(callback: Callable[[], object], timeout: timedelta) -> Iterator[None]:
    """Call ``callback`` (on the timer thread) if the block has not exited within ``timeout``.

    The timer is cancelled when the block exits, normally or by an exception.

    Args:
        callback: what to run when the block is late; it must not block.
        timeout: how long the block may take (a timedelta or seconds).

    Yields:
        Nothing.

    Raises:
        TypeError: ``timeout`` is not a duration.
        ValueError: ``timeout`` is negative.
    """
    with _TIMEOUT_MANAGER.context_timeout(callback, timeout):
        yield


def stream_timeout(callback: Callable[[], object], timeout: timedelta) -> None:
    """Call ``callback`` if the current accelerator stream's queued work is late.

    An event is recorded on the current stream now; if it has not completed
    ``timeout`` later, ``callback`` runs on the timer thread. Without an
    accelerator nothing is queued, so nothing happens.

    Args:
        callback: what to run when the stream is late; it must not block.
        timeout: how long the queued work may take (a timedelta or seconds).

    Raises:
        TypeError: ``timeout`` is not a duration.
        ValueError: ``timeout`` is negative.
    """
    _TIMEOUT_MANAGER.stream_timeout(callback, timeout)


__all__ = [
    "WATCHDOG_TIMEOUT_SEC",
    "context_timeout",
    "future_timeout",
    "future_wait",
    "stream_timeout",
    "when_done",
]
