"""
Work objects
============

A reconfigurable group must be able to fail work that is still in flight on a
backend it tears down: Gloo's own ``abort()`` does not wake a thread blocked in
``Work.wait()`` (it waits out the full collective timeout). So every Work that
ftdist hands out belongs to a :class:`Generation`, one backend lifetime, and
``Generation.abort()`` wakes every waiter and fails every future at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftdist.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    ProcessGroupAbortedError,
)

# Extra time a waiter grants a backend beyond its own timeout before giving up
# on it: the backend's timeout error is more precise, so let it arrive first.
WAIT_MARGIN = timedelta(seconds=2)


def _seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        secs = timeout.total_seconds()
    else:
        secs = float(timeout)
    # torch passes timedelta(0) for "no timeout".
    return secs if secs > 0 else None


def completed_future(value: Any) -> torch.futures.Future:
    """A future that is already done with ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class _DummyWork(dist._Work):
    """Work that is already complete with ``result`` (used when nothing runs)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result
        self._fut = completed_future(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> Any:
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._fut


class Generation:
    """One lifetime of a backend; aborting it fails all of its in-flight work.

    Args:
        description: names the group in error messages.
        timeout: the backend's collective timeout; waits give up after it plus
            :data:`WAIT_MARGIN` even if the backend never reports.
    """

    def __init__(self, description: str, timeout: timedelta) -> None:
        self.description = description
        self.timeout = timeout
        self.error: ProcessGroupAbortedError | None = None
        self._lock = threading.Lock()
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()

    def add_listener(self, listener: Any) -> bool:
        """Register an object with an ``_on_abort(err)`` method.

        Returns False (and registers nothing) if the generation is already
        aborted; the caller must then fail at once.
        """
        with self._lock:
            if self.error is not None:
                return False
            self._listeners.add(listener)
            return True

    def abort(self, reason: str) -> None:
        """Fail every waiter and future of this generation with ``reason``."""
        with self._lock:
            if self.error is not None:
                return
            self.error = ProcessGroupAbortedError(
                f"{self.description}: {reason}; work in flight on it was abandoned"
            )
            listeners = list(self._listeners)
            self._listeners = weakref.WeakSet()
        for listener in listeners:
            listener._on_abort(self.error)


class _SettableOnce:
    """A torch future that only the first of several racing producers completes."""

    def __init__(self) -> None:
        self.fut: torch.futures.Future = torch.futures.Future()
        self._lock = threading.Lock()
        self._set = False

    def result(self, value: Any) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
        self.fut.set_result(value)

    def exception(self, exc: BaseException) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
        self.fut.set_exception(exc)


class FtWork(dist._Work):
    """Work of an ftdist group: abortable, time-bounded, with a completion step.

    Args:
        inner: the backend's work (or any object with ``is_completed``,
            ``wait`` and ``get_future``).
        generation: the backend lifetime the work belongs to.
        op: the collective's name, for error messages.
        post: run once after the inner work succeeds and before anyone sees the
            result (e.g. the division that emulates ``ReduceOp.AVG``).
    """

    def __init__(
        self,
        inner: Any,
        generation: Generation,
        op: str,
        post: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._gen = generation
        self._op = op
        self._post = post
        self._post_lock = threading.Lock() if post is not None else None
        self._event: threading.Event | None = None
        self._future: _SettableOnce | None = None

    # -- completion ---------------------------------------------------------
    def _run_post(self) -> None:
        if self._post_lock is None:
            return
        with self._post_lock:
            post, self._post = self._post, None
            if post is not None:
                post()

    def _on_abort(self, err: ProcessGroupAbortedError) -> None:
        if self._event is not None:
            self._event.set()
        if self._future is not None:
            self._future.exception(err)

    def _fail(self, exc: BaseException) -> CommunicationError:
        if isinstance(exc, CommunicationError):
            return exc
        return CommunicationError(f"{self._gen.description}: {self._op} failed: {exc}")

    # -- dist.Work API --------------------------------------------------------
    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the work completes.

        Raises:
            ProcessGroupAbortedError: the group was reconfigured or aborted
                while the work was in flight.
            CollectiveTimeoutError: not done within ``timeout`` (default: the
                group's timeout plus a margin).
            CommunicationError: the backend reported a failure.
        """
        inner = self._inner
        if not inner.is_completed():
            self._block(timeout)
        try:
            inner.wait()
        except Exception as exc:
            raise self._fail(exc) from exc
        self._run_post()
        return True

    def _block(self, timeout: timedelta | None) -> None:
        event = threading.Event()
        self._event = event
        if not self._gen.add_listener(self):
            raise self._gen.error or ProcessGroupAbortedError(self._gen.description)
        self._inner.get_future().add_done_callback(lambda _f: event.set())
        limit = _seconds(timeout)
        if limit is None:
            limit = (self._gen.timeout + WAIT_MARGIN).total_seconds()
        if not event.wait(limit):
            raise CollectiveTimeoutError(
                f"{self._gen.description}: {self._op} did not complete within {limit:.1f}s"
            )
        if not self._inner.is_completed() and self._gen.error is not None:
            raise self._gen.error

    def get_future(self) -> torch.futures.Future:
        """A future that completes with the backend's result, or fails on abort."""
        if self._future is not None:
            return self._future.fut
        once = _SettableOnce()
        self._future = once
        if not self._gen.add_listener(self):
            once.exception(self._gen.error or ProcessGroupAbortedError(self._gen.description))
            return once.fut

        def on_done(fut: torch.futures.Future) -> None:
            try:
                value = fut.value()
                self._run_post()
            except Exception as exc:
                once.exception(self._fail(exc))
                return
            once.result(value)

        self._inner.get_future().add_done_callback(on_done)
        return once.fut

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed()) or self._gen.error is not None

    def is_success(self) -> bool:
        return bool(self._inner.is_completed()) and self._inner.exception() is None

    def exception(self) -> Any:
        if self._gen.error is not None and not self._inner.is_completed():
            return self._gen.error
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()


__all__ = ["WAIT_MARGIN", "FtWork", "Generation", "completed_future"]
