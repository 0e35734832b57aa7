"""
Lazy work (torchft's managed work)
==================================

Today's torchft returns a ``_ManagedWork`` (here :class:`LazyWork`) from
``Manager.allreduce``: a
``Work`` whose future callbacks are only recorded by ``then`` and run once
someone waits on the work (or synchronizes it). ftdist's own allreduce
returns an :class:`~ftdist.manager.allreduce_result.AllreduceResult` instead (the seed
era's future; see the conflict register in docs/torchft.md), but code and
tests written for today's torchft build these objects themselves, so they
exist here with torchft's behaviour:

* :class:`LazyWork` ``(manager, work, value)``: ``get_future()`` is the
  tail of a chain of :class:`LazyFuture` nodes; ``then(cb)`` appends a
  node. ``wait()``, ``block_current_stream()`` and ``synchronize()`` build
  the chain on the work's future: each callback receives a
  :class:`SimpleFuture` of the previous callback's return value (the first
  one receives ``value``), in the order they were added, once the work's
  future completes (on whichever thread completes it). Only the first link
  is bounded by ``manager.wrap_future`` (its timeout and error recording).
* ``wait(timeout=None)`` passes ``timeout`` to the work only when given,
  returns True, and on any error logs it through ``manager._logger``,
  reports the original exception with ``manager.report_error`` and
  returns False. It touches nothing else of the manager.
* :class:`ManagerLogger`: the ``[replica/group rank - step n]`` log prefix.

torchft's names (``_ManagedWork``, ``_ManagedFuture``, ``_SimpleFuture``,
``_ManagerLogger``) are aliases at the end of this module and in
:mod:`ftdist.manager`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ftdist._accelerator import get_stream_context

__all__ = ["LazyFuture", "LazyWork", "ManagerLogger", "SimpleFuture"]

T = TypeVar("T")
S = TypeVar("S")

_CHAIN_ONLY = "this future only carries a value along LazyWork's callback chain"
_LAZY = "this future only records callbacks; wait on its LazyWork to run them"


class ManagerLogger:
    """Log lines prefixed with ``[replica_id/group_rank - step n]`` (torchft's format).

    Args:
        manager: whose step goes into the prefix (``current_step()``).
        replica_id: the replica group's id.
        group_rank: this rank in the replica group.
    """

    def __init__(self, manager: Any, replica_id: str, group_rank: int) -> None:
        self._logger = logging.getLogger("ftdist.manager")
        # Weakly: the Manager caches this logger, and a strong reference back
        # would keep a dropped Manager (and the model it reaches) alive until
        # the cyclic collector ran. (An object without weak references, a
        # stand-in of a test, is held as it is.)
        try:
            self._manager: Callable[[], Any] = weakref.ref(manager)
        except TypeError:
            self._manager = lambda: manager
        self._replica_id = replica_id
        self._group_rank = group_rank

    def prefix(self) -> str:
        """The prefix of every line."""
        manager = self._manager()
        step = "?" if manager is None else manager.current_step()
        return f"[{self._replica_id}/{self._group_rank} - step {step}]"

    def info(self, msg: str) -> None:
        """Log ``msg`` at INFO."""
        self._logger.info("%s %s", self.prefix(), msg)

    def warn(self, msg: str) -> None:
        """Log ``msg`` at WARNING."""
        self._logger.warning("%s %s", self.prefix(), msg)

    warning = warn

    def exception(self, msg: str) -> None:
        """Log ``msg`` at ERROR with the exception being handled."""
        self._logger.exception("%s %s", self.prefix(), msg)


class SimpleFuture(torch.futures.Future[T]):
    """Hands one callback of the chain the previous callback's return value.

    Only :meth:`value` works: nothing may wait on or chain from it.

    Args:
        value: what :meth:`value` returns.
    """

    def __init__(self, value: Any) -> None:
        super().__init__()
        self._value = value

    def value(self) -> Any:
        """The carried value."""
        return self._value

    def then(self, callback: Callable[[torch.futures.Future[T]], S]) -> torch.futures.Future[S]:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_CHAIN_ONLY)

    def wait(self) -> Any:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_CHAIN_ONLY)

    def done(self) -> bool:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_CHAIN_ONLY)

    def add_done_callback(self, callback: Callable[[torch.futures.Future[T]], None]) -> None:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_CHAIN_ONLY)

    def set_result(self, result: Any) -> None:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_CHAIN_ONLY)

    def set_exception(self, result: Any) -> None:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_CHAIN_ONLY)


class LazyFuture(torch.futures.Future[T]):
    """One node of a :class:`LazyWork`'s callback chain.

    ``then`` records a callback and returns the next node; ``wait`` waits
    for this node's real future once the chain is built (building it if
    nobody has yet).

    Attributes:
        _fut: the real future behind this node, once the chain is built
            (the head's is the work's own future).
    """

    def __init__(self, work: weakref.ReferenceType[LazyWork]) -> None:
        super().__init__()
        self._work = work
        self._fut: torch.futures.Future[Any] | None = None
        self._callback: Callable[[torch.futures.Future[Any]], Any] | None = None
        self._next: LazyFuture[Any] | None = None

    def then(self, callback: Callable[[torch.futures.Future[T]], S]) -> torch.futures.Future[S]:
        """Record ``callback``; it runs when the work is waited on.

        Returns:
            The next node, which stands for ``callback``'s return value.

        Raises:
            RuntimeError: the work is gone, or its chain was already built.
        """
        work = self._work()
        if work is None:
            raise RuntimeError("the LazyWork of this future was garbage collected")
        if work._built:
            raise RuntimeError("the callback chain already ran; add callbacks before waiting")
        self._callback = callback
        self._next = LazyFuture(self._work)
        work._tail = self._next
        return self._next

    def wait(self) -> Any:
        """The value of this node, once its callbacks ran.

        Raises:
            RuntimeError: the work is gone before its chain was built.
            Exception: whatever the work or a callback raised.
        """
        if self._fut is None:
            work = self._work()
            if work is None:
                raise RuntimeError("the LazyWork of this future was garbage collected")
            work._build()
        assert self._fut is not None
        return self._fut.wait()

    def value(self) -> Any:
        """Not supported: wait on it instead.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_LAZY)

    def done(self) -> bool:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_LAZY)

    def add_done_callback(self, callback: Callable[[torch.futures.Future[T]], None]) -> None:
        """Not supported: use :meth:`then`.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_LAZY)

    def set_result(self, result: Any) -> None:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_LAZY)

    def set_exception(self, result: Any) -> None:
        """Not supported.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(_LAZY)


class LazyWork(dist._Work):
    """A process group's work whose future callbacks run lazily (see the module).

    Args:
        manager: reports errors (``report_error``, ``_logger``) and bounds
            the chain (``wrap_future``).
        work: the process group's work.
        value: what the first callback receives.
    """

    def __init__(self, manager: Any, work: Any, value: Any) -> None:
        super().__init__()
        self._manager = manager
        self._work = work
        self._value = value
        self._head: LazyFuture[Any] = LazyFuture(weakref.ref(self))
        self._tail: LazyFuture[Any] = self._head
        self._built = False
        self._stream = (
            torch.accelerator.current_stream() if torch.accelerator.is_available() else None
        )

    def _build(self) -> None:
        """Attach the recorded callbacks to the work's future, once."""
        if self._built:
            return
        self._built = True
        node = self._head
        node._fut = self._work.get_future()
        carried = [self._value]
        wrapped = False
        while node._next is not None:
            fut = node._fut.then(self._link(node, carried))
            if not wrapped:
                fut = self._manager.wrap_future(fut, carried[0])
                wrapped = True
            node = node._next
            node._fut = fut

    def _link(
        self, node: LazyFuture[Any], carried: list[Any]
    ) -> Callable[[torch.futures.Future[Any]], Any]:
        # One closure per node (bound now, not looked up when it runs: it
        # may run later, on the thread that completes the work).
        callback = node._callback
        assert callback is not None

        def run(prev: torch.futures.Future[Any]) -> Any:
            with get_stream_context(self._stream):
                prev.wait()  # the previous link's error, if any, fails this one
                carried[0] = callback(SimpleFuture(carried[0]))
                return carried[0]

        return run

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the work and run the callback chain.

        Args:
            timeout: passed to the work's ``wait`` (omitted when None).

        Returns:
            True, or False when the work or a callback failed (the error
            went to ``manager.report_error``).
        """
        try:
            with get_stream_context(self._stream):
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(timeout)
                self._build()
                self._tail.wait()
            return True
        except Exception as exc:
            self._manager._logger.exception(f"got exception waiting for work {exc}")
            self._manager.report_error(exc)
            return False

    def block_current_stream(self, timeout: timedelta | None = None) -> None:
        """Order the current stream after the work; build the chain."""
        with get_stream_context(self._stream):
            self._work.block_current_stream()
        self._build()

    def synchronize(self) -> None:
        """Order the current stream after the work (accelerators); build the chain."""
        if torch.cuda.is_available():
            self.block_current_stream()
        else:
            self._build()

    def get_future(self) -> torch.futures.Future[Any]:
        """The tail of the chain: stands for the last callback's return value."""
        return self._tail


# torchft's names (torchft.manager); ftdist.manager re-exports them.
_ManagedWork = LazyWork
_ManagedFuture = LazyFuture
_ManagerLogger = ManagerLogger
_SimpleFuture = SimpleFuture
