"""
A thread-backed multiprocessing context
=======================================

:func:`get_context` returns an object with the interface of
``multiprocessing.get_context()``'s contexts, built on
``multiprocessing.dummy`` (threads): code that takes a context runs its
"processes" as threads, e.g. to debug a Baby process group's worker in one
process (torchft's ``torchft.multiprocessing_dummy_context``).
"""

from __future__ import annotations

import multiprocessing.dummy as mp_dummy
import threading
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection
from typing import Any


class DummyContext:
    """A multiprocessing context whose processes are threads.

    Args:
        method: ignored (``get_context``'s start method).
    """

    def __init__(self, method: object = None) -> None:
        self.method = method

    def Process(
        self,
        group: object = None,
        target: Callable[..., object] | None = None,
        name: str | None = None,
        args: Iterable[object] = (),
        kwargs: Mapping[str, object] | None = None,
        daemon: bool | None = None,
    ) -> Any:
        """A thread with ``Process``'s interface (``daemon`` is ignored).

        Returns:
            A ``multiprocessing.dummy.DummyProcess``, not started.
        """
        return mp_dummy.Process(
            group=group, target=target, name=name, args=args, kwargs=dict(kwargs or {})
        )

    def Pipe(self, duplex: bool = True) -> tuple[Connection, Connection]:
        """Two connected ends, as ``multiprocessing.dummy.Pipe``.

        Returns:
            The two ends.
        """
        ends: tuple[Connection, Connection] = mp_dummy.Pipe(duplex)  # type: ignore[assignment]
        return ends

    def Queue(self, maxsize: int = 0) -> Any:
        """A thread-safe queue.

        Returns:
            A ``queue.Queue``.
        """
        return mp_dummy.Queue(maxsize)

    def Event(self) -> threading.Event:
        """A ``threading.Event``."""
        return threading.Event()

    def Lock(self) -> Any:
        """A ``threading.Lock``."""
        return threading.Lock()

    def RLock(self) -> Any:
        """A ``threading.RLock``."""
        return threading.RLock()

    def Semaphore(self, value: int = 1) -> threading.Semaphore:
        """A ``threading.Semaphore``."""
        return threading.Semaphore(value)

    def BoundedSemaphore(self, value: int = 1) -> threading.BoundedSemaphore:
        """A ``threading.BoundedSemaphore``."""
        return threading.BoundedSemaphore(value)

    def Condition(self, lock: Any = None) -> threading.Condition:
        """A ``threading.Condition`` (on ``lock`` if given)."""
        return threading.Condition(lock)

    def Manager(self) -> Any:
        """``multiprocessing.dummy.Manager()``: the ``multiprocessing.dummy`` module."""
        return mp_dummy.Manager()


def get_context(method: object = None) -> DummyContext:
    """Return a :class:`DummyContext` (``method`` is ignored).

    Args:
        method: ignored; accepted as ``multiprocessing.get_context`` does.

    Returns:
        The context.
    """
    return DummyContext(method)


__all__ = ["DummyContext", "get_context"]
