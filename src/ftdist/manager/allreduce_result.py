"""
What a Manager allreduce returns
================================

:meth:`Manager.allreduce <ftdist.manager.Manager.allreduce>` returns an
:class:`AllreduceResult`: a ``torch.futures.Future`` of the reduced tensor
that also answers the ``Work`` methods. It serves both generations of
torchft's API:

* seed era (early 2025): the future itself. A DDP comm hook may return it
  as is (it completes on its own, without anyone calling ``wait``), and
  ``wait()``/``value()`` return the tensor.
* today's torchft: a ``Work`` with ``get_future()``, ``wait()``,
  ``is_completed()``, ``synchronize()``, ``block_current_stream()``.

Where the two conflict, the seed wins: ``wait()`` returns the tensor, not
``True``/``False`` (so ``if not work.wait():`` does not work on a tensor of
several elements; test ``manager.errored()`` instead). The result is
therefore not a ``torch.distributed.Work``; :class:`~ftdist.process_group.work.FutureWork` adapts it
where one is required (``ManagedProcessGroup``).

Every result completes within the Manager's timeout: a collective that
hangs (a stopped peer, a hung Baby child) becomes a recorded error, the
Manager aborts its process group (which kills a hung Baby child), and the
result resolves to the tensor as it is. Errors are never raised from
``wait()`` or ``value()``; they go to the Manager and the step votes no.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ftdist.futures import when_done

if TYPE_CHECKING:
    from ftdist.manager.manager import Manager

__all__ = ["AllreduceResult", "bounded_future"]

T = TypeVar("T")


def bounded_future(
    fut: torch.futures.Future[T],
    default: T,
    timeout: timedelta,
    on_error: Callable[[BaseException], None],
) -> torch.futures.Future[T]:
    """``fut``'s value, or ``default`` once ``fut`` failed or ``timeout`` passed.

    The failure (a ``TimeoutError`` for the timeout) goes to ``on_error``;
    the returned future never fails.
    """
    out: torch.futures.Future[T] = torch.futures.Future()

    def settle(value: T | None, error: BaseException | None) -> None:
        if error is not None:
            on_error(error)
            value = default
        out.set_result(value)  # type: ignore[arg-type]

    when_done(fut, timeout, settle)
    return out


class AllreduceResult(torch.futures.Future[torch.Tensor]):
    """The reduced tensor of one Manager allreduce; also a ``Work``.

    Completes (eagerly) when the collective does: with the tensor reduced in
    place and divided by ``divisor`` for an average, or, after an error or a
    timeout (recorded with the Manager), with the tensor as it is.

    Args:
        manager: the Manager that records errors.
        work: the process group's work, or None when nothing runs (the
            result is complete at once).
        tensor: the tensor being reduced in place.
        divisor: divide by this when the reduction completes (None: don't).
        timeout: bound on the collective.
    """

    def __init__(
        self,
        manager: Manager,
        work: Any,
        tensor: torch.Tensor,
        divisor: int | None,
        timeout: timedelta,
    ) -> None:
        super().__init__()
        self._tensor = tensor
        self._chained: list[torch.futures.Future[Any]] = []
        self._chain_lock = threading.Lock()
        self._done = threading.Event()
        if work is None:
            self._complete()
            return

        # One callback, on the thread that completes the collective (or the
        # timer's): it sees the collective's own exception, where then()
        # would rewrap it, and no intermediate future sits in between.
        def settle(value: Any, error: BaseException | None) -> None:
            if error is not None:
                manager._collective_failed(error)
            elif divisor:
                tensor.div_(divisor)
            self._complete()

        when_done(work.get_future(), timeout, settle)

    def _complete(self) -> None:
        self._done.set()
        self.set_result(self._tensor)

    def then(
        self, callback: Callable[[torch.futures.Future[torch.Tensor]], Any]
    ) -> torch.futures.Future[Any]:
        """Run ``callback`` on this future once the reduction is done.

        :meth:`wait` returns only after every callback attached here ran.
        """
        fut = super().then(callback)
        with self._chain_lock:
            self._chained.append(fut)
        return fut

    def wait(self, timeout: timedelta | None = None) -> torch.Tensor:
        """Wait for the reduction and the callbacks attached with :meth:`then`.

        Args:
            timeout: give up waiting after this long (the result still
                completes within the Manager's timeout on its own).

        Returns:
            The tensor (reduced, or as it was after an error).
        """
        if timeout is not None:
            self._done.wait(timeout.total_seconds())
            if not self._done.is_set():
                return self._tensor
        super().wait()
        with self._chain_lock:
            chained = list(self._chained)
        for fut in chained:
            try:
                fut.wait()
            except Exception:  # a user callback's own error; the step result stands
                pass
        return self._tensor

    def get_future(self) -> AllreduceResult:
        """This result (a future of the reduced tensor)."""
        return self

    def is_completed(self) -> bool:
        """Whether the reduction finished (or failed, or timed out)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether it completed; errors are the Manager's, see ``Manager.errored()``."""
        return self._done.is_set()

    def exception(self) -> None:
        """Always None: errors go to the Manager, not to the result."""
        return None

    def result(self) -> list[torch.Tensor]:
        """``[tensor]``, as a ``Work`` reports its outputs."""
        self.wait()
        return [self._tensor]

    def synchronize(self) -> None:
        """Wait for the reduction (CPU tensors: nothing to order on a stream)."""
        self.wait()

    def block_current_stream(self, timeout: timedelta | None = None) -> None:
        """Wait for the reduction before the current stream goes on."""
        self.wait(timeout)
