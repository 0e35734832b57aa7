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
import time
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

# Collectives whose Gloo work tolerates a bounded wait(timeout) that expires:
# the work goes on and a later wait sees its result. Point-to-point works
# (and Gloo's reduce_scatter) must be waited exactly once, so they are
# watched from a thread instead.
SLICED_WAIT_OPS = frozenset(
    {
        "allreduce",
        "allreduce_coalesced",
        "broadcast",
        "reduce",
        "allgather",
        "all_gather_single",
        "allgather_coalesced",
        "gather",
        "scatter",
        "all_to_all_single",
        "alltoall",
        "barrier",
    }
)
# How often a sliced wait looks for an abort: the bound on abort latency.
WAIT_SLICE = timedelta(milliseconds=50)


def _seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        secs = timeout.total_seconds()
    else:
        secs = float(timeout)
    # torch passes timedelta(0) for "no timeout".
    return secs if secs > 0 else None


def completed_future(value: Any) -> torch.futures.Future[Any]:
    """A future that is already done with ``value``."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return fut


class CompletedWork(dist._Work):
    """Work that is already complete with ``result``.

    What an op returns when nothing needs to run: a group of one, an op
    swallowed after an error, a Manager step that already failed. torchft
    calls it ``_DummyWork`` (:mod:`ftdist.work`); ``result_`` and
    ``future_`` are its attribute names there.
    """

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

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    @property
    def result_(self) -> Any:
        return self._result

    @property
    def future_(self) -> torch.futures.Future[Any]:
        return self._fut


class WorkList:
    """Several backend works seen as one (for the coalesced collectives)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self._works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return torch.futures.collect_all([w.get_future() for w in self._works])

    def exception(self) -> Any:
        for w in self._works:
            if w.exception() is not None:
                return w.exception()
        return None

    def result(self) -> list[Any]:
        return [w.result() for w in self._works]

    def source_rank(self) -> int:
        raise RuntimeError("source_rank() is only defined for recv_anysource work")

    def synchronize(self) -> None:
        for w in self._works:
            w.synchronize()


class Generation:
    """One lifetime of a backend; aborting it fails all of its in-flight work.

    Args:
        description: names the group in error messages.
        timeout: the backend's collective timeout; waits give up after it plus
            :data:`WAIT_MARGIN` even if the backend never reports.

    :meth:`abort` hands its error to the waiters.
    """

    def __init__(self, description: str, timeout: timedelta) -> None:
        self.description = description
        self.timeout = timeout
        self.error: ProcessGroupAbortedError | None = None
        self._lock = threading.Lock()
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        self._works: weakref.WeakSet[Any] = weakref.WeakSet()

    def track(self, work: Any) -> None:
        """Count ``work`` (an object with ``in_flight()``) as this backend's."""
        with self._lock:
            self._works.add(work)

    def busy(self) -> bool:
        """Whether the backend may still be running an op of one of its works."""
        with self._lock:
            works = list(self._works)
        return any(w.in_flight() for w in works)

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


def on_complete(inner: Any, callback: Callable[[Any, BaseException | None], None]) -> None:
    """Call ``callback(value, error)`` once ``inner`` (a backend Work) completes.

    Some Gloo works (send, recv, reduce_scatter) have no future; for those a
    short-lived thread waits on the work instead. It ends when the backend
    completes or times the op out.
    """
    try:
        fut = inner.get_future()
    except RuntimeError:

        def waiter() -> None:
            try:
                inner.wait()
            except Exception as exc:
                callback(None, exc)
                return
            # Works without a future (send/recv) carry no result either.
            callback(None, None)

        threading.Thread(target=waiter, name="ftdist-work-wait", daemon=True).start()
        return

    def done(f: torch.futures.Future[Any]) -> None:
        try:
            value = f.value()
        except Exception as exc:
            callback(None, exc)
            return
        callback(value, None)

    fut.add_done_callback(done)


class _SettableOnce:
    """A torch future that only the first of several racing producers completes."""

    def __init__(self) -> None:
        self.fut: torch.futures.Future[Any] = torch.futures.Future()
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

    Completion is observed once, by one watcher (the backend future's
    callback, or a waiter thread for works without a future); ``wait`` and
    ``get_future`` both read what the watcher saw. A Gloo send/recv must be
    waited exactly once, so nothing else may call the inner ``wait``.

    Args:
        inner: the backend's work (or any object with ``is_completed``,
            ``wait`` and ``get_future``).
        generation: the backend lifetime the work belongs to.
        op: the collective's name, for error messages.
        post: run once after the inner work succeeds and before anyone sees the
            result (e.g. the division that emulates ``ReduceOp.AVG``).

    Raises:
        ProcessGroupAbortedError, CollectiveTimeoutError, CommunicationError:
            from :meth:`wait` (see there); the future fails with the same.
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
        self._lock = threading.Lock()
        self._watching = False
        self._outcome: tuple[Any, CommunicationError | None] | None = None
        self._event = threading.Event()
        self._future: _SettableOnce | None = None
        generation.track(self)

    def in_flight(self) -> bool:
        """Whether the backend may still be running this op (or its callbacks)."""
        try:
            return not bool(self._inner.is_completed())
        except Exception:  # a backend that cannot tell: assume the worst
            return True

    # -- completion ---------------------------------------------------------
    def _run_post(self) -> None:
        with self._lock:
            post, self._post = self._post, None
        if post is not None:
            post()

    def _fail(self, exc: BaseException) -> CommunicationError:
        if isinstance(exc, CommunicationError):
            return exc
        return CommunicationError(f"{self._gen.description}: {self._op} failed: {exc}")

    def _finish(self, value: Any, error: BaseException | None) -> None:
        if error is None:
            try:
                self._run_post()
            except Exception as exc:
                error = exc
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = (value, None if error is None else self._fail(error))
            future = self._future
        self._event.set()
        if future is not None:
            self._resolve(future)

    def _resolve(self, future: _SettableOnce) -> None:
        assert self._outcome is not None
        value, error = self._outcome
        if error is not None:
            future.exception(error)
        else:
            future.result(value)

    def _on_abort(self, err: ProcessGroupAbortedError) -> None:
        self._finish(None, err)

    def _watch(self) -> None:
        with self._lock:
            if self._watching:
                return
            self._watching = True
        if not self._gen.add_listener(self):
            self._finish(None, self._gen.error or ProcessGroupAbortedError(self._gen.description))
            return
        on_complete(self._inner, self._finish)

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
        limit = _seconds(timeout)
        if limit is None:
            limit = (self._gen.timeout + WAIT_MARGIN).total_seconds()
        if not self._watching and (self._op in SLICED_WAIT_OPS or self._inner.is_completed()):
            return self._sliced_wait(limit)
        self._watch()
        if not self._event.wait(limit):
            raise CollectiveTimeoutError(
                f"{self._gen.description}: {self._op} timed out: did not complete within {limit:g} s"
            )
        assert self._outcome is not None
        if self._outcome[1] is not None:
            raise self._outcome[1]
        return True

    def _sliced_wait(self, limit: float) -> bool:
        # Waiting inside the backend (GIL released) in bounded slices costs no
        # Python callback per op; between slices we look for an abort.
        deadline = time.monotonic() + limit
        inner = self._inner
        while True:
            try:
                inner.wait(WAIT_SLICE)
                break
            except Exception:
                if inner.is_completed():
                    # It may have completed just as the slice ran out: the
                    # unbounded wait returns its real result or error.
                    try:
                        inner.wait()
                    except Exception as exc:
                        raise self._fail(exc) from exc
                    break
            if self._gen.error is not None:
                raise self._gen.error
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"{self._gen.description}: {self._op} timed out: did not complete within {limit:g} s"
                )
        # A result that completed is valid even if the group was torn down
        # right after: the collective finished on every rank.
        self._run_post()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """A future that completes with the backend's result, or fails on abort."""
        with self._lock:
            if self._future is None:
                self._future = _SettableOnce()
                done = self._outcome is not None
            else:
                return self._future.fut
        if done:
            self._resolve(self._future)
        else:
            self._watch()
        return self._future.fut

    def is_completed(self) -> bool:
        return self._outcome is not None or bool(self._inner.is_completed())

    def is_success(self) -> bool:
        if self._outcome is not None:
            return self._outcome[1] is None
        return bool(self._inner.is_completed()) and self._inner.exception() is None

    def exception(self) -> Any:
        if self._outcome is not None:
            return self._outcome[1]
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> Any:
        if self._outcome is not None:
            return self._outcome[0]
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()


class FutureWork(dist._Work):
    """A ``torch.distributed.Work`` over a future of one tensor (the Manager's allreduce result).

    For callers that need a real ``Work`` (``dist.all_reduce(t, group=...)``
    on a ``ManagedProcessGroup``): ``wait()`` returns True once the result is
    done; errors stay with the Manager.
    """

    def __init__(self, result: torch.futures.Future[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the allreduce; True (its errors are the Manager's)."""
        self._result.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the allreduce finished."""
        return bool(self._result.done())

    def is_success(self) -> bool:
        """Whether it finished."""
        return bool(self._result.done())

    def get_future(self) -> torch.futures.Future[Any]:
        """A future of ``[tensor]``."""
        return self._result.then(lambda f: [f.value()])

    def result(self) -> list[torch.Tensor]:
        """``[tensor]`` once done."""
        return [self._result.wait()]


__all__ = [
    "WAIT_MARGIN",
    "CompletedWork",
    "FtWork",
    "FutureWork",
    "Generation",
    "completed_future",
    "on_complete",
]
